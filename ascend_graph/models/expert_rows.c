/* Few-row matmuls on CPU for a decode step: the routed experts' rows (a few per expert) and, with
 * one "expert", a dense product of a few rows; over the weights as the checkpoint stores them
 * (row-major [N, K] per expert, nothing packed).
 * Built at first use with the system C compiler for this CPU and called through ctypes by
 * expert_rows.py. bfloat16 pair dot products (vdpbf16ps) accumulate in float32; each output is
 * rounded once to bfloat16, to nearest even. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TM 4          /* a tile: TM input rows by TN weight rows, TM * TN float32 sums in registers; */
#define TN 6          /* each weight load feeds TM dot products, each input load TN */
#define AHEAD 2       /* tiles: the weight rows 2 tiles on are prefetched into L2 while this one runs */
#define COLS 120      /* weight rows (outputs) per work item, a multiple of TN */

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

/* out[a, i + b] = dot(x row a, w row i + b) for a < tm, b < tn: x rows at stride ldx, w rows at
 * stride k, out rows at stride ldo. pf: weight rows to prefetch into L2 alongside (tn of them,
 * stride k), or NULL. tm and tn are constants where it is inlined (tile_any), so the sums stay in
 * registers. */
static inline __attribute__((always_inline)) void tile(const uint16_t *w, long k, const uint16_t *x, long ldx,
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
        for (int b = 0; b < tn; b++) wv[b] = (__m512bh)_mm512_loadu_si512(wr + b * k + c);
        for (int a = 0; a < tm; a++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512(x + a * ldx + c);
            for (int b = 0; b < tn; b++) acc[a][b] = _mm512_dpbf16_ps(acc[a][b], wv[b], xv);
        }
    }
    if (tail) {
        for (int b = 0; b < tn; b++) wv[b] = (__m512bh)_mm512_maskz_loadu_epi16(tail, wr + b * k + full);
        for (int a = 0; a < tm; a++) {
            __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + a * ldx + full);
            for (int b = 0; b < tn; b++) acc[a][b] = _mm512_dpbf16_ps(acc[a][b], wv[b], xv);
        }
    }
    for (int a = 0; a < tm; a++)
        for (int b = 0; b < tn; b++) out[a * ldo + i + b] = to_bf16(_mm512_reduce_add_ps(acc[a][b]));
}

#define TILE_TN(tm)                                                              \
    switch (tn) {                                                                \
        case 1: tile(w, k, x, ldx, out, ldo, i, tm, 1, pf); break;               \
        case 2: tile(w, k, x, ldx, out, ldo, i, tm, 2, pf); break;               \
        case 3: tile(w, k, x, ldx, out, ldo, i, tm, 3, pf); break;               \
        case 4: tile(w, k, x, ldx, out, ldo, i, tm, 4, pf); break;               \
        case 5: tile(w, k, x, ldx, out, ldo, i, tm, 5, pf); break;               \
        default: tile(w, k, x, ldx, out, ldo, i, tm, TN, pf); break;             \
    }

static void tile_any(const uint16_t *w, long k, const uint16_t *x, long ldx, uint16_t *out, long ldo, long i,
                     int tm, int tn, const uint16_t *pf) {
    switch (tm) {
        case 1: TILE_TN(1) break;
        case 2: TILE_TN(2) break;
        case 3: TILE_TN(3) break;
        default: TILE_TN(TM) break;
    }
}

/* out rows 0..rows-1 (stride ldo), columns i0..i1-1 = x rows (stride ldx) times w rows i0..i1-1
 * of n. Each tile of weight rows is read from memory once (for the first TM input rows, the rest
 * find it in cache), and the weight rows AHEAD tiles on are prefetched meanwhile: the hardware
 * prefetcher alone leaves the loads and the dot products to take turns. */
static void rows_block(const uint16_t *w, long n, long k, const uint16_t *x, long ldx, uint16_t *out, long ldo,
                       long i0, long i1, long rows) {
    for (long i = i0; i < i1; i += TN) {
        int tn = i1 - i < TN ? (int)(i1 - i) : TN;
        const uint16_t *pf = i + (AHEAD + 1) * TN <= n ? w + (i + AHEAD * TN) * k : NULL;
        for (long a = 0; a < rows; a += TM)
            tile_any(w, k, x + a * ldx, ldx, out + a * ldo, ldo, i, rows - a < TM ? (int)(rows - a) : TM, tn,
                     a ? NULL : pf);
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
        rows_block(w + e * n * k, n, k, xp + start * ldx, ldx, out + start * n, n, i0, i1, count);
    }
    free(xp);
    return 0;
#else
    (void)x; (void)w; (void)ends; (void)out; (void)experts; (void)n; (void)k; (void)threads;
    return -1;
#endif
}
