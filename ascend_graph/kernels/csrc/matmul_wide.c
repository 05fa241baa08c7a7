/* The wide forms: row-major products of AG_WIDE_MIN or more input rows by one weight stored [n, k].
 * The input rows are packed once per call, in chunks of up to AG_WIDE_ROWS, and each weight pair
 * is broadcast against them, every sum in its own vector lane: each weight element is read from
 * memory once, nothing is reduced across a vector or transposed. A tile of weight rows is taken
 * against every chunk while it is in cache. On AVX-512, chunks of up to 8 rows take the pairs form
 * (below), 8 rows by 2 pairs per vector. Why these forms and sizes: docs/cpu-kernels.md. */
#include "matmul.h"

#if AG_VEC_BITS
#define MJ_MAX (AG_WIDE_ROWS / AG_LANES) /* vectors per chunk */
#define PAIRS_ROWS 8                      /* chunks of at most this many rows take the pairs form (AG_PAIRS_FORM) */
#define PW 6                              /* the pairs form's weight rows per tile */

static inline long chunk_rows(long rows, long m0) { return rows - m0 < AG_WIDE_ROWS ? rows - m0 : AG_WIDE_ROWS; }
static inline int chunk_vectors(long rows) { return (int)((rows + AG_LANES - 1) / AG_LANES); }
static inline int pairs_form(long rows) { return AG_PAIRS_FORM && rows <= PAIRS_ROWS; }

/* weight rows per tile for a chunk of rows: as many as its sums leave registers for */
static inline int chunk_nw(long rows) {
    if (pairs_form(rows)) return PW;
    int mj = chunk_vectors(rows);
    return AG_WIDE_SUMS / mj < AG_WIDE_NW ? AG_WIDE_SUMS / mj : AG_WIDE_NW;
}

/* dwords of one packed chunk: per pair of elements, its vectors (the pairs form: per 4 elements, one vector) */
static long chunk_dwords(long rows, long k) {
    if (pairs_form(rows)) return (k + 3) / 4 * 16;
    return (k + 1) / 2 * AG_LANES_DWORDS * chunk_vectors(rows);
}

long ag_packed_dwords(long rows, long k) {
    long total = 0;
    for (long m0 = 0; m0 < rows; m0 += AG_WIDE_ROWS) total += chunk_dwords(chunk_rows(rows, m0), k);
    return total;
}

/* one chunk: element pair p of row m in vector m / AG_LANES of pair p (an odd k's last pair
 * (x[k - 1], 0)); the pairs form: step s, lanes 2m and 2m + 1, elements 4s .. 4s + 3 of row m.
 * Lanes without a row, and the elements past k, are zero. */
static void pack_chunk(const ag_elem_t *x, long k, long rows, uint32_t *xq) {
    memset(xq, 0, (size_t)chunk_dwords(rows, k) * 4);
    const long mq = AG_LANES_DWORDS * chunk_vectors(rows);
    for (long m = 0; m < rows; m++) {
        const ag_elem_t *xr = x + m * k;
        if (pairs_form(rows)) {
            for (long s = 0; s < k / 4; s++) memcpy(xq + s * 16 + 2 * m, xr + 4 * s, 8);
            if (k & 3) memcpy(xq + k / 4 * 16 + 2 * m, xr + k / 4 * 4, (size_t)(k & 3) * 2);
            continue;
        }
        uint32_t *vec = xq + m / AG_LANES * AG_LANES_DWORDS;
        for (long p = 0; p < k / 2; p++) ag_lanes_pack(vec + p * mq, (int)(m % AG_LANES), xr[2 * p], xr[2 * p + 1]);
        if (k & 1) ag_lanes_pack(vec + k / 2 * mq, (int)(m % AG_LANES), xr[k - 1], 0);
    }
}

void ag_pack_rows(const ag_elem_t *x, long k, long rows, uint32_t *xq) {
    for (long m0 = 0; m0 < rows; m0 += AG_WIDE_ROWS) {
        long mr = chunk_rows(rows, m0);
        pack_chunk(x + m0 * k, k, mr, xq);
        xq += chunk_dwords(mr, k);
    }
}

