/* What the kernels' sources share (not exported): the row-major forms over a weight of n rows of
 * k (matmul_tiles.c, matmul_wide.c), which the MoE entry (moe.c) runs. Weights, input rows and
 * outputs are ag_elem_t (vec.h: bfloat16, or float32 where AG_F32), the row ends int32; float32
 * sums, each bf16 output rounded once, to nearest even. Compiled only where vec.h has a vector
 * layer (AG_VEC_BITS). */
#ifndef AG_MATMUL_H
#define AG_MATMUL_H

#include "vec.h"

#if AG_VEC_BITS
#if AG_F32 /* the float32 forms' own symbols (matmul_f32.c) */
#define ag_put_rows ag_put_rows_f32
#define ag_rows_block ag_rows_block_f32
#define ag_packed_dwords ag_packed_dwords_f32
#define ag_pack_rows ag_pack_rows_f32
#define ag_wide_range ag_wide_range_f32
#endif
#define AG_AHEAD 2  /* the weight rows this many tiles on are prefetched into L2 while a tile runs */
#ifndef AG_STREAM_AHEAD
#define AG_STREAM_AHEAD 2048 /* bytes the stream form prefetches on into L1 */
#endif
#define AG_COLS 120 /* weight rows (outputs) per work item: a multiple of every form's weight rows per tile */

/* The rows to prefetch for the tile of nw weight rows starting at row ip: in this weight of n
 * rows, else in the one read next (next: another n rows, the next expert's weight), else none. */
static inline const ag_elem_t *ag_ahead(const ag_elem_t *w, long n, long k, long ip, long nw, const ag_elem_t *next) {
    if (ip + nw <= n) return w + ip * k;
    return next && ip >= n && ip - n + nw <= n ? next + (ip - n) * k : NULL;
}

/* ---- the tiles (matmul_tiles.c): any number of rows ---- */
/* rows input rows (stride k) copied as the tiles read them (ag_xrow_put), at stride ldx = ag_xrow_stride(k) */
AG_HIDDEN void ag_put_rows(const ag_elem_t *x, long k, long rows, ag_xrow_t *dst, long ldx);
/* out rows 0..rows-1 (stride ldo), columns i0..i1-1 = the prepared rows x (stride ldx) times w
 * rows i0..i1-1 of n (stride k); the weight rows AG_AHEAD tiles on are prefetched meanwhile
 * (from next past the end: see ag_ahead) */
AG_HIDDEN void ag_rows_block(const ag_elem_t *w, long n, long k, const ag_xrow_t *x, long ldx, ag_elem_t *out,
                             long ldo, long i0, long i1, long rows, const ag_elem_t *next);

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
AG_HIDDEN void ag_pack_rows(const ag_elem_t *x, long k, long rows, uint32_t *xq);
/* as ag_rows_block, for rows = ag_wide_rows(rows) packed rows xq */
AG_HIDDEN void ag_wide_range(const ag_elem_t *w, long n, long k, const uint32_t *xq, ag_elem_t *out, long ldo,
                             long rows, long i0, long i1, const ag_elem_t *next);
#endif

#endif
