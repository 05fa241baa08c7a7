/* The [K, N] form: products whose matrix is stored with the reduced dimension first (row-major
 * [k, n]: MLA decode's probabilities times each sequence's latent cache rows, standard attention's
 * values). A few matrix rows at a time are read whole (a sequential stream) and each two
 * consecutive rows interleaved into bf16 pairs along k, 16 columns per vector, into a panel of at
 * most KN_PANEL bytes (the panel's order: pair, column block, half). Each tile of input rows then
 * broadcasts its pairs (x[m, t], x[m, t + 1]) against the panel, every sum in its own vector lane,
 * kept between panels in sums[]. Written once on the 16-lane types of the vector layer. Why a
 * panel: docs/cpu-kernels.md. Exported: kn_rows. */
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "vec.h"

#if AG_VEC_BITS
#define KN_ROWS 8           /* input rows per tile: 16 sums in registers, each panel pair feeds 16 */
#define KN_PANEL (64 << 10) /* bytes of interleaved pairs per panel: in L2 */

/* sums (for m < mt: 32 floats of row m0 + m) += x rows' pairs p0 .. p0 + np - 1 (xq) times one
 * column block's np pairs in the panel (2 vectors each, pstride pairs of vectors apart); pf: the
 * next panel's rows to prefetch, 128 bytes per pair, or NULL */
AG_INLINE void kn_tile(const uint32_t *xq, long rows, long p0, long np, const ag_bf16x32 *panel, float *sums, long m0,
                       const int mt, const char *pf, long pstride) {
    ag_f32x16 lo[KN_ROWS], hi[KN_ROWS];
    for (int m = 0; m < mt; m++) {
        lo[m] = ag_f32x16_load(sums + 32 * (m0 + m));
        hi[m] = ag_f32x16_load(sums + 32 * (m0 + m) + 16);
    }
    for (long p = 0; p < np; p++) {
        if (pf) { /* two lines of the next panel's rows per pair, while the dot products run */
            ag_prefetch_l2(pf + 128 * p);
            ag_prefetch_l2(pf + 128 * p + 64);
        }
        ag_bf16x32 a = ag_bf16x32_load(panel + 2 * p * pstride);
        ag_bf16x32 b = ag_bf16x32_load(panel + 2 * p * pstride + 1);
        const uint32_t *xp = xq + (p0 + p) * rows + m0;
        for (int m = 0; m < mt; m++) {
            ag_bf16x32 xv = ag_bf16x32_set_pair((int32_t)xp[m]);
            lo[m] = ag_dot_pairs(lo[m], a, xv);
            hi[m] = ag_dot_pairs(hi[m], b, xv);
        }
    }
    for (int m = 0; m < mt; m++) {
        ag_f32x16_store(sums + 32 * (m0 + m), lo[m]);
        ag_f32x16_store(sums + 32 * (m0 + m) + 16, hi[m]);
    }
}

/* pairs p0 .. p0 + np - 1 of the rows of the [k, n] matrix w, all column blocks, interleaved into the panel */
static void fill_panel(const uint16_t *w, long k, long n, long p0, long np, ag_bf16x32 *panel) {
    const long blocks = (n + 31) / 32;
    for (long p = 0; p < np; p++) {
        long t = 2 * (p0 + p);
        const uint16_t *w0 = w + t * n, *w1 = t + 1 < k ? w + (t + 1) * n : NULL;
        for (long b = 0; b < blocks; b++) {
            long cols = n - 32 * b < 32 ? n - 32 * b : 32;
            ag_bf16x32 r0 = ag_bf16x32_load_part(w0 + 32 * b, cols);
            ag_bf16x32 r1 = w1 ? ag_bf16x32_load_part(w1 + 32 * b, cols) : ag_bf16x32_zero();
            ag_interleave_pairs(r0, r1, panel + (p * blocks + b) * 2, panel + (p * blocks + b) * 2 + 1);
        }
    }
}

