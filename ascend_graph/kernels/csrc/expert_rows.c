/* Few-row matmuls on CPU for a decode step: the routed experts' rows (a few per expert) and, with
 * one "expert", a dense product of a few rows; over the weights as the checkpoint stores them
 * (row-major [N, K] per expert, nothing packed). From 5 rows of one weight, the wide forms (below;
 * AVX-512 only).
 * kn_rows: the same for matrices stored [K, N] (MLA decode's attention values).
 * paged_rows / paged_kn: MLA decode's attention scores and values over a paged KV cache, each
 * block read where it lies through the block table.
 * Built at first use with the system C compiler for this CPU and called through ctypes by
 * expert_rows.py. bfloat16 pair dot products (vdpbf16ps) accumulate in float32; each output is
 * rounded once to bfloat16, to nearest even. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512BF16__)
#define KERNEL 512
#define AS_BH (__m512bh) /* an integer vector read as bf16 pairs */
#elif defined(__AVX2__) && defined(__FMA__)
#define KERNEL 256
/* A CPU with AVX2 and FMA but not AVX512-BF16 (Zen 3, most x86 servers before 2022): the
 * row-major products run forms of their own (tile and wide form, below: AVX2 has no bf16 dot
 * product, and the AVX-512 forms keep more sums than its 16 registers hold); the [K, N] products
 * (kn_rows, paged_kn) run the same kernel, each of its 512-bit vectors a pair of 256-bit ones and
 * each AVX-512 intrinsic it uses the function below. The pair dot product does what vdpbf16ps
 * specifies, in its order: the odd (upper) bf16 of each pair multiplied and added to the sum, then
 * the even one, each a float32 fused multiply-add (a bf16 times a bf16 is exact in float32);
 * denormals are kept, not flushed.
 * aten's bf16 matmul runs at about 10 GFLOP/s on such a CPU (oneDNN's bf16 path needs AVX-512 or
 * AVX-NE-CONVERT). A [K, N] form of its own (matrix rows widened to float32 once into a panel,
 * each element broadcast against 16 input rows as float32) was tried (2026-12-01, Zen 3, one core,
 * MLA decode's values over a paged cache, batch 32, context 2048, 16 heads, C, interleaved runs):
 * 18.2-22.6 ms against 19.3-24.1 ms for this, not a clear win; packing x as float32 and widening
 * the panel cost what the plain multiply-adds saved. A second, the other way round, was tried the
 * same day: 16 columns of a matrix row widened (shift and AND) against 6 input rows' elements
 * broadcast as float32, 12 sums in registers, the rows copied by column block into a 32 KiB panel,
 * the next panel's rows prefetched over the tiles. Its loop alone, in L1, ran at 72-79 GFLOP/s,
 * but at V2-Lite's rows of 512 (kernel_builds' paged values, CPU time, three runs) it took
 * 21.5-24.1 ms against 22.7-23.2 for this (medians; minima 17.9-18.1 against 20.0): not a clear
 * win either. Without the panel (each row's 16 columns read where they lie: rows 1 KiB apart
 * share four L1 sets) it was slower than this; with the next rows prefetched in one burst, the
 * misses it queued held the copy up (9 ms of the 19 with the multiply-adds left out). */
typedef struct { __m256 a, b; } ag_ps;
typedef struct { __m256i a, b; } ag_si;
#define __m512 ag_ps
#define __m512i ag_si
#define __m512bh ag_si
#define __mmask32 uint32_t
#define __mmask16 uint16_t
static inline ag_si ag_loadu(const void *p) {
    return (ag_si){_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)p + 1)};
}
static inline ag_si ag_load(const void *p) { return (ag_si){((const __m256i *)p)[0], ((const __m256i *)p)[1]}; }
static inline ag_ps ag_load_ps(const float *p) { return (ag_ps){_mm256_load_ps(p), _mm256_load_ps(p + 8)}; }
static inline void ag_store_ps(float *p, ag_ps v) { _mm256_store_ps(p, v.a), _mm256_store_ps(p + 8, v.b); }
static inline ag_ps ag_zero_ps(void) { return (ag_ps){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline ag_si ag_zero_si(void) { return (ag_si){_mm256_setzero_si256(), _mm256_setzero_si256()}; }
static inline ag_si ag_set1_32(int32_t x) { __m256i v = _mm256_set1_epi32(x); return (ag_si){v, v}; }
static inline ag_si ag_set1_64(long long x) { __m256i v = _mm256_set1_epi64x(x); return (ag_si){v, v}; }
static inline __m256 ag_dp8(__m256 acc, __m256i a, __m256i b) {
    const __m256i high = _mm256_set1_epi32((int32_t)0xffff0000u);
    acc = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(a, high)),
                          _mm256_castsi256_ps(_mm256_and_si256(b, high)), acc);
    return _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)),
                           _mm256_castsi256_ps(_mm256_slli_epi32(b, 16)), acc);
}
static inline ag_ps ag_dpbf16(ag_ps acc, ag_si a, ag_si b) {
    return (ag_ps){ag_dp8(acc.a, a.a, b.a), ag_dp8(acc.b, a.b, b.b)};
}
static inline ag_si ag_maskz_loadu_16(uint32_t mask, const void *p) {
    if (mask == 0xffffffffu) return ag_loadu(p);
    uint16_t v[32] = {0};
    for (int i = 0; i < 32; i++)
        if (mask >> i & 1) v[i] = ((const uint16_t *)p)[i];
    return ag_loadu(v);
}
static inline float hsum256(__m256 v) { /* halves, then halves of those */
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}
static inline float ag_reduce_add(ag_ps v) { return hsum256(_mm256_add_ps(v.a, v.b)); } /* as AVX-512's */
static inline void ag_mask_storeu_16(void *p, uint16_t mask, __m256i v) {
    if (mask == 0xffff) { _mm256_storeu_si256((__m256i *)p, v); return; }
    uint16_t w[16];
    _mm256_storeu_si256((__m256i *)w, v);
    for (int i = 0; i < 16; i++)
        if (mask >> i & 1) ((uint16_t *)p)[i] = w[i];
}
#define _mm512_loadu_si512 ag_loadu
#define _mm512_load_si512 ag_load
#define _mm512_load_ps ag_load_ps
#define _mm512_store_ps ag_store_ps
#define _mm512_setzero_ps ag_zero_ps
#define _mm512_setzero_si512 ag_zero_si
#define _mm512_set1_epi32 ag_set1_32
#define _mm512_set1_epi64 ag_set1_64
#define _mm512_dpbf16_ps ag_dpbf16
#define _mm512_maskz_loadu_epi16 ag_maskz_loadu_16
#define _mm512_reduce_add_ps ag_reduce_add
#define _mm256_mask_storeu_epi16 ag_mask_storeu_16
#define AS_BH                     /* one type for bf16 pairs and integers here */
#endif

#define TM 4          /* a tile: TM input rows by TN weight rows, TM * TN float32 sums in registers; */
#if KERNEL == 256     /* each weight load feeds TM dot products, each input load TN */
#define TN 3
#else
#define TN 6
#endif
#define AHEAD 2       /* tiles: the weight rows 2 tiles on are prefetched into L2 while this one runs */
#define COLS 120      /* weight rows (outputs) per work item, a multiple of TN and of the wide form's 8 and 6 */

/* The vector width this build's kernel is written in: 512 (AVX512-BF16), 256 (AVX2 and FMA,
 * the stand-ins above), or 0: no kernel on this CPU. */
int expert_rows_available(void) {
#ifdef KERNEL
    return KERNEL;
#else
    return 0;
#endif
}