/* out[m, i + b] = dot(x row m, w row i + b) for m < rows, b < nw: xq one packed chunk of mj
 * vectors; pf: nw weight rows to prefetch into L2, or NULL */
AG_INLINE void lanes_tile(const ag_elem_t *w, long k, const uint32_t *xq, ag_elem_t *out, long ldo, long rows, long i,
                          const int nw, const int mj, const ag_elem_t *pf) {
    const long pairs = k / 2, mq = AG_LANES_DWORDS * mj;
    const ag_elem_t *wr = w + i * k;
    ag_lanes_acc acc[AG_WIDE_NW][MJ_MAX];
    ag_lanes_x xv[MJ_MAX];
    for (int b = 0; b < nw; b++)
        for (int j = 0; j < mj; j++) acc[b][j] = ag_lanes_zero();
    for (long p = 0; p < pairs; p++) {
        if (pf && (p & (AG_LINE_ELEMS / 2 - 1)) == 0) /* one 64-byte line of each row per line of pairs */
            for (int b = 0; b < nw; b++) ag_prefetch_l2(pf + b * k + 2 * p);
        for (int j = 0; j < mj; j++) xv[j] = ag_lanes_load(xq + p * mq + AG_LANES_DWORDS * j);
        for (int b = 0; b < nw; b++) {
            ag_lanes_w wb = ag_lanes_wpair(wr + b * k + 2 * p);
            for (int j = 0; j < mj; j++) acc[b][j] = ag_lanes_dot(acc[b][j], wb, xv[j]);
        }
    }
    if (k & 1) { /* an odd k's last element alone: no read past the row */
        for (int j = 0; j < mj; j++) xv[j] = ag_lanes_load(xq + pairs * mq + AG_LANES_DWORDS * j);
        for (int b = 0; b < nw; b++) {
            ag_lanes_w wb = ag_lanes_wlast(wr[b * k + k - 1]);
            for (int j = 0; j < mj; j++) acc[b][j] = ag_lanes_dot(acc[b][j], wb, xv[j]);
        }
    }
    uint32_t sums[AG_WIDE_NW * AG_WIDE_ROWS] __attribute__((aligned(64)));
    for (int b = 0; b < nw; b++)
        for (int j = 0; j < mj; j++) ag_lanes_round(sums + (b * mj + j) * AG_LANES, acc[b][j]);
    for (long m = 0; m < rows; m++) { /* a row's nw outputs in one store */
        ag_elem_t o[AG_WIDE_NW];
        for (int b = 0; b < nw; b++) o[b] = ag_from_lane(sums[b * mj * AG_LANES + m]);
        memcpy(out + m * ldo + i, o, (size_t)nw * sizeof(ag_elem_t));
    }
}

#if AG_PAIRS_FORM
/* AVX-512 only. out[m, i + b] = dot(x row m, w row i + b) for m < rows <= 8, b < nw: xq packed in
 * the pairs form, a vector 8 rows by 2 bf16 pairs (lane 2m + q: row m, pair 2s + q), each step
 * broadcasting 4 weight elements (64 bits); pf: nw weight rows to prefetch into L2, or NULL. */
