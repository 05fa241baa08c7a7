/* The MoE entry: each routed expert's few rows times its weight, over the weights as the
 * checkpoint stores them (row-major [n, k] per expert, nothing packed); with one "expert", a dense
 * product of a few rows. An expert's rows go through the tiles, or, from AG_WIDE_MIN rows, the
 * wide forms (matmul_tiles.c, matmul_wide.c). Exported: expert_rows, expert_rows_available; and,
 * compiled again over float32 (matmul_f32.c), expert_rows_f32. */
#include <stdlib.h>

#include "matmul.h"

#if !AG_F32
/* The vector width this build's kernel is written in: 512 (AVX512-BF16), 256 (AVX2 and FMA), or
 * 0: no kernel on this CPU (every other entry returns -1). */
AG_EXPORT int expert_rows_available(void) { return AG_VEC_BITS; }
#endif

#if AG_VEC_BITS
/* rows of expert e (ends as for expert_rows) */
static inline long first_row(const int32_t *ends, long e) { return e ? ends[e - 1] : 0; }
#endif

/* out[p, :] = x[p, :] @ w[e].T for the rows p of expert e, ends[e-1] <= p < ends[e] (ends
 * non-decreasing, ends[experts-1] = the row count): x [rows, k], w [experts, n, k], out [rows, n],
 * all bfloat16 (expert_rows_f32: float32) and contiguous. threads > 1 splits the work (experts by AG_COLS weight rows) over
 * OpenMP threads. Returns 0, or -1 where this build lacks the kernel or memory for the copied rows. */
AG_EXPORT int AG_TYPED(expert_rows)(const ag_elem_t *x, const ag_elem_t *w, const int32_t *ends, ag_elem_t *out,
                                    long experts, long n, long k, int threads) {
#if AG_VEC_BITS
    long rows = experts ? ends[experts - 1] : 0;
    /* the tiles' rows at xp (stride ldx); each expert's wide rows packed at xq + packed[e];
     * after[e]: the next expert with rows (or -1), whose weight the prefetches run on into past e's end */
    long ldx = ag_xrow_stride(k), total = 0;
    long *packed = malloc((size_t)(experts ? 2 * experts : 1) * sizeof(long)), *after = packed + experts;
    if (!packed) return -1;
    for (long e = 0; e < experts; e++) {
        long wide = ag_wide_rows(ends[e] - first_row(ends, e));
        packed[e] = total;
        if (wide) total += ag_packed_dwords(wide, k);
    }
    for (long e = experts - 1, seen = -1; e >= 0; e--) {
        after[e] = seen;
        if (ends[e] > first_row(ends, e)) seen = e;
    }
    ag_xrow_t *xp = aligned_alloc(64, (size_t)(rows ? rows : 1) * ldx * sizeof(ag_xrow_t));
    uint32_t *xq = aligned_alloc(64, (size_t)(total ? total : 1) * 4);
    if (!xp || !xq) {
        free(packed), free(xp), free(xq);
        return -1;
    }
    for (long e = 0; e < experts; e++) {
        long start = first_row(ends, e), count = ends[e] - start, wide = ag_wide_rows(count);
        if (wide) ag_pack_rows(x + start * k, k, wide, xq + packed[e]);
        ag_put_rows(x + (start + wide) * k, k, count - wide, xp + (start + wide) * ldx, ldx);
    }
    long blocks = (n + AG_COLS - 1) / AG_COLS, items = experts * blocks;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
    for (long item = 0; item < items; item++) {
        long e = item / blocks, b = item % blocks;
        long start = first_row(ends, e), count = ends[e] - start, wide = ag_wide_rows(count);
        if (count <= 0) continue;
        long i0 = b * AG_COLS, i1 = i0 + AG_COLS < n ? i0 + AG_COLS : n;
        const ag_elem_t *we = w + e * n * k, *next = after[e] >= 0 ? w + after[e] * n * k : NULL;
        if (wide) ag_wide_range(we, n, k, xq + packed[e], out + start * n, n, wide, i0, i1, next);
        if (count > wide)
            ag_rows_block(we, n, k, xp + (start + wide) * ldx, ldx, out + (start + wide) * n, n, i0, i1, count - wide,
                          next);
    }
    free(packed), free(xp), free(xq);
    return 0;
#else
    (void)x, (void)w, (void)ends, (void)out, (void)experts, (void)n, (void)k, (void)threads;
    return -1;
#endif
}