#ifdef KERNEL
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#if KERNEL == 256
/* AVX2 runs its own tile (up to 15 rows of one weight; from 16 rows whole chunks of 16 go through
 * its wide form, below): 4 input rows by 3 weight rows, 12 sums of 8 float32 in 12 of the 16
 * vector registers, each step 16 weight elements widened to float32 (an AND for the odd ones, a
 * shift for the even ones) and multiplied against the input rows, which are converted to float32
 * once per call. The AVX-512 forms emulated on pairs of 256-bit vectors (the build before this
 * one) kept twice as many sums as there are registers. One core of a Zen 3, a [12288, 2048]
 * weight streamed from memory, GFLOP/s, the emulated forms against this tile, timed interleaved
 * (one run; the machine was shared): 2 rows 19.4 / 26.3, 3 rows 24.5 / 36.5, 4 rows 28.4 / 43.0,
 * 5 rows 29.0 / 40.7, 8 rows 45.8 / 54.6, 12 rows 39.5 / 47.2, 16 rows 60.2 / 56.4, 24 rows
 * 29.8 / 47.9, 32 rows 41.8 / 63.8, 64 rows 44.2 / 61.4; 1 row at the memory's rate with either.
 * Tiles of 4 x 2, 3 x 3, 2 x 4 and 5 x 2 measured slower. float32 FMA peak: 102 GFLOP/s.
 * The input rows: each 16 elements (a weight load's span) split into the odd elements, then
 * the even ones; zero past k. */
typedef float xrow_t;
static inline long tile_stride(long k) { return (k + 15) / 16 * 16 + 16; } /* + 64 bytes: see expert_rows */
static void tile_rows(const uint16_t *x, long k, long rows, float *dst, long ldx) {
    for (long m = 0; m < rows; m++) {
        const uint16_t *xr = x + m * k;
        float *d = dst + m * ldx;
        memset(d, 0, (size_t)ldx * sizeof(float));
        for (long e = 0; e < k; e++) {
            uint32_t u = (uint32_t)xr[e] << 16;
            memcpy(d + e / 16 * 16 + (e & 1 ? 0 : 8) + e % 16 / 2, &u, 4);
        }
    }
}

/* The sums of the 8 lanes of a, b, c and d, in that order: three horizontal adds and one of the
 * halves, where four hsum256 take 24 instructions. The tile's reductions count where rows are
 * short: a GQA head's 128 elements are 8 steps of the tile, and there its reductions, rounding
 * and stores took about a third of the tile's time, one sum at a time (perf, in cache). A row's
 * sums reduced, rounded (to_bf16_4) and stored together, against one at a time (one Zen 3 core,
 * [1200, 128] weights, 41 runs alternating, GFLOP/s): 1 row 9.6 / 10.3, 3 rows 19.6 / 20.8,
 * 4 rows 29.2 / 32.4, 8 rows 35.1 / 38.5, 12 rows 27.3 / 29.3; at K = 2048 the same (4 and 8
 * rows 42.9 / 42.7, 47.9 / 47.9). */
static inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

/* 8 float32 rounded to bfloat16 as to_bf16 rounds each, each in the low half of its lane */
static inline __m256i to_bf16_8(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

/* 4 float32 rounded to bfloat16 as to_bf16 rounds each, in the low 64 bits */
static inline __m128i to_bf16_4(__m128 v) {
    __m128i u = _mm_castps_si128(v);
    __m128i odd = _mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(1));
    __m128i r = _mm_srli_epi32(_mm_add_epi32(u, _mm_add_epi32(odd, _mm_set1_epi32(0x7fff))), 16);
    r = _mm_blendv_epi8(r, _mm_set1_epi32(0x7fc0), _mm_castps_si128(_mm_cmpunord_ps(v, v))); /* NaN */
    return _mm_packus_epi32(r, r);
}

/* acc[a][b] += 16 weight elements v of row b times the same of row a of x (split), for a < tm */
static inline __attribute__((always_inline)) void tile_step(__m256 acc[TM][TN], __m256i v, const float *x, long ldx,
                                                            const int tm, const int b) {
    const __m256i high = _mm256_set1_epi32((int32_t)0xffff0000u);
    __m256 hi = _mm256_castsi256_ps(_mm256_and_si256(v, high)), lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    for (int a = 0; a < tm; a++) {
        acc[a][b] = _mm256_fmadd_ps(hi, _mm256_load_ps(x + a * ldx), acc[a][b]);
        acc[a][b] = _mm256_fmadd_ps(lo, _mm256_load_ps(x + a * ldx + 8), acc[a][b]);
    }
}

/* out[a, i + b] = dot(x row a, w row i + b) for a < tm, b < tn, as the AVX-512 tile below, on 16
 * weight elements a step: their odd elements (AND) and even ones (shift) as float32, against the
 * rows split the same way (tile_rows). */
static inline __attribute__((always_inline)) void tile(const uint16_t *w, long k, const float *x, long ldx,
                                                       uint16_t *out, long ldo, long i, const int tm, const int tn,
                                                       const uint16_t *pf) {
    const long full = k / 16 * 16;
    const uint16_t *wr = w + i * k;
    __m256 acc[TM][TN];
    for (int a = 0; a < tm; a++)
        for (int b = 0; b < tn; b++) acc[a][b] = _mm256_setzero_ps();
    for (long c = 0; c < full; c += 16) {
        if (pf && (c & 31) == 0)
            for (int b = 0; b < tn; b++) _mm_prefetch((const char *)(pf + b * k + c), _MM_HINT_T2);
        for (int b = 0; b < tn; b++)
            tile_step(acc, _mm256_loadu_si256((const __m256i *)(wr + b * k + c)), x + c, ldx, tm, b);
    }
    if (full < k) { /* the last 1-15 elements, zero-extended: no read past the row */
        for (int b = 0; b < tn; b++) {
            uint16_t part[16] = {0};
            memcpy(part, wr + b * k + full, (size_t)(k - full) * 2);
            tile_step(acc, _mm256_loadu_si256((const __m256i *)part), x + full, ldx, tm, b);
        }
    }
    const __m256 zero = _mm256_setzero_ps();
    for (int a = 0; a < tm; a++) { /* a row's tn <= 3 sums reduced and rounded together */
        uint16_t o[4];
        _mm_storel_epi64((__m128i *)o, to_bf16_4(hsum4(acc[a][0], tn > 1 ? acc[a][1] : zero,
                                                       tn > 2 ? acc[a][2] : zero, zero)));
        memcpy(out + a * ldo + i, o, (size_t)tn * 2);
    }
}
#else
typedef uint16_t xrow_t; /* the tiles' input rows, copied (tile_rows) */
static inline long tile_stride(long k) { return (k + 31) / 32 * 32 + 32; } /* + 64 bytes: see expert_rows */
static void tile_rows(const uint16_t *x, long k, long rows, uint16_t *dst, long ldx) {
    for (long m = 0; m < rows; m++) memcpy(dst + m * ldx, x + m * k, (size_t)k * 2);
}

/* out[a, i + b] = dot(x row a, w row i + b) for a < tm, b < tn: x rows at stride ldx, w rows at
 * stride k, out rows at stride ldo. pf: weight rows to prefetch into L2 alongside (tn of them,
 * stride k), or NULL. tm and tn are constants where it is inlined (tile_any), so the sums stay in
 * registers. */
