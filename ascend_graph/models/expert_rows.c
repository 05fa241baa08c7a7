/* Routed experts' matmuls on CPU for the few rows per expert of a MoE decode step, over the
 * experts' weights as the checkpoint stores them (row-major [N, K] per expert, nothing packed).
 * Built at first use with the system C compiler for this CPU and called through ctypes by
 * expert_rows.py. bfloat16 pair dot products (vdpbf16ps) accumulate in float32; each output is
 * rounded once to bfloat16, to nearest even. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ROWS 4        /* input rows taken together: one weight load feeds ROWS dot products */
#define COLS 128      /* weight rows (outputs) per work item */

/* 1 where this build has the kernel (the CPU has AVX512-BF16), else 0. */
int expert_rows_available(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512BF16__)
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* out rows 0..r-1 (row stride ldo), columns i0..i1-1 = x rows (stride ldx) times w rows i0..i1-1. */
static inline __attribute__((always_inline)) void block(const uint16_t *w, long k, const uint16_t *x, long ldx,
                                                        uint16_t *out, long ldo, long i0, long i1, const int r) {
    const long full = k / 32 * 32;
    const __mmask32 tail = (__mmask32)((1ull << (k - full)) - 1);
    for (long i = i0; i < i1; i++) {
        const uint16_t *wr = w + i * k;
        __m512 acc[ROWS];
        for (int j = 0; j < r; j++) acc[j] = _mm512_setzero_ps();
        for (long c = 0; c < full; c += 32) {
            __m512bh wv = (__m512bh)_mm512_loadu_si512(wr + c);
            for (int j = 0; j < r; j++)
                acc[j] = _mm512_dpbf16_ps(acc[j], wv, (__m512bh)_mm512_loadu_si512(x + j * ldx + c));
        }
        if (tail) {
            __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(tail, wr + full);
            for (int j = 0; j < r; j++)
                acc[j] = _mm512_dpbf16_ps(acc[j], wv, (__m512bh)_mm512_maskz_loadu_epi16(tail, x + j * ldx + full));
        }
        for (int j = 0; j < r; j++) out[j * ldo + i] = to_bf16(_mm512_reduce_add_ps(acc[j]));
    }
}

static void rows_block(const uint16_t *w, long k, const uint16_t *x, long ldx, uint16_t *out, long ldo,
                       long i0, long i1, long rows) {
    for (long j0 = 0; j0 < rows; j0 += ROWS) {
        const uint16_t *xj = x + j0 * ldx;
        uint16_t *oj = out + j0 * ldo;
        switch (rows - j0 < ROWS ? rows - j0 : ROWS) {
            case 1: block(w, k, xj, ldx, oj, ldo, i0, i1, 1); break;
            case 2: block(w, k, xj, ldx, oj, ldo, i0, i1, 2); break;
            case 3: block(w, k, xj, ldx, oj, ldo, i0, i1, 3); break;
            default: block(w, k, xj, ldx, oj, ldo, i0, i1, 4); break;
        }
    }
}
#endif

/* out[p, :] = x[p, :] @ w[e].T for the rows p of expert e, ends[e-1] <= p < ends[e] (ends
 * non-decreasing, ends[experts-1] = the row count): x [rows, k], w [experts, n, k], out [rows, n],
 * all bfloat16 and contiguous. threads > 1 splits the work over OpenMP threads. Returns 0, or -1
 * where this build lacks the kernel or the rows cannot be padded. */
int expert_rows(const uint16_t *x, const uint16_t *w, const int32_t *ends, uint16_t *out, long experts, long n,
                long k, int threads) {
#if defined(__AVX512BF16__)
    long rows = experts ? ends[experts - 1] : 0;
    /* rows of x copied 64 bytes further apart than k: rows 4 KiB apart share the same L1 sets */
    long ldx = (k + 31) / 32 * 32 + 32;
    uint16_t *xp = aligned_alloc(64, (size_t)(rows ? rows : 1) * ldx * 2);
    if (!xp) return -1;
    for (long p = 0; p < rows; p++) memcpy(xp + p * ldx, x + p * k, (size_t)k * 2);
    long blocks = (n + COLS - 1) / COLS, items = experts * blocks;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
    for (long item = 0; item < items; item++) {
        long e = item / blocks, b = item % blocks;
        long start = e ? ends[e - 1] : 0, count = ends[e] - start;
        if (count <= 0) continue;
        long i0 = b * COLS, i1 = i0 + COLS < n ? i0 + COLS : n;
        rows_block(w + e * n * k, k, xp + start * ldx, ldx, out + start * n, n, i0, i1, count);
    }
    free(xp);
    return 0;
#else
    (void)x; (void)w; (void)ends; (void)out; (void)experts; (void)n; (void)k; (void)threads;
    return -1;
#endif
}
