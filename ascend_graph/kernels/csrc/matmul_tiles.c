/* The tiles: row-major products of a few input rows by a weight stored [n, k] (each output a dot
 * product of an input row and a weight row), TM input rows by AG_TILE_N weight rows a tile, every
 * sum in registers and reduced across its vector at the end. Each weight load feeds TM dot
 * products; each tile's weight rows are read from memory once (for the first TM input rows, the
 * rest find them in cache). Up to AG_STREAM_ROWS input rows, one weight row at a time instead
 * (stream_rows). Why the prefetch and these sizes: docs/cpu-kernels.md. */
#include "matmul.h"

#if AG_VEC_BITS
#define TM 4 /* input rows per tile */

void ag_put_rows(const ag_elem_t *x, long k, long rows, ag_xrow_t *dst, long ldx) {
    for (long m = 0; m < rows; m++) ag_xrow_put(x + m * k, k, dst + m * ldx, ldx);
}

/* out[a, i + b] = dot(x row a, w row i + b) for a < tm, b < tn: x rows at stride ldx, w rows at
 * stride k, out rows at stride ldo. pf: tn weight rows to prefetch into L2 alongside (stride k),
 * or NULL. tm and tn are constants where it is inlined (tile_any), so the sums stay in registers. */
AG_INLINE void tile(const ag_elem_t *w, long k, const ag_xrow_t *x, long ldx, ag_elem_t *out, long ldo, long i,
                    const int tm, const int tn, const ag_elem_t *pf) {
    const long full = k / AG_TILE_STEP * AG_TILE_STEP;
    const ag_elem_t *wr = w + i * k;
    ag_tile_acc acc[TM][AG_TILE_N];
    for (int a = 0; a < tm; a++)
        for (int b = 0; b < tn; b++) acc[a][b] = ag_tile_zero();
    for (long c = 0; c < full; c += AG_TILE_STEP) {
        if (pf && (c & (AG_LINE_ELEMS - 1)) == 0) /* one 64-byte line of each row per line of elements */
            for (int b = 0; b < tn; b++) ag_prefetch_l2(pf + b * k + c);
#if AG_TILE_WEIGHTS_FIRST /* the ISAs' one difference of loop order (vec_*.h; docs/cpu-kernels.md) */
        ag_tile_w wv[AG_TILE_N];
        for (int b = 0; b < tn; b++) wv[b] = ag_tile_load(wr + b * k + c);
        for (int a = 0; a < tm; a++)
            for (int b = 0; b < tn; b++) acc[a][b] = ag_tile_dot(acc[a][b], wv[b], x + a * ldx + c);
#else
        for (int b = 0; b < tn; b++) {
            ag_tile_w wv = ag_tile_load(wr + b * k + c);
            for (int a = 0; a < tm; a++) acc[a][b] = ag_tile_dot(acc[a][b], wv, x + a * ldx + c);
        }
#endif
    }
    if (full < k) /* the last elements, zero-extended: no read past the row (the input rows are zero there) */
        for (int b = 0; b < tn; b++) {
            ag_tile_w wv = ag_tile_load_part(wr + b * k + full, k - full);
            for (int a = 0; a < tm; a++) acc[a][b] = ag_tile_dot(acc[a][b], wv, x + a * ldx + full);
        }
    for (int a = 0; a < tm; a++) ag_tile_store(out + a * ldo + i, acc[a], tn);
}

#define TN_AT_MOST(c) ((c) < AG_TILE_N ? (c) : AG_TILE_N) /* tn <= AG_TILE_N: the other cases do not occur */
#define TILE_TN(tm)                                                              \
    switch (tn) {                                                                \
        case 1: tile(w, k, x, ldx, out, ldo, i, tm, TN_AT_MOST(1), pf); break;   \
        case 2: tile(w, k, x, ldx, out, ldo, i, tm, TN_AT_MOST(2), pf); break;   \
        case 3: tile(w, k, x, ldx, out, ldo, i, tm, TN_AT_MOST(3), pf); break;   \
        case 4: tile(w, k, x, ldx, out, ldo, i, tm, TN_AT_MOST(4), pf); break;   \
        case 5: tile(w, k, x, ldx, out, ldo, i, tm, TN_AT_MOST(5), pf); break;   \
        default: tile(w, k, x, ldx, out, ldo, i, tm, AG_TILE_N, pf); break;      \
    }