static inline __attribute__((always_inline)) void tile(const uint16_t *w, long k, const xrow_t *x, long ldx,
                                                       uint16_t *out, long ldo, long i, const int tm, const int tn,
                                                       const uint16_t *pf) {
    const long full = k / 32 * 32;
    const __mmask32 tail = (__mmask32)((1ull << (k - full)) - 1);
    const uint16_t *wr = w + i * k;
    __m512 acc[TM][TN];
    __m512bh wv[TN];
    for (int a = 0; a < tm; a++)
        for (int b = 0; b < tn; b++) acc[a][b] = _mm512_setzero_ps();
    for (long c = 0; c < full; c += 32) {
        if (pf)
            for (int b = 0; b < tn; b++) _mm_prefetch((const char *)(pf + b * k + c), _MM_HINT_T2);
        for (int b = 0; b < tn; b++) wv[b] = AS_BH _mm512_loadu_si512(wr + b * k + c);
        for (int a = 0; a < tm; a++) {
            __m512bh xv = AS_BH _mm512_loadu_si512(x + a * ldx + c);
            for (int b = 0; b < tn; b++) acc[a][b] = _mm512_dpbf16_ps(acc[a][b], wv[b], xv);
        }
    }
    if (tail) {
        for (int b = 0; b < tn; b++) wv[b] = AS_BH _mm512_maskz_loadu_epi16(tail, wr + b * k + full);
        for (int a = 0; a < tm; a++) {
            __m512bh xv = AS_BH _mm512_maskz_loadu_epi16(tail, x + a * ldx + full);
            for (int b = 0; b < tn; b++) acc[a][b] = _mm512_dpbf16_ps(acc[a][b], wv[b], xv);
        }
    }
    for (int a = 0; a < tm; a++)
        for (int b = 0; b < tn; b++) out[a * ldo + i + b] = to_bf16(_mm512_reduce_add_ps(acc[a][b]));
}

#endif

#define TN_AT_MOST(c) ((c) < TN ? (c) : TN) /* tn <= TN: the other cases do not occur */
#define TILE_TN(tm)                                                              \
    switch (tn) {                                                                \
        case 1: tile(w, k, x, ldx, out, ldo, i, tm, TN_AT_MOST(1), pf); break;   \
        case 2: tile(w, k, x, ldx, out, ldo, i, tm, TN_AT_MOST(2), pf); break;   \
        case 3: tile(w, k, x, ldx, out, ldo, i, tm, TN_AT_MOST(3), pf); break;   \
        case 4: tile(w, k, x, ldx, out, ldo, i, tm, TN_AT_MOST(4), pf); break;   \
        case 5: tile(w, k, x, ldx, out, ldo, i, tm, TN_AT_MOST(5), pf); break;   \
        default: tile(w, k, x, ldx, out, ldo, i, tm, TN, pf); break;             \
    }

static void tile_any(const uint16_t *w, long k, const xrow_t *x, long ldx, uint16_t *out, long ldo, long i,
                     int tm, int tn, const uint16_t *pf) {
    switch (tm) {
        case 1: TILE_TN(1) break;
        case 2: TILE_TN(2) break;
        case 3: TILE_TN(3) break;
        default: TILE_TN(TM) break;
    }
}

/* The rows to prefetch for the tile nw weight rows on from row ip - ... (ip = the row AHEAD tiles
 * on): in this weight of n rows, else in the one read next (next, another n rows; paged_rows'
 * next cache block), else none. */
static inline const uint16_t *ahead(const uint16_t *w, long n, long k, long ip, long nw, const uint16_t *next) {
    if (ip + nw <= n) return w + ip * k;
    return next && ip >= n && ip - n + nw <= n ? next + (ip - n) * k : NULL;
}

/* out rows 0..rows-1 (stride ldo), columns i0..i1-1 = x rows (stride ldx) times w rows i0..i1-1
 * of n. Each tile of weight rows is read from memory once (for the first TM input rows, the rest
 * find it in cache), and the weight rows AHEAD tiles on are prefetched meanwhile (from ``next``
 * past the end: see ahead): the hardware prefetcher alone leaves the loads and the dot products
 * to take turns. */
static void rows_block(const uint16_t *w, long n, long k, const xrow_t *x, long ldx, uint16_t *out, long ldo,
                       long i0, long i1, long rows, const uint16_t *next) {
    for (long i = i0; i < i1; i += TN) {
        int tn = i1 - i < TN ? (int)(i1 - i) : TN;
        const uint16_t *pf = ahead(w, n, k, i + AHEAD * TN, TN, next);
        for (long a = 0; a < rows; a += TM)
            tile_any(w, k, x + a * ldx, ldx, out + a * ldo, ldo, i, rows - a < TM ? (int)(rows - a) : TM, tn,
                     a ? NULL : pf);
    }
}

/* The wide forms, for PAIRS_MIN or more rows of one weight. There the tiles above spend their time
 * on loads and on reducing each sum across a vector. Instead the rows are repacked once per call
 * and each weight element is broadcast against them, so every sum stays in its own vector lane;
 * each weight element is still read from memory once, and nothing is transposed.
 * - 5-8 rows, the pairs form: a vector holds 8 rows by 2 bf16 pairs (lane 2r + q: row r, pair
 *   2s + q), and each step broadcasts 4 weight elements (64 bits). Time with the tiles over time
 *   with the pairs form, one-off, interleaved, [12288, 2048] / [2048, 3648] / [2816, 2048]:
 *   8 rows 1.34/1.24/1.19; 5 and 6 rows 1.03/0.99/0.97 and 0.94/1.05/1.04 (both stream the
 *   weight at the memory's rate there); 12 rows (wide form) 1.20/1.10/1.07, 16 rows 1.35/1.38/1.31.
 * - 9 or more rows, the wide form: vectors of 16 rows by 1 pair (bf16 pairs [k/2][16 * mj], mj
 *   vectors), each step broadcasting one weight pair (32 bits); at most WIDE_ROWS rows per pass
 *   over the weight. One-off, GFLOP/s, tiles vs wide form, 16 rows: 118/122/109 vs 162/176/143
 *   ([12288, 2048] / [2048, 3648] / [576, 2048]); 9 rows 99/97/87 vs 93/92/80; 32 rows: aten
 *   141-147, wide form 194-195.
 * Weight rows at a time: PW and NW. More than 8 weight rows 4 KiB apart share an L1 set (12
 * measured slower than 8 at K = 2048; for the pairs form 6 beat 8 and 10). */
#define PAIRS_MIN 5
#define PW 6
#define NW 8

#if KERNEL != 256
#define WIDE_ROWS 64 /* rows per pass over the weight: 4 vectors of 16 */

/* rows of the chunk that starts at row m0: WIDE_ROWS, or what is left */
static inline long chunk_rows(long rows, long m0) { return rows - m0 < WIDE_ROWS ? rows - m0 : WIDE_ROWS; }

/* dwords of one packed chunk of ``rows`` <= WIDE_ROWS rows */
static long chunk_dwords(long rows, long k) {
    return rows <= 8 ? (k + 3) / 4 * 16 : (k + 1) / 2 * 16 * ((rows + 15) / 16);
}

static long packed_dwords(long rows, long k) {
    long total = 0;
    for (long m0 = 0; m0 < rows; m0 += WIDE_ROWS) total += chunk_dwords(chunk_rows(rows, m0), k);
    return total;
}

/* x rows (stride k) packed for the wide forms, WIDE_ROWS at a time; lanes without a row, and the
 * halves past k, are zero. */
static void pack_rows(const uint16_t *x, long k, long rows, uint32_t *xq) {
    for (long m0 = 0; m0 < rows; m0 += WIDE_ROWS) {
        long mr = chunk_rows(rows, m0), size = chunk_dwords(mr, k);
        memset(xq, 0, (size_t)size * 4);
        for (long m = 0; m < mr; m++) {
            const uint16_t *xr = x + (m0 + m) * k;
            if (mr <= 8) { /* step s, lanes 2m and 2m + 1: elements 4s .. 4s + 3 of row m */
                for (long s = 0; s < k / 4; s++) memcpy(xq + s * 16 + 2 * m, xr + 4 * s, 8);
                if (k & 3) memcpy(xq + k / 4 * 16 + 2 * m, xr + k / 4 * 4, (size_t)(k & 3) * 2);
            } else {
                long mq = 16 * ((mr + 15) / 16);
                for (long p = 0; p < k / 2; p++) memcpy(xq + p * mq + m, xr + 2 * p, 4);
                if (k & 1) xq[k / 2 * mq + m] = xr[k - 1];
            }
        }
        xq += size;
    }
}

