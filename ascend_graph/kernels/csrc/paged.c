/* Attention's decode products over a paged cache, each block read where it lies through the
 * block table (no gathered copy). Exported: paged_rows (the scores: the row-major forms, each
 * block a weight of bs rows) and paged_kn (the values: the [K, N] form reading its rows through
 * the table).
 *
 * The cache: blocks of bs token rows, block b at cache + b * bstride, each token row `heads` rows
 * of `width` contiguous elements (MLA's latent or rope rows: heads 1; standard attention's [S, Hk,
 * D] blocks: Hk kv heads' rows of D). Entry s (< seqs) reads head s % heads of its table row s /
 * heads: token t is head s % heads of token row t % bs of block table[s / heads * tw + t / bs]
 * (T = tw * bs tokens; the caller checks the ids). All bfloat16 but the int32 table. threads > 1
 * splits the work over OpenMP threads. Both return 0, or -1 where this build lacks the kernel or
 * memory for the packed rows. */
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "matmul.h"

#if AG_VEC_BITS
/* rows rows of k elements, rstride apart at from, to one after another at to */
static void stage_rows(const uint16_t *from, long rstride, long rows, long k, uint16_t *to) {
    for (long r = 0; r < rows; r++, from += rstride, to += k) ag_copy_bf16(to, from, k);
}

/* One table row's blocks j0 .. j1 - 1 (of tw), each for all its heads in turn (the block's token
 * rows read once, in order): entry s's rows (packed at xs) times each block's rows of its head. */
static void score_blocks(const uint32_t *xbuf, long per, long per_wide, const uint16_t *cache, const int32_t *ids,
                         uint16_t *out, long row, long j0, long j1, long tw, long bs, long bstride, long rows,
                         long width, long heads, uint16_t *mine) {
    const long k = width, t_all = tw * bs, wide = ag_wide_rows(rows), ldx = ag_xrow_stride(k);
    for (long j = j0; j < j1; j++)
        for (long h = 0; h < heads; h++) {
            long s = row * heads + h;
            const uint32_t *xs = xbuf + s * per;
            const uint16_t *wb = cache + ids[j] * bstride + h * width;
            /* the next block prefetched by the forms; where heads > 1 not (docs/cpu-kernels.md) */
            const uint16_t *next = heads == 1 && j + 1 < tw ? cache + ids[j + 1] * bstride : NULL;
            uint16_t *o = out + s * rows * t_all + j * bs;
            if (heads > 1) { /* the forms take rows width apart: one head's rows copied together */
                stage_rows(wb, heads * width, bs, k, mine);
                wb = mine;
            }
            if (wide) ag_wide_range(wb, bs, k, xs, o, t_all, wide, 0, bs, next);
            if (rows > wide)
                ag_rows_block(wb, bs, k, (const ag_xrow_t *)(xs + per_wide), ldx, o + wide * t_all, t_all, 0, bs,
                              rows - wide, wide ? NULL : next);
        }
}
#endif

/* out[s] [rows, T] = x[s] [rows, width] times the tokens' rows transposed */
AG_EXPORT int paged_rows(const uint16_t *x, const uint16_t *cache, const int32_t *table, uint16_t *out, long seqs,
                         long tw, long bs, long bstride, long rows, long width, long heads, int threads) {
#if AG_VEC_BITS
    const long k = width, wide = ag_wide_rows(rows), ldx = ag_xrow_stride(k);
    /* per sequence: its wide rows packed (per_wide dwords), then the rest as the tiles read them */
    const long per_wide = wide ? ag_packed_dwords(wide, k) : 0;
    const long per = per_wide + (rows - wide) * ldx * (long)sizeof(ag_xrow_t) / 4;
    /* per thread, where heads > 1: one block's rows of one head, together */
    const long staged = heads > 1 ? (bs * k + 31) / 32 * 32 : 0;
    uint32_t *xbuf = aligned_alloc(64, (size_t)(seqs * per > 0 ? seqs * per : 1) * 4);
    uint16_t *stage = aligned_alloc(64, (size_t)((threads > 1 ? threads : 1) * staged * 2 + 64));
    if (!xbuf || !stage) {
        free(xbuf), free(stage);
        return -1;
    }
    for (long s = 0; s < seqs; s++) {
        if (wide) ag_pack_rows(x + s * rows * k, k, wide, xbuf + s * per);
        ag_put_rows(x + (s * rows + wide) * k, k, rows - wide, (ag_xrow_t *)(xbuf + s * per + per_wide), ldx);
    }
    /* a work item: chunk blocks of one table row */
    long chunk = AG_COLS / bs < 1 ? 1 : AG_COLS / bs;
    long per_seq = (tw + chunk - 1) / chunk, items = seqs / heads * per_seq;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
    for (long item = 0; item < items; item++) {
#ifdef _OPENMP
        uint16_t *mine = stage + omp_get_thread_num() * staged;
#else
        uint16_t *mine = stage;
#endif
        long row = item / per_seq, j0 = item % per_seq * chunk, j1 = j0 + chunk < tw ? j0 + chunk : tw;
        score_blocks(xbuf, per, per_wide, cache, table + row * tw, out, row, j0, j1, tw, bs, bstride, rows, width,
                     heads, mine);
    }
    free(xbuf), free(stage);
    return 0;
#else
    (void)x, (void)cache, (void)table, (void)out, (void)seqs, (void)tw, (void)bs, (void)bstride, (void)rows;
    (void)width, (void)heads, (void)threads;
    return -1;
#endif
}

/* out[s] [rows, width] = x[s] [rows, T] times the tokens' rows [T, width] */
AG_EXPORT int paged_kn(const uint16_t *x, const uint16_t *cache, const int32_t *table, uint16_t *out, long seqs,
                       long tw, long bs, long bstride, long rows, long width, long heads, int threads) {
#if AG_VEC_BITS
    ag_kn_rows base = {cache, table, bs, bstride, heads * width};
    return ag_kn_all(x, &base, 0, tw, heads, out, seqs, rows, tw * bs, width, threads);
#else
    (void)x, (void)cache, (void)table, (void)out, (void)seqs, (void)tw, (void)bs, (void)bstride, (void)rows;
    (void)width, (void)heads, (void)threads;
    return -1;
#endif
}
