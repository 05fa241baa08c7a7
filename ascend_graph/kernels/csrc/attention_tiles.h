/* The tiles of decode_attention.c (one translation unit includes this): vectors of float32
 * (LANES of them), bfloat16 loads widened exactly, e^x, the score and value tiles over token
 * rows; on AVX512-BF16 also their vdpbf16ps forms (PAIRS). Compiled only where AG_VEC_BITS. */
#ifndef AG_ATTENTION_TILES_H
#define AG_ATTENTION_TILES_H

#include <math.h>
#include <string.h>

#include "vec.h"

#if AG_VEC_BITS
#define LANES (AG_VEC_BITS / 32)
typedef float vf __attribute__((vector_size(AG_VEC_BITS / 8)));

/* tiles sized for the vector registers: 32 of 512 bits, 16 of 256 */
#define TH 4                          /* query heads per score tile */
#define TT (AG_VEC_BITS == 512 ? 4 : 2) /* tokens per score tile */
#define VH (AG_VEC_BITS == 512 ? 8 : 4) /* query heads per value tile (by two vectors of each) */


AG_INLINE vf load_f32(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}
AG_INLINE vf load_bf16(const uint16_t *p) { /* widened exactly: the bits shifted into the upper half */
#if AG_VEC_BITS == 512
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#else
    return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#endif
}
AG_INLINE float bf16_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
AG_INLINE vf load_elem(const void *p, long i, int bf16) {
    return bf16 ? load_bf16((const uint16_t *)p + i) : load_f32((const float *)p + i);
}
AG_INLINE float scalar_elem(const void *p, long i, int bf16) {
    return bf16 ? bf16_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}
typedef int32_t vi __attribute__((vector_size(AG_VEC_BITS / 8)));
/* e^x for x <= 0 (below -87, 0 or a denormal), within 2 ulp: 2^n times a degree-7 polynomial of the rest */
AG_INLINE vf vexp(vf x) {
    const vf lo = (vf){0} - 87.0f;
    vi below = x < lo;
    x = (vf)(((vi)lo & below) | ((vi)x & ~below));
    vf n = (x * 1.44269504f + 12582912.0f) - 12582912.0f; /* round to nearest */
    vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vf p = 1.9875691500e-4f * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    vi e = (__builtin_convertvector(n, vi) + 127) << 23;
    return p * (vf)e;
}
AG_INLINE float hsum(vf v) {
#if AG_VEC_BITS == 512
    return _mm512_reduce_add_ps((__m512)v);
#else
    __m128 x = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
#endif
}
/* one cache element: its base and its block, token row and kv head strides (elements); rows of width contiguous */
typedef struct {
    const void *base;
    long width, sblock, srow, shead;
} elem_t;
AG_INLINE const void *row_of(const elem_t *e, long block, long row, long head, int bf16) {
    long off = block * e->sblock + row * e->srow + head * e->shead;
    return bf16 ? (const void *)((const uint16_t *)e->base + off) : (const void *)((const float *)e->base + off);
}

/* s[h * ld + t] += q[h] (nh <= TH rows, width w, stride w) . rows[t] (nt <= TT) */
AG_INLINE void score_tile(const float *q, long w, const void *const *rows, int nh, int nt, float *s, long ld,
                          int bf16) {
    vf acc[TH][TT];
    for (int h = 0; h < TH; h++)
        for (int t = 0; t < TT; t++) acc[h][t] = (vf){0};
    long c = 0;
    for (; c + LANES <= w; c += LANES) {
        vf x[TT];
        for (int t = 0; t < TT; t++) x[t] = t < nt ? load_elem(rows[t], c, bf16) : (vf){0};
        for (int h = 0; h < TH; h++) {
            if (h >= nh) break;
            vf qh = load_f32(q + h * w + c);
            for (int t = 0; t < TT; t++) acc[h][t] += qh * x[t];
        }
    }
    for (int h = 0; h < nh; h++)
        for (int t = 0; t < nt; t++) {
            float sum = hsum(acc[h][t]);
            for (long cc = c; cc < w; cc++) sum += q[h * w + cc] * scalar_elem(rows[t], cc, bf16);
            s[h * ld + t] += sum;
        }
}

/* acc[h] (nh <= VH rows from h0, width w) += p[h * ld + t] * rows[t] for t < n */
AG_INLINE void value_tile(float *acc, long h0, int nh, long w, const float *p, long ld, const void *const *rows,
                          long n, int bf16) {
        long c = 0;
        for (; c + 2 * LANES <= w; c += 2 * LANES) {
            vf a0[VH], a1[VH];
            for (int h = 0; h < nh; h++) a0[h] = load_f32(acc + (h0 + h) * w + c), a1[h] = load_f32(acc + (h0 + h) * w + c + LANES);
            for (long t = 0; t < n; t++) {
                vf x0 = load_elem(rows[t], c, bf16), x1 = load_elem(rows[t], c + LANES, bf16);
                for (int h = 0; h < VH; h++) {
                    if (h >= nh) break;
                    float ph = p[(h0 + h) * ld + t];
                    a0[h] += ph * x0, a1[h] += ph * x1;
                }
            }
            for (int h = 0; h < nh; h++)
                memcpy(acc + (h0 + h) * w + c, &a0[h], sizeof(vf)), memcpy(acc + (h0 + h) * w + c + LANES, &a1[h], sizeof(vf));
        }
        for (; c < w; c++)
            for (int h = 0; h < nh; h++) {
                float sum = acc[(h0 + h) * w + c];
                for (long t = 0; t < n; t++) sum += p[(h0 + h) * ld + t] * scalar_elem(rows[t], c, bf16);
                acc[(h0 + h) * w + c] = sum;
            }
}