/* out[m, i + b] = dot(x row m, w row i + b) for m < rows <= 8, b < nw; xq packed in the pairs
 * form; pf: nw weight rows to prefetch into L2, or NULL. */
static inline __attribute__((always_inline)) void pairs_tile(const uint16_t *w, long k, const uint32_t *xq,
                                                             uint16_t *out, long ldo, long rows, long i, const int nw,
                                                             const uint16_t *pf) {
    const long steps = k / 4;
    const uint16_t *wr = w + i * k;
    __m512 acc[PW];
    for (int b = 0; b < nw; b++) acc[b] = _mm512_setzero_ps();
    for (long s = 0; s < steps; s++) {
        if (pf && (s & 7) == 0) /* one 64-byte line of each row per 8 steps */
            for (int b = 0; b < nw; b++) _mm_prefetch((const char *)(pf + b * k + 4 * s), _MM_HINT_T2);
        __m512bh xv = AS_BH _mm512_loadu_si512(xq + s * 16);
        for (int b = 0; b < nw; b++) {
            int64_t four;
            memcpy(&four, wr + b * k + 4 * s, 8);
            acc[b] = _mm512_dpbf16_ps(acc[b], AS_BH _mm512_set1_epi64(four), xv);
        }
    }
    if (k & 3) { /* the last 1-3 elements, zero-extended: no read past the row */
        __m512bh xv = AS_BH _mm512_loadu_si512(xq + steps * 16);
        for (int b = 0; b < nw; b++) {
            int64_t four = 0;
            memcpy(&four, wr + b * k + 4 * steps, (size_t)(k & 3) * 2);
            acc[b] = _mm512_dpbf16_ps(acc[b], AS_BH _mm512_set1_epi64(four), xv);
        }
    }
    float sums[PW * 16] __attribute__((aligned(64)));
    for (int b = 0; b < nw; b++) _mm512_store_ps(sums + b * 16, acc[b]);
    for (long m = 0; m < rows; m++)
        for (int b = 0; b < nw; b++) out[m * ldo + i + b] = to_bf16(sums[b * 16 + 2 * m] + sums[b * 16 + 2 * m + 1]);
}

/* out[m, i + b] = dot(x row m, w row i + b) for m < rows, b < nw: xq the rows' pairs, 16 * mj a
 * pair (the last pair (x[k - 1], 0) where k is odd); pf: nw weight rows to prefetch into L2, or NULL. */
static inline __attribute__((always_inline)) void wide_tile(const uint16_t *w, long k, const uint32_t *xq,
                                                            uint16_t *out, long ldo, long rows, long i, const int nw,
                                                            const int mj, const uint16_t *pf) {
    const long pairs = k / 2, mq = 16 * mj;
    const uint16_t *wr = w + i * k;
    __m512 acc[NW][4];
    __m512bh xv[4];
    for (int b = 0; b < nw; b++)
        for (int j = 0; j < mj; j++) acc[b][j] = _mm512_setzero_ps();
    for (long p = 0; p < pairs; p++) {
        if (pf && (p & 15) == 0) /* one 64-byte line of each row per 16 pairs */
            for (int b = 0; b < nw; b++) _mm_prefetch((const char *)(pf + b * k + 2 * p), _MM_HINT_T2);
        for (int j = 0; j < mj; j++) xv[j] = AS_BH _mm512_loadu_si512(xq + p * mq + 16 * j);
        for (int b = 0; b < nw; b++) {
            int32_t pair;
            memcpy(&pair, wr + b * k + 2 * p, 4);
            __m512bh wb = AS_BH _mm512_set1_epi32(pair);
            for (int j = 0; j < mj; j++) acc[b][j] = _mm512_dpbf16_ps(acc[b][j], wb, xv[j]);
        }
    }
    if (k & 1) {
        for (int j = 0; j < mj; j++) xv[j] = AS_BH _mm512_loadu_si512(xq + pairs * mq + 16 * j);
        for (int b = 0; b < nw; b++) {
            __m512bh wb = AS_BH _mm512_set1_epi32((int32_t)wr[b * k + k - 1]);
            for (int j = 0; j < mj; j++) acc[b][j] = _mm512_dpbf16_ps(acc[b][j], wb, xv[j]);
        }
    }
    float sums[NW * 64] __attribute__((aligned(64)));
    for (int b = 0; b < nw; b++)
        for (int j = 0; j < mj; j++) _mm512_store_ps(sums + b * mq + 16 * j, acc[b][j]);
    for (long m = 0; m < rows; m++)
        for (int b = 0; b < nw; b++) out[m * ldo + i + b] = to_bf16(sums[b * mq + m]);
}

#define WIDE_MJ(nwv)                                                                        \
    switch (mj) {                                                                           \
        case 1: wide_tile(w, k, xq, out, ldo, rows, i, nwv, 1, pf); break;                  \
        case 2: wide_tile(w, k, xq, out, ldo, rows, i, nwv, 2, pf); break;                  \
        case 3: wide_tile(w, k, xq, out, ldo, rows, i, nwv, 3, pf); break;                  \
        default: wide_tile(w, k, xq, out, ldo, rows, i, nwv, 4, pf); break;                 \
    }

/* Weight rows i0..i1-1 against one packed chunk of ``rows`` rows, in the form its size takes. */
static void wide_block(const uint16_t *w, long n, long k, const uint32_t *xq, uint16_t *out, long ldo, long rows,
                       long i0, long i1, const uint16_t *next) {
    const int mj = (int)((rows + 15) / 16);
    const int nw = rows <= 8 ? PW : mj == 4 ? 6 : NW; /* 24 sums in registers at most */
    for (long i = i0; i < i1; i += nw) {
        const uint16_t *pf = ahead(w, n, k, i + AHEAD * nw, nw, next);
        if (i1 - i < nw) { /* the last few weight rows, one at a time */
            for (; i < i1; i++) {
                if (rows <= 8) pairs_tile(w, k, xq, out, ldo, rows, i, 1, NULL);
                else WIDE_MJ(1)
            }
            break;
        }
        if (rows <= 8) pairs_tile(w, k, xq, out, ldo, rows, i, PW, pf);
        else if (nw == NW) WIDE_MJ(NW)
        else WIDE_MJ(6)
    }
}

/* Weight rows i0..i1-1 against ``rows`` packed rows (pack_rows), WIDE_ROWS at a time; next: as
 * for rows_block. */
static void wide_range(const uint16_t *w, long n, long k, const uint32_t *xq, uint16_t *out, long ldo, long rows,
                       long i0, long i1, const uint16_t *next) {
    for (long m0 = 0; m0 < rows; m0 += WIDE_ROWS) {
        long mr = chunk_rows(rows, m0);
        wide_block(w, n, k, xq, out + m0 * ldo, ldo, mr, i0, i1, next);
        xq += chunk_dwords(mr, k);
    }
}