#define KN_TILE(mt) kn_tile(xq, rows, p0, np, pb, sb, m0, mt, pf, blocks)

/* out (rows at stride n) = x rows (pairs xq) times the [k, n] matrix w; panel: KN_PANEL bytes,
 * sums: rows * 32 * blocks floats, both 64-byte aligned. */
static void kn_matrix(const uint32_t *xq, long rows, const uint16_t *w, long k, long n, uint16_t *out,
                      ag_bf16x32 *panel, float *sums) {
    const long pairs = (k + 1) / 2, blocks = (n + 31) / 32;
    long chunk = KN_PANEL / (blocks * 128);
    if (chunk < 1) chunk = 1;
    memset(sums, 0, (size_t)(rows * 32 * blocks) * sizeof(float));
    for (long p0 = 0; p0 < pairs; p0 += chunk) {
        long np = pairs - p0 < chunk ? pairs - p0 : chunk;
        fill_panel(w, k, n, p0, np, panel);
        /* the next panel's rows (one after another) are prefetched by the tiles, 128 bytes per pair each */
        const long t1 = 2 * (p0 + np), row_bytes = n * 2;
        const long next_bytes = (k - t1 < 2 * chunk ? k - t1 : 2 * chunk) * row_bytes; /* <= 0: none */
        long next_off = 0;
        for (long b = 0; b < blocks; b++)
            for (long m0 = 0; m0 < rows; m0 += KN_ROWS) {
                const ag_bf16x32 *pb = panel + b * 2;
                float *sb = sums + b * rows * 32;
                const char *pf = next_off < next_bytes ? (const char *)(w + t1 * n) + next_off : NULL;
                next_off += 128 * np;
                switch (rows - m0 < KN_ROWS ? rows - m0 : KN_ROWS) {
                    case 1: KN_TILE(1); break;
                    case 2: KN_TILE(2); break;
                    case 3: KN_TILE(3); break;
                    case 4: KN_TILE(4); break;
                    case 5: KN_TILE(5); break;
                    case 6: KN_TILE(6); break;
                    case 7: KN_TILE(7); break;
                    default: KN_TILE(KN_ROWS); break;
                }
            }
    }
    for (long b = 0; b < blocks; b++) {
        long cols = n - 32 * b < 32 ? n - 32 * b : 32;
        for (long m = 0; m < rows; m++) {
            const float *sm = sums + (b * rows + m) * 32;
            uint16_t *o = out + m * n + 32 * b;
            ag_store_bf16x16(o, ag_f32x16_load(sm), cols);
            ag_store_bf16x16(o + 16, ag_f32x16_load(sm + 16), cols - 16);
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

/* out[e] = x[e] @ w[e] for e < experts (as kn_rows); 0, or -1 without memory for the packed rows */
static int kn_all(const uint16_t *x, const uint16_t *w, long ws, uint16_t *out, long experts, long rows, long k,
                  long n, int threads) {
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
        kn_matrix(xq + e * per, rows, w + e * ws, k, n, out + e * rows * n, (ag_bf16x32 *)mine,
                  (float *)(mine + KN_PANEL));
    }
    free(xq), free(scratch);
    return 0;
}
#endif

/* out[e] = x[e] @ w[e] for e < experts: x [experts, rows, k] and out [experts, rows, n]
 * contiguous, w[e] at w + e * ws a row-major [k, n] (rows at stride n); all bfloat16. threads > 1
 * splits the experts over OpenMP threads. Returns 0, or -1 where this build lacks the kernel or
 * memory for the packed rows. */
AG_EXPORT int kn_rows(const uint16_t *x, const uint16_t *w, long ws, uint16_t *out, long experts, long rows, long k,
                   long n, int threads) {
#if AG_VEC_BITS
    return kn_all(x, w, ws, out, experts, rows, k, n, threads);
#else
    (void)x, (void)w, (void)ws, (void)out, (void)experts, (void)rows, (void)k, (void)n, (void)threads;
    return -1;
#endif
}