AG_INLINE void pairs_tile(const uint16_t *w, long k, const uint32_t *xq, uint16_t *out, long ldo, long rows, long i,
                          const int nw, const uint16_t *pf) {
    const long steps = k / 4;
    const uint16_t *wr = w + i * k;
    ag_f32x16 acc[PW];
    for (int b = 0; b < nw; b++) acc[b] = ag_f32x16_zero();
    for (long s = 0; s < steps; s++) {
        if (pf && (s & 7) == 0) /* one 64-byte line of each row per 8 steps */
            for (int b = 0; b < nw; b++) ag_prefetch_l2(pf + b * k + 4 * s);
        ag_bf16x32 xv = ag_bf16x32_loadu(xq + s * 16);
        for (int b = 0; b < nw; b++) {
            int64_t four;
            memcpy(&four, wr + b * k + 4 * s, 8);
            acc[b] = ag_dot_pairs(acc[b], ag_bf16x32_set_quad(four), xv);
        }
    }
    if (k & 3) { /* the last 1-3 elements, zero-extended: no read past the row */
        ag_bf16x32 xv = ag_bf16x32_loadu(xq + steps * 16);
        for (int b = 0; b < nw; b++) {
            int64_t four = 0;
            memcpy(&four, wr + b * k + 4 * steps, (size_t)(k & 3) * 2);
            acc[b] = ag_dot_pairs(acc[b], ag_bf16x32_set_quad(four), xv);
        }
    }
    float sums[PW * 16] __attribute__((aligned(64)));
    for (int b = 0; b < nw; b++) ag_f32x16_store(sums + b * 16, acc[b]);
    for (long m = 0; m < rows; m++)
        for (int b = 0; b < nw; b++)
            out[m * ldo + i + b] = ag_to_bf16(sums[b * 16 + 2 * m] + sums[b * 16 + 2 * m + 1]);
}
#endif

#define MJ_AT_MOST(c) ((c) < MJ_MAX ? (c) : MJ_MAX) /* mj <= MJ_MAX: the other cases do not occur */
#define LANES_MJ(nwv)                                                                               \
    switch (mj) {                                                                                   \
        case 1: lanes_tile(w, k, xq, out, ldo, rows, i, nwv, 1, pf); break;                         \
        case 2: lanes_tile(w, k, xq, out, ldo, rows, i, nwv, MJ_AT_MOST(2), pf); break;             \
        case 3: lanes_tile(w, k, xq, out, ldo, rows, i, nwv, MJ_AT_MOST(3), pf); break;             \
        default: lanes_tile(w, k, xq, out, ldo, rows, i, nwv, MJ_MAX, pf); break;                   \
    }

/* weight rows i .. i + nw - 1 against one packed chunk of rows, in the form its size takes; nw
 * is 1, AG_WIDE_NW or chunk_nw(AG_WIDE_ROWS) (PW or 1 in the pairs form) */
AG_INLINE void chunk_tile(const ag_elem_t *w, long k, const uint32_t *xq, ag_elem_t *out, long ldo, long rows, long i,
                       int nw, const ag_elem_t *pf) {
#if AG_PAIRS_FORM
    if (pairs_form(rows)) {
        if (nw == 1) pairs_tile(w, k, xq, out, ldo, rows, i, 1, pf);
        else pairs_tile(w, k, xq, out, ldo, rows, i, PW, pf);
        return;
    }
#endif
    const int mj = chunk_vectors(rows);
    if (nw == 1) LANES_MJ(1)
    else if (nw == AG_WIDE_NW) LANES_MJ(AG_WIDE_NW)
    else LANES_MJ(AG_WIDE_SUMS / MJ_MAX)
}

/* Each tile of weight rows against every chunk while its rows are in cache; the tile's size is
 * the first (largest) chunk's; the last few weight rows one at a time. */
void ag_wide_range(const ag_elem_t *w, long n, long k, const uint32_t *xq, ag_elem_t *out, long ldo, long rows,
                   long i0, long i1, const ag_elem_t *next) {
    const int nw = chunk_nw(chunk_rows(rows, 0));
    for (long i = i0; i < i1; i += nw) {
        const ag_elem_t *pf = ag_ahead(w, n, k, i + AG_AHEAD * nw, nw, next);
        const uint32_t *xc = xq;
        for (long m0 = 0; m0 < rows; m0 += AG_WIDE_ROWS) {
            long mr = chunk_rows(rows, m0);
            if (i1 - i >= nw) chunk_tile(w, k, xc, out + m0 * ldo, ldo, mr, i, nw, m0 ? NULL : pf);
            else
                for (long j = i; j < i1; j++) chunk_tile(w, k, xc, out + m0 * ldo, ldo, mr, j, 1, NULL);
            xc += chunk_dwords(mr, k);
        }
    }
}
#endif