#else
/* The wide form on AVX2, for whole chunks of 16 rows of one weight: the rows packed as float32 (per
 * pair of elements, the odd ones of the 16 rows, then the even ones), each weight pair broadcast
 * and widened (AND, shift), 4 weight rows by 16 rows a tile: 8 sums, 4 row vectors and the pair's
 * 2 vectors in registers; each tile against every chunk while its weight rows are in L1. Same
 * weight and machine as the tile's figures, GFLOP/s, the tile alone against this form for the
 * whole chunks (and the tile for the rest), two runs of a few minutes apart: 16 rows 64.3 / 72.6,
 * 24 rows 63.0 / 70.1 (one chunk and 8 rows), 32 rows 60.9 / 77.9, 64 rows 62.5 / 78.5; at 12
 * rows this form (one part chunk) ran at 55.9, the tile at 59.1. Over a paged cache's blocks of
 * 16 rows of 576 (MLA scores, 16 heads, batch 32, context 2048) it ran at 0.81-1.03 of the
 * emulated form's speed in four runs (about 20 ms; `python -m benchmarks.kernel_builds --paged`;
 * the tile alone 0.7, rows packed as bf16 pairs 0.92-0.96 but 0.8 of this at 32 rows of a dense
 * weight). The V2-Lite slice's graph step
 * (context 256), the emulated forms' build and this one swapped under one captured runner,
 * interleaved, ms: batch 8 178.4 / 164.4, batch 32 789.4 / 563.5, batch 64 1434.3 / 1013.0.
 * At 74-79 GFLOP/s (16-64 rows) this form runs at 0.75 of the FMA peak. Tried and not kept (2026-12-01,
 * `kernel_builds --old HEAD --rows 16,32,64`, new / old): the even element by a second 32-bit read
 * and an AND instead of the shift 0.86-0.88; 6 weight rows a tile 0.82-0.84 (spills); a cache line
 * of pairs per loop step with the rows pinned in registers 1.00-1.04; 2 weight rows with the odd
 * and even products in separate sums 0.82-1.01. In a loop over rows and weights in cache (C, one-off)
 * this form ran at 86 GFLOP/s, and 2 weight rows against 32 rows at once (each pair widened once for
 * both chunks) at 84: the widening is not what holds it back. */
#define WIDE_ROWS 16 /* rows per chunk: 2 vectors of 8 float32 sums per weight row */
#define W2_NW 4      /* weight rows per tile: 8 sums, 4 input vectors, a weight pair's 2 in registers */

static inline long chunk_rows(long rows, long m0) { return rows - m0 < WIDE_ROWS ? rows - m0 : WIDE_ROWS; }

/* floats of one packed chunk: per pair of elements, the odd elements of its 16 rows, then the even ones */
static long chunk_dwords(long rows, long k) { return (void)rows, (k + 1) / 2 * 32; }

static long packed_dwords(long rows, long k) { return (rows + WIDE_ROWS - 1) / WIDE_ROWS * chunk_dwords(WIDE_ROWS, k); }

/* x rows (stride k) as float32, WIDE_ROWS at a time: element e of row m at pair e / 2, lane m of
 * its odd (e odd) or even half; lanes without a row, and the element past an odd k, zero */
static void pack_rows(const uint16_t *x, long k, long rows, uint32_t *xq) {
    for (long m0 = 0; m0 < rows; m0 += WIDE_ROWS) {
        long mr = chunk_rows(rows, m0), size = chunk_dwords(mr, k);
        memset(xq, 0, (size_t)size * 4);
        for (long m = 0; m < mr; m++)
            for (long e = 0; e < k; e++) xq[e / 2 * 32 + (e & 1 ? 0 : 16) + m] = (uint32_t)x[(m0 + m) * k + e] << 16;
        xq += size;
    }
}

/* out[m, i + b] = dot(x row m, w row i + b) for m < rows <= 16, b < nw: each weight pair broadcast,
 * its odd element (AND) and even one (shift) as float32, against 16 rows' odd and even elements */
static inline __attribute__((always_inline)) void w2_tile(const uint16_t *w, long k, const float *xq, uint16_t *out,
                                                          long ldo, long rows, long i, const int nw,
                                                          const uint16_t *pf) {
    const __m256i high = _mm256_set1_epi32((int32_t)0xffff0000u);
    const long pairs = (k + 1) / 2;
    const uint16_t *wr = w + i * k;
    __m256 acc[W2_NW][2];
    for (int b = 0; b < nw; b++) acc[b][0] = acc[b][1] = _mm256_setzero_ps();
    for (long p = 0; p < pairs; p++) {
        if (pf && (p & 15) == 0)
            for (int b = 0; b < nw; b++) _mm_prefetch((const char *)(pf + b * k + 2 * p), _MM_HINT_T2);
        const float *xp = xq + p * 32;
        __m256 o0 = _mm256_load_ps(xp), o1 = _mm256_load_ps(xp + 8), e0 = _mm256_load_ps(xp + 16),
               e1 = _mm256_load_ps(xp + 24);
        const int last = 2 * p + 1 == k; /* an odd k's last element alone: no read past the row */
        for (int b = 0; b < nw; b++) {
            int32_t pair;
            if (__builtin_expect(last, 0)) pair = wr[b * k + 2 * p];
            else memcpy(&pair, wr + b * k + 2 * p, 4);
            __m256i v = _mm256_set1_epi32(pair);
            __m256 hi = _mm256_castsi256_ps(_mm256_and_si256(v, high));
            __m256 lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
            acc[b][0] = _mm256_fmadd_ps(lo, e0, _mm256_fmadd_ps(hi, o0, acc[b][0]));
            acc[b][1] = _mm256_fmadd_ps(lo, e1, _mm256_fmadd_ps(hi, o1, acc[b][1]));
        }
    }
    /* rounded to bf16 8 at a time (low halves), then each row's nw stored together: against one
     * sum at a time, MLA's rope scores (paged, rows of 64, 16 heads, batch 32, context 2048, one
     * core, 21 runs alternating) 3.15 / 2.93 and 5.07 / 4.51 ms in two runs, its latent scores
     * (rows of 512) 22.3 / 21.1 and 25.2 / 25.3 ms */
    uint32_t sums[W2_NW * 16] __attribute__((aligned(32)));
    for (int b = 0; b < nw; b++) {
        _mm256_store_si256((__m256i *)(sums + b * 16), to_bf16_8(acc[b][0]));
        _mm256_store_si256((__m256i *)(sums + b * 16 + 8), to_bf16_8(acc[b][1]));
    }
    for (long m = 0; m < rows; m++) { /* a row's nw outputs in one store */
        uint16_t o[W2_NW];
        for (int b = 0; b < nw; b++) o[b] = (uint16_t)sums[b * 16 + m];
        memcpy(out + m * ldo + i, o, (size_t)nw * 2);
    }
}

/* Weight rows i0..i1-1 against ``rows`` packed rows (pack_rows), W2_NW weight rows at a time, each
 * tile against every chunk of rows while it is in L1; next: as for rows_block. */
static void wide_range(const uint16_t *w, long n, long k, const uint32_t *xq, uint16_t *out, long ldo, long rows,
                       long i0, long i1, const uint16_t *next) {
    const float *xf = (const float *)xq;
    for (long i = i0; i < i1; i += W2_NW) {
        const uint16_t *pf = ahead(w, n, k, i + AHEAD * W2_NW, W2_NW, next);
        for (long m0 = 0; m0 < rows; m0 += WIDE_ROWS) {
            const float *xc = xf + m0 / WIDE_ROWS * chunk_dwords(WIDE_ROWS, k);
            long mr = chunk_rows(rows, m0);
            if (i1 - i >= W2_NW) w2_tile(w, k, xc, out + m0 * ldo, ldo, mr, i, W2_NW, m0 ? NULL : pf);
            else
                for (long j = i; j < i1; j++) w2_tile(w, k, xc, out + m0 * ldo, ldo, mr, j, 1, NULL);
        }
    }
}
#endif

/* The rows of ``count`` (one weight's) that go through a wide form; the rest, the last ones,
 * through the tiles. AVX-512: all of them from PAIRS_MIN rows. AVX2: whole chunks of WIDE_ROWS,
 * which its wide form fills (part chunks ran slower there than the tiles). */