/* acc[h] (g rows of width w) += p[h * ld + t] * rows[t] for t < n */
AG_INLINE void value_block(float *acc, long g, long w, const float *p, long ld, const void *const *rows, long n,
                           int bf16) {
    for (long h0 = 0; h0 < g; h0 += VH) {
        if (g - h0 >= VH)
            value_tile(acc, h0, VH, w, p, ld, rows, n, bf16);
        else
            value_tile(acc, h0, (int)(g - h0), w, p, ld, rows, n, bf16);
    }
}

#if AG_VEC_BITS == 512
#define PAIRS 1 /* bfloat16 caches: the products in vdpbf16ps, over bf16 pairs */
AG_INLINE __m512i load_pairs(const uint16_t *p, long count) {
    return count >= 32 ? _mm512_loadu_si512(p) : ag_bf16x32_load_part(p, count);
}

/* s[h * ld + t] += scale * (q[h] . rows[t]): nh <= TH bf16 rows q (stride w), nt <= TT rows */
AG_INLINE void score_tile_pairs(const uint16_t *q, long w, const void *const *rows, int nh, int nt, float *s, long ld,
                                float scale) {
    __m512 acc[TH][TT];
    for (int h = 0; h < TH; h++)
        for (int t = 0; t < TT; t++) acc[h][t] = _mm512_setzero_ps();
    for (long c = 0; c < w; c += 32) {
        const long count = w - c;
        __m512i x[TT];
        for (int t = 0; t < TT; t++)
            x[t] = t < nt ? load_pairs((const uint16_t *)rows[t] + c, count) : _mm512_setzero_si512();
        for (int h = 0; h < TH; h++) {
            if (h >= nh) break;
            __m512i qh = load_pairs(q + h * w + c, count);
            for (int t = 0; t < TT; t++) acc[h][t] = _mm512_dpbf16_ps(acc[h][t], (__m512bh)qh, (__m512bh)x[t]);
        }
    }
    for (int h = 0; h < nh; h++)
        for (int t = 0; t < nt; t++) s[h * ld + t] += scale * _mm512_reduce_add_ps(acc[h][t]);
}

/* acc[h] (nh <= VH rows from h0, width w) += the n rows weighted by pp[h * np + t / 2]: the
 * probabilities of tokens t, t + 1 as one bf16 pair (the second 0 past n) */
AG_INLINE void value_tile_pairs(float *acc, long h0, int nh, long w, const uint32_t *pp, long np,
                                const void *const *rows, long n) {
    long c = 0;
    for (; c + 32 <= w; c += 32) {
        __m512 lo[VH], hi[VH];
        for (int h = 0; h < nh; h++)
            lo[h] = _mm512_loadu_ps(acc + (h0 + h) * w + c), hi[h] = _mm512_loadu_ps(acc + (h0 + h) * w + c + 16);
        for (long t = 0; t < n; t += 2) {
            __m512i r0 = _mm512_loadu_si512((const uint16_t *)rows[t] + c);
            __m512i r1 = t + 1 < n ? _mm512_loadu_si512((const uint16_t *)rows[t + 1] + c) : _mm512_setzero_si512();
            ag_bf16x32 xl, xh;
            ag_interleave_pairs(r0, r1, &xl, &xh);
            for (int h = 0; h < VH; h++) {
                if (h >= nh) break;
                __m512i pw = _mm512_set1_epi32((int32_t)pp[(h0 + h) * np + t / 2]);
                lo[h] = _mm512_dpbf16_ps(lo[h], (__m512bh)pw, (__m512bh)xl);
                hi[h] = _mm512_dpbf16_ps(hi[h], (__m512bh)pw, (__m512bh)xh);
            }
        }
        for (int h = 0; h < nh; h++)
            _mm512_storeu_ps(acc + (h0 + h) * w + c, lo[h]), _mm512_storeu_ps(acc + (h0 + h) * w + c + 16, hi[h]);
    }
    for (; c < w; c++)
        for (int h = 0; h < nh; h++) {
            float sum = acc[(h0 + h) * w + c];
            for (long t = 0; t < n; t++) {
                uint32_t pair = pp[(h0 + h) * np + t / 2];
                sum += bf16_f32((uint16_t)(t % 2 ? pair >> 16 : pair)) * bf16_f32(((const uint16_t *)rows[t])[c]);
            }
            acc[(h0 + h) * w + c] = sum;
        }
}
#else
#define PAIRS 0
#endif
#endif

#endif