static void tile_any(const ag_elem_t *w, long k, const ag_xrow_t *x, long ldx, ag_elem_t *out, long ldo, long i,
                     int tm, int tn, const ag_elem_t *pf) {
    switch (tm) {
        case 1: TILE_TN(1) break;
        case 2: TILE_TN(2) break;
        case 3: TILE_TN(3) break;
        default: TILE_TN(TM) break;
    }
}

/* out[a, i] = dot(x row a, w row i) for a < tm, one weight row at a time: the block's rows are
 * one sequential stream, prefetched into L1 AG_STREAM_AHEAD bytes on (into the next rows). Each
 * row's sum is split over chains = 4 / tm partial sums (a step each in turn), so that a product's
 * latency does not hold the next step up. */
AG_INLINE void stream_rows(const ag_elem_t *w, long k, const ag_xrow_t *x, long ldx, ag_elem_t *out, long ldo,
                           long i0, long i1, const int tm) {
    const int chains = tm >= 4 ? 1 : 4 / tm;
    const long full = k / AG_TILE_STEP * AG_TILE_STEP, round = chains * AG_TILE_STEP;
    for (long i = i0; i < i1; i++) {
        const ag_elem_t *wr = w + i * k;
        ag_tile_acc acc[AG_STREAM_ROWS][4];
        for (int a = 0; a < tm; a++)
            for (int j = 0; j < chains; j++) acc[a][j] = ag_tile_zero();
        long c = 0;
        for (; c + round <= full; c += round)
            for (int j = 0; j < chains; j++) {
                const long cj = c + j * AG_TILE_STEP;
                if ((cj & (AG_LINE_ELEMS - 1)) == 0) ag_prefetch_l1((const char *)(wr + cj) + AG_STREAM_AHEAD);
                ag_tile_w wv = ag_tile_load(wr + cj);
                for (int a = 0; a < tm; a++) acc[a][j] = ag_tile_dot(acc[a][j], wv, x + a * ldx + cj);
            }
        for (; c < full; c += AG_TILE_STEP) {
            ag_tile_w wv = ag_tile_load(wr + c);
            for (int a = 0; a < tm; a++) acc[a][0] = ag_tile_dot(acc[a][0], wv, x + a * ldx + c);
        }
        if (full < k) {
            ag_tile_w wv = ag_tile_load_part(wr + full, k - full);
            for (int a = 0; a < tm; a++) acc[a][0] = ag_tile_dot(acc[a][0], wv, x + a * ldx + full);
        }
        for (int a = 0; a < tm; a++) {
            for (int j = 1; j < chains; j++) acc[a][0] = ag_tile_add(acc[a][0], acc[a][j]);
            ag_tile_store(out + a * ldo + i, acc[a], 1);
        }
    }
}

#define STREAM_AT_MOST(c) ((c) < AG_STREAM_ROWS ? (c) : AG_STREAM_ROWS) /* the cases past it do not occur */

void ag_rows_block(const ag_elem_t *w, long n, long k, const ag_xrow_t *x, long ldx, ag_elem_t *out, long ldo,
                   long i0, long i1, long rows, const ag_elem_t *next) {
    if (rows <= AG_STREAM_ROWS) {
        switch (rows) {
            case 1: stream_rows(w, k, x, ldx, out, ldo, i0, i1, 1); break;
            case 2: stream_rows(w, k, x, ldx, out, ldo, i0, i1, STREAM_AT_MOST(2)); break;
            case 3: stream_rows(w, k, x, ldx, out, ldo, i0, i1, STREAM_AT_MOST(3)); break;
            default: stream_rows(w, k, x, ldx, out, ldo, i0, i1, STREAM_AT_MOST(4)); break;
        }
        return;
    }
    for (long i = i0; i < i1; i += AG_TILE_N) {
        int tn = i1 - i < AG_TILE_N ? (int)(i1 - i) : AG_TILE_N;
        const ag_elem_t *pf = ag_ahead(w, n, k, i + AG_AHEAD * AG_TILE_N, AG_TILE_N, next);
        for (long a = 0; a < rows; a += TM)
            tile_any(w, k, x + a * ldx, ldx, out + a * ldo, ldo, i, rows - a < TM ? (int)(rows - a) : TM, tn,
                     a ? NULL : pf);
    }
}
#endif