static inline long wide_rows(long count) {
#if KERNEL == 256
    return count / WIDE_ROWS * WIDE_ROWS;
#else
    return count >= PAIRS_MIN ? count : 0;
#endif
}

/* The [K, N] form, for products whose matrix is stored with the reduced dimension first
 * (row-major [k, n]: MLA decode's probabilities times each sequence's latent cache rows). A
 * few matrix rows at a time are read whole (a sequential stream)
 * and each two consecutive rows interleaved into bf16 pairs along k, 16 columns per vector, into
 * a panel of at most KN_PANEL bytes (vpermt2w; the panel's order: pair, column block, half).
 * Each tile of input rows then broadcasts its pairs (x[m, t], x[m, t + 1]) against the panel,
 * every sum in its own vector lane, kept between panels in sums[]. Reading the matrix 64 bytes
 * per row per column block instead (rows 1-4 KiB apart) ran at half the rate: the rows share
 * few cache sets and the prefetchers do not follow them. Tried for AVX2 and a few rows, not kept
 * (2026-12-01, standard attention's values: 4 rows, 8 kv heads' rows of 128 at 2 KiB, batch 8,
 * context 1024, one core, 15 runs alternating): no panel, each row's 16 columns widened against
 * 4 rows' elements broadcast, 8 sums in registers, 4.1 ms against the panel form's 4.2-4.4;
 * prefetching 32 or 96 rows ahead instead of 8, about 8 ms. perf put the time on the loads of
 * the rows. */
#define KN_ROWS 8           /* input rows per tile: 16 sums in registers, each panel pair feeds 16 */
#define KN_PANEL (64 << 10) /* bytes of interleaved pairs per panel: in L2 */

/* sums (for m < mt: 32 floats of row m0 + m) += x rows' pairs p0 .. p0 + np - 1 (xq) times one
 * column block's np pairs in the panel (2 vectors each, pstride pairs of vectors apart); pf: the
 * next panel's rows to prefetch, 128 bytes per pair, or NULL */
static inline __attribute__((always_inline)) void kn_tile(const uint32_t *xq, long rows, long p0, long np,
                                                          const __m512i *panel, float *sums, long m0, const int mt,
                                                          const char *pf, long pstride) {
    __m512 lo[KN_ROWS], hi[KN_ROWS];
    for (int m = 0; m < mt; m++) {
        lo[m] = _mm512_load_ps(sums + 32 * (m0 + m));
        hi[m] = _mm512_load_ps(sums + 32 * (m0 + m) + 16);
    }
    for (long p = 0; p < np; p++) {
        if (pf) { /* two lines of the next panel's rows per pair, while the dot products run */
            _mm_prefetch(pf + 128 * p, _MM_HINT_T2);
            _mm_prefetch(pf + 128 * p + 64, _MM_HINT_T2);
        }
        __m512bh a = AS_BH _mm512_load_si512(panel + 2 * p * pstride);
        __m512bh b = AS_BH _mm512_load_si512(panel + 2 * p * pstride + 1);
        const uint32_t *xp = xq + (p0 + p) * rows + m0;
        for (int m = 0; m < mt; m++) {
            __m512bh xv = AS_BH _mm512_set1_epi32((int32_t)xp[m]);
            lo[m] = _mm512_dpbf16_ps(lo[m], a, xv);
            hi[m] = _mm512_dpbf16_ps(hi[m], b, xv);
        }
    }
    for (int m = 0; m < mt; m++) {
        _mm512_store_ps(sums + 32 * (m0 + m), lo[m]);
        _mm512_store_ps(sums + 32 * (m0 + m) + 16, hi[m]);
    }
}

/* 16 float32 rounded to bfloat16 as to_bf16 rounds each */
static inline __m256i to_bf16_16(__m512 v) {
#if KERNEL == 512
    __m512i u = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(r);
#else
    const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff), nan = _mm256_set1_epi32(0x7fc0);
    __m256i h[2];
    for (int j = 0; j < 2; j++) {
        __m256 f = j ? v.b : v.a;
        __m256i u = _mm256_castps_si256(f);
        __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(u, 16), one))), 16);
        h[j] = _mm256_blendv_epi8(r, nan, _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)));
    }
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(h[0], h[1]), 0xd8); /* packus interleaves 128-bit lanes */
#endif
}

/* Rows r0 and r1 (32 bf16 each) interleaved into pairs: *lo = (r0[j], r1[j]) for j < 16,
 * *hi = the same for j = 16..31. */
static inline void interleave_pairs(__m512i r0, __m512i r1, __m512i lo_idx, __m512i hi_idx, __m512i *lo,
                                    __m512i *hi) {
#if KERNEL == 512
    *lo = _mm512_permutex2var_epi16(r0, lo_idx, r1);
    *hi = _mm512_permutex2var_epi16(r0, hi_idx, r1);
#else
    (void)lo_idx, (void)hi_idx;
    __m256i l0 = _mm256_unpacklo_epi16(r0.a, r1.a), h0 = _mm256_unpackhi_epi16(r0.a, r1.a); /* per 128-bit lane */
    __m256i l1 = _mm256_unpacklo_epi16(r0.b, r1.b), h1 = _mm256_unpackhi_epi16(r0.b, r1.b);
    *lo = (ag_si){_mm256_permute2x128_si256(l0, h0, 0x20), _mm256_permute2x128_si256(l0, h0, 0x31)};
    *hi = (ag_si){_mm256_permute2x128_si256(l1, h1, 0x20), _mm256_permute2x128_si256(l1, h1, 0x31)};
#endif
}

/* Row t of a [k, n] matrix: w + t * n, or, through a block table (table not NULL), row t % bs of
 * cache block table[t / bs], blocks bstride elements apart and its rows (n elements each)
 * rstride apart: n, or a multiple of n where a token row holds several heads' rows. */
typedef struct {
    const uint16_t *w;
    const int32_t *table;
    long bs, bstride, rstride;
} kn_rows_at;

static inline const uint16_t *kn_row(const kn_rows_at *at, long t, long n) {
    return at->table ? at->w + at->table[t / at->bs] * at->bstride + t % at->bs * at->rstride : at->w + t * n;
}

/* out (rows at stride n) = x rows (pairs xq) times the [k, n] matrix at; panel: KN_PANEL bytes,
 * sums: rows * 32 * blocks floats, both 64-byte aligned. */
