/* What the kernels' sources share (not exported): the row-major forms over a weight of n rows of
 * k (matmul_tiles.c, matmul_wide.c) and the [K, N] form (matmul_kn.c), which the MoE entry
 * (moe.c) and the paged attention forms (paged.c) run. All bfloat16 (uint16_t) but the int32
 * tables; float32 sums, each output rounded once to bf16, to nearest even. Compiled only where
 * vec.h has a vector layer (AG_VEC_BITS). */
#ifndef AG_MATMUL_H
#define AG_MATMUL_H

#include "vec.h"

#if AG_VEC_BITS
#define AG_AHEAD 2  /* the weight rows this many tiles on are prefetched into L2 while a tile runs */
#define AG_COLS 120 /* weight rows (outputs) per work item: a multiple of every form's weight rows per tile */

/* The rows to prefetch for the tile of nw weight rows starting at row ip: in this weight of n
 * rows, else in the one read next (next: another n rows, e.g. the next cache block), else none. */
static inline const uint16_t *ag_ahead(const uint16_t *w, long n, long k, long ip, long nw, const uint16_t *next) {
    if (ip + nw <= n) return w + ip * k;
    return next && ip >= n && ip - n + nw <= n ? next + (ip - n) * k : NULL;
}

/* ---- the tiles (matmul_tiles.c): any number of rows ---- */
/* rows input rows (stride k) copied as the tiles read them (ag_xrow_put), at stride ldx = ag_xrow_stride(k) */
AG_HIDDEN void ag_put_rows(const uint16_t *x, long k, long rows, ag_xrow_t *dst, long ldx);
/* out rows 0..rows-1 (stride ldo), columns i0..i1-1 = the prepared rows x (stride ldx) times w
 * rows i0..i1-1 of n (stride k); the weight rows AG_AHEAD tiles on are prefetched meanwhile
 * (from next past the end: see ag_ahead) */
AG_HIDDEN void ag_rows_block(const uint16_t *w, long n, long k, const ag_xrow_t *x, long ldx, uint16_t *out, long ldo,
                             long i0, long i1, long rows, const uint16_t *next);

/* ---- the wide forms (matmul_wide.c): from AG_WIDE_MIN rows of one weight ---- */
/* how many of count rows of one weight go through the wide forms (the first ones; the rest
 * through the tiles) */
static inline long ag_wide_rows(long count) {
    if (count < AG_WIDE_MIN) return 0;
    return AG_WIDE_WHOLE ? count / AG_WIDE_ROWS * AG_WIDE_ROWS : count;
}
/* dwords of rows input rows packed for the wide forms */
AG_HIDDEN long ag_packed_dwords(long rows, long k);
/* rows input rows (stride k) packed for the wide forms into xq (64-byte aligned, ag_packed_dwords) */
AG_HIDDEN void ag_pack_rows(const uint16_t *x, long k, long rows, uint32_t *xq);
/* as ag_rows_block, for rows = ag_wide_rows(rows) packed rows xq */
AG_HIDDEN void ag_wide_range(const uint16_t *w, long n, long k, const uint32_t *xq, uint16_t *out, long ldo, long rows,
                             long i0, long i1, const uint16_t *next);

/* ---- the [K, N] form (matmul_kn.c) ---- */
/* Row t of a [k, n] matrix: w + t * n, or, through a block table (table not NULL), row t % bs of
 * cache block table[t / bs], blocks bstride elements apart and their rows (n elements each)
 * rstride apart: n, or a multiple of n where a token row holds several heads' rows. */
typedef struct {
    const uint16_t *w;
    const int32_t *table;
    long bs, bstride, rstride;
} ag_kn_rows;

/* out[e] = x[e] @ (the [k, n] matrix of entry e) for e < experts: x [experts, rows, k] and out
 * [experts, rows, n] contiguous; entry e's rows as base finds them, offset by e * ws elements
 * (dense) or, paged, by (e / heads) * tw table entries and (e % heads) * n elements (head e %
 * heads of a table row's tokens; heads 1 where each token row is one). threads > 1 splits the
 * entries over OpenMP threads. 0, or -1 without memory for the packed rows. */
AG_HIDDEN int ag_kn_all(const uint16_t *x, const ag_kn_rows *base, long ws, long tw, long heads, uint16_t *out,
                        long experts, long rows, long k, long n, int threads);
#endif

#endif