static void kn_matrix(const uint32_t *xq, long rows, const kn_rows_at *at, long k, long n, uint16_t *out,
                      __m512i *panel, float *sums) {
    const long pairs = (k + 1) / 2, blocks = (n + 31) / 32;
    long chunk = KN_PANEL / (blocks * 128);
    if (chunk < 1) chunk = 1;
    __m512i lo_idx, hi_idx; /* word 2j: row t's column j (or 16 + j), word 2j + 1: row t + 1's */
    {
        uint16_t lo[32], hi[32];
        for (int j = 0; j < 16; j++) lo[2 * j] = j, lo[2 * j + 1] = 32 + j, hi[2 * j] = 16 + j, hi[2 * j + 1] = 48 + j;
        lo_idx = _mm512_loadu_si512(lo), hi_idx = _mm512_loadu_si512(hi);
    }
    memset(sums, 0, (size_t)(rows * 32 * blocks) * sizeof(float));
    for (long p0 = 0; p0 < pairs; p0 += chunk) {
        long np = pairs - p0 < chunk ? pairs - p0 : chunk;
        for (long p = 0; p < np; p++) {
            long t = 2 * (p0 + p);
            const uint16_t *w0 = kn_row(at, t, n), *w1 = t + 1 < k ? kn_row(at, t + 1, n) : NULL;
            for (long b = 0; b < blocks; b++) {
                long cols = n - 32 * b < 32 ? n - 32 * b : 32;
                __mmask32 mask = (__mmask32)((1ull << cols) - 1);
                __m512i r0 = _mm512_maskz_loadu_epi16(mask, w0 + 32 * b);
                __m512i r1 = w1 ? _mm512_maskz_loadu_epi16(mask, w1 + 32 * b) : _mm512_setzero_si512();
                interleave_pairs(r0, r1, lo_idx, hi_idx, panel + (p * blocks + b) * 2, panel + (p * blocks + b) * 2 + 1);
            }
        }
        /* the next panel's rows are prefetched by the tiles, 128 bytes per pair each, a run of
         * whole rows per tile found through kn_row (paged: a run may pass its block's end, a few
         * lines prefetched in vain; a prefetch never faults) */
        const long t1 = 2 * (p0 + np), row_bytes = n * 2;
        const long next_bytes = (k - t1 < 2 * chunk ? k - t1 : 2 * chunk) * row_bytes; /* <= 0: none */
        long next_off = 0;
        for (long b = 0; b < blocks; b++)
            for (long m0 = 0; m0 < rows; m0 += KN_ROWS) {
                const __m512i *pb = panel + b * 2;
                float *sb = sums + b * rows * 32;
                const char *pf = next_off < next_bytes
                                     ? (const char *)kn_row(at, t1 + next_off / row_bytes, n) + next_off % row_bytes
                                     : NULL;
                next_off += 128 * np;
                switch (rows - m0 < KN_ROWS ? rows - m0 : KN_ROWS) {
                    case 1: kn_tile(xq, rows, p0, np, pb, sb, m0, 1, pf, blocks); break;
                    case 2: kn_tile(xq, rows, p0, np, pb, sb, m0, 2, pf, blocks); break;
                    case 3: kn_tile(xq, rows, p0, np, pb, sb, m0, 3, pf, blocks); break;
                    case 4: kn_tile(xq, rows, p0, np, pb, sb, m0, 4, pf, blocks); break;
                    case 5: kn_tile(xq, rows, p0, np, pb, sb, m0, 5, pf, blocks); break;
                    case 6: kn_tile(xq, rows, p0, np, pb, sb, m0, 6, pf, blocks); break;
                    case 7: kn_tile(xq, rows, p0, np, pb, sb, m0, 7, pf, blocks); break;
                    default: kn_tile(xq, rows, p0, np, pb, sb, m0, KN_ROWS, pf, blocks); break;
                }
            }
    }
    for (long b = 0; b < blocks; b++) {
        long cols = n - 32 * b < 32 ? n - 32 * b : 32;
        __mmask32 mask = (__mmask32)((1ull << cols) - 1);
        for (long m = 0; m < rows; m++) {
            const float *sm = sums + (b * rows + m) * 32;
            uint16_t *o = out + m * n + 32 * b;
            _mm256_mask_storeu_epi16(o, (__mmask16)mask, to_bf16_16(_mm512_load_ps(sm)));
            _mm256_mask_storeu_epi16(o + 16, (__mmask16)(mask >> 16), to_bf16_16(_mm512_load_ps(sm + 16)));
        }
    }
}

/* x rows (stride k) as pairs along k, pair p of row m at xq[p * rows + m]; an odd k's last pair
 * is (x[m, k - 1], 0). */
static void pack_kn(const uint16_t *x, long rows, long k, uint32_t *xq) {
    for (long m = 0; m < rows; m++) {
        const uint16_t *xr = x + m * k;
        for (long p = 0; p < k / 2; p++) memcpy(xq + p * rows + m, xr + 2 * p, 4);
        if (k & 1) xq[k / 2 * rows + m] = xr[k - 1];
    }
}
#endif

/* out[p, :] = x[p, :] @ w[e].T for the rows p of expert e, ends[e-1] <= p < ends[e] (ends
 * non-decreasing, ends[experts-1] = the row count): x [rows, k], w [experts, n, k], out [rows, n],
 * all bfloat16 and contiguous. An expert's rows go through the tiles, or from PAIRS_MIN rows one
 * of the wide forms. threads > 1 splits the work over OpenMP threads. Returns 0, or -1 where this
 * build lacks the kernel or memory for the copied rows. */
int expert_rows(const uint16_t *x, const uint16_t *w, const int32_t *ends, uint16_t *out, long experts, long n,
                long k, int threads) {
#ifdef KERNEL
    long rows = experts ? ends[experts - 1] : 0;
    /* rows of x copied 64 bytes further apart than k, for the tiles: rows 4 KiB apart share the
     * same L1 sets; each expert's wide_rows packed for the wide forms, at packed[e]; after[e]:
     * the next expert with rows (or -1), whose weight the prefetches run on into past e's end */
    long ldx = tile_stride(k), total = 0;
    long *packed = malloc((size_t)(experts ? 2 * experts : 1) * sizeof(long)), *after = packed + experts;
    if (!packed) return -1;
    for (long e = 0; e < experts; e++) {
        long count = ends[e] - (e ? ends[e - 1] : 0);
        packed[e] = total;
        if (wide_rows(count)) total += packed_dwords(wide_rows(count), k);
    }
    for (long e = experts - 1, seen = -1; e >= 0; e--) {
        after[e] = seen;
        if (ends[e] > (e ? ends[e - 1] : 0)) seen = e;
    }
    xrow_t *xp = aligned_alloc(64, (size_t)(rows ? rows : 1) * ldx * sizeof(xrow_t));
    uint32_t *xq = aligned_alloc(64, (size_t)(total ? total : 1) * 4);
    if (!xp || !xq) {
        free(packed), free(xp), free(xq);
        return -1;
    }
    for (long e = 0; e < experts; e++) {
        long start = e ? ends[e - 1] : 0, count = ends[e] - start, wide = wide_rows(count);
        if (wide) pack_rows(x + start * k, k, wide, xq + packed[e]);
        tile_rows(x + (start + wide) * k, k, count - wide, xp + (start + wide) * ldx, ldx);
    }
    long blocks = (n + COLS - 1) / COLS, items = experts * blocks;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
    for (long item = 0; item < items; item++) {
        long e = item / blocks, b = item % blocks;
        long start = e ? ends[e - 1] : 0, count = ends[e] - start, wide = wide_rows(count);
        if (count <= 0) continue;
        long i0 = b * COLS, i1 = i0 + COLS < n ? i0 + COLS : n;
        const uint16_t *next = after[e] >= 0 ? w + after[e] * n * k : NULL;
        if (wide) wide_range(w + e * n * k, n, k, xq + packed[e], out + start * n, n, wide, i0, i1, next);
        if (count > wide)
            rows_block(w + e * n * k, n, k, xp + (start + wide) * ldx, ldx, out + (start + wide) * n, n, i0, i1,
                       count - wide, next);
    }
    free(packed), free(xp), free(xq);
    return 0;
#else
    (void)x; (void)w; (void)ends; (void)out; (void)experts; (void)n; (void)k; (void)threads;
    return -1;
#endif
}

#ifdef KERNEL
/* out[e] = x[e] @ (the [k, n] matrix of entry e) for e < experts: x [experts, rows, k] and out
 * [experts, rows, n] contiguous; entry e's rows as ``kn_row`` finds them from ``base``, offset by
 * e * ws elements (dense) or, paged, by (e / heads) * tw table entries and (e % heads) * n
 * elements (head e % heads of a table row's tokens; heads 1 where each token row is one). */
static int kn_all(const uint16_t *x, const kn_rows_at *base, long ws, long tw, long heads, uint16_t *out,
                  long experts, long rows, long k, long n, int threads) {
    long per = (k + 1) / 2 * rows, total = experts * per, blocks = (n + 31) / 32;
    long own = KN_PANEL + (rows * 32 * blocks * (long)sizeof(float) + 63) / 64 * 64; /* bytes per thread */
    int workers = threads > 1 ? threads : 1;
    uint32_t *xq = aligned_alloc(64, (size_t)(total ? total : 1) * 4);
    char *scratch = aligned_alloc(64, (size_t)(workers * own));
    if (!xq || !scratch) {
        free(xq), free(scratch);
        return -1;
    }
    for (long e = 0; e < experts; e++) pack_kn(x + e * rows * k, rows, k, xq + e * per);
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
    for (long e = 0; e < experts; e++) {
#ifdef _OPENMP
        char *mine = scratch + omp_get_thread_num() * own;
#else
        char *mine = scratch;
#endif
        kn_rows_at at = {base->w + e * ws + e % heads * n, base->table ? base->table + e / heads * tw : NULL,
                         base->bs, base->bstride, base->rstride};
        kn_matrix(xq + e * per, rows, &at, k, n, out + e * rows * n, (__m512i *)mine, (float *)(mine + KN_PANEL));
    }
    free(xq), free(scratch);
    return 0;
}
#endif

/* out[e] = x[e] @ w[e] for e < experts: x [experts, rows, k] and out [experts, rows, n]
 * contiguous, w[e] at w + e * ws a row-major [k, n] (rows at stride n); all bfloat16. threads > 1
 * splits the experts over OpenMP threads. Returns 0, or -1 where this build lacks the kernel or
 * memory for the packed rows. */
int kn_rows(const uint16_t *x, const uint16_t *w, long ws, uint16_t *out, long experts, long rows, long k, long n,
            int threads) {
#ifdef KERNEL
    kn_rows_at base = {w, NULL, 0, 0, n};
    return kn_all(x, &base, ws, 0, 1, out, experts, rows, k, n, threads);
#else
    (void)x; (void)w; (void)ws; (void)out; (void)experts; (void)rows; (void)k; (void)n; (void)threads;
    return -1;
#endif
}

#ifdef KERNEL
/* rows rows of k elements, rstride apart at from, to one after another at to */
static void stage_rows(const uint16_t *from, long rstride, long rows, long k, uint16_t *to) {
    for (long r = 0; r < rows; r++, from += rstride, to += k) {
        long c = 0;
        for (; c + 16 <= k; c += 16)
            _mm256_storeu_si256((__m256i *)(to + c), _mm256_loadu_si256((const __m256i *)(from + c)));
        memcpy(to + c, from + c, (size_t)(k - c) * 2);
    }
}
#endif

/* Attention's decode products over a paged cache, read where it lies (no gathered copy).
 * The cache: blocks of bs token rows, block b at cache + b * bstride, each token row ``heads``
 * rows of ``width`` contiguous elements (MLA's latent or rope rows: heads 1; standard attention's
 * [S, Hk, D] blocks: Hk kv heads' rows of D). Entry s (< seqs) reads head s % heads of its table
 * row s / heads: token t is head s % heads of token row t % bs of block
 * table[s / heads * tw + t / bs] (T = tw * bs tokens, ids checked by the caller). All bfloat16
 * but the int32 table.
 * paged_rows: out[s] [rows, T] = x[s] [rows, width] times the tokens' rows transposed (the scores);
 * each block is a weight of bs rows for the tiles or wide forms above, one head's rows copied
 * together first where heads > 1 (the forms take rows width apart), all heads of a block in turn.
 * paged_kn: out[s] [rows, width] = x[s] [rows, T] times the tokens' rows [T, width] (the values);
 * kn_matrix reading its panel rows through the table.
 * threads > 1 splits the work over OpenMP threads. Return 0, or -1 where this build lacks the
 * kernel or memory for the packed rows. */
int paged_rows(const uint16_t *x, const uint16_t *cache, const int32_t *table, uint16_t *out, long seqs, long tw,
               long bs, long bstride, long rows, long width, long heads, int threads) {
#ifdef KERNEL
    const long k = width, t_all = tw * bs, wide = wide_rows(rows), ldx = tile_stride(k), rstride = heads * width;
    /* per sequence: its wide rows packed (per_wide dwords), then the rest copied for the tiles */
    const long per_wide = wide ? packed_dwords(wide, k) : 0;
    const long per = per_wide + (rows - wide) * ldx * (long)sizeof(xrow_t) / 4;
    /* per thread, where heads > 1: one block's rows of one head, together */
    const long staged = heads > 1 ? (bs * k + 31) / 32 * 32 : 0;
    uint32_t *xbuf = aligned_alloc(64, (size_t)(seqs * per > 0 ? seqs * per : 1) * 4);
    uint16_t *stage = aligned_alloc(64, (size_t)((threads > 1 ? threads : 1) * staged * 2 + 64));
    if (!xbuf || !stage) {
        free(xbuf), free(stage);
        return -1;
    }
    for (long s = 0; s < seqs; s++) {
        if (wide) pack_rows(x + s * rows * k, k, wide, xbuf + s * per);
        tile_rows(x + (s * rows + wide) * k, k, rows - wide, (xrow_t *)(xbuf + s * per + per_wide), ldx);
    }
    /* a work item: chunk blocks of one table row, each block for all its heads in turn (the
     * block's token rows read once, in order) */
    long chunk = COLS / bs < 1 ? 1 : COLS / bs;
    long per_seq = (tw + chunk - 1) / chunk, items = seqs / heads * per_seq;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
    for (long item = 0; item < items; item++) {
#ifdef _OPENMP
        uint16_t *mine = stage + omp_get_thread_num() * staged;
#else
        uint16_t *mine = stage;
#endif
        long row = item / per_seq, j0 = item % per_seq * chunk, j1 = j0 + chunk < tw ? j0 + chunk : tw;
        const int32_t *ids = table + row * tw;
        for (long j = j0; j < j1; j++)
            for (long h = 0; h < heads; h++) {
                long s = row * heads + h;
                const uint16_t *wb = cache + ids[j] * bstride + h * width;
                /* the next block prefetched by the forms; where heads > 1 not: T0, T2 or none measured
                 * alike (3.7-4.7 ms, Llama-3-8B's heads, batch 8, context 1024, one core, 21 runs alternating) */
                const uint16_t *next = heads == 1 && j + 1 < tw ? cache + ids[j + 1] * bstride : NULL;
                uint16_t *o = out + s * rows * t_all + j * bs;
                if (heads > 1) {
                    stage_rows(wb, rstride, bs, k, mine);
                    wb = mine;
                }
                if (wide) wide_range(wb, bs, k, xbuf + s * per, o, t_all, wide, 0, bs, next);
                if (rows > wide)
                    rows_block(wb, bs, k, (xrow_t *)(xbuf + s * per + per_wide), ldx, o + wide * t_all, t_all, 0, bs,
                               rows - wide, wide ? NULL : next);
            }
    }
    free(xbuf), free(stage);
    return 0;
#else
    (void)x; (void)cache; (void)table; (void)out; (void)seqs; (void)tw; (void)bs; (void)bstride; (void)rows;
    (void)width; (void)heads; (void)threads;
    return -1;
#endif
}

int paged_kn(const uint16_t *x, const uint16_t *cache, const int32_t *table, uint16_t *out, long seqs, long tw,
             long bs, long bstride, long rows, long width, long heads, int threads) {
#ifdef KERNEL
    kn_rows_at base = {cache, table, bs, bstride, heads * width};
    return kn_all(x, &base, 0, tw, heads, out, seqs, rows, tw * bs, width, threads);
#else
    (void)x; (void)cache; (void)table; (void)out; (void)seqs; (void)tw; (void)bs; (void)bstride; (void)rows;
    (void)width; (void)heads; (void)threads;
    return -1;
#endif
}
