/* Decode attention over a paged cache, reading each row's live tokens only (its context length,
 * a loop bound read at run time: the caller's shapes stay those of the full block table), in one
 * pass: the scores of a block, an online softmax, the block's values, each block read once for
 * both (flash decoding). Exported: decode_attention.
 *
 * One query row b (of B) has Hq heads; kv head hk serves query heads hk * g .. hk * g + g - 1.
 * Token t of row b lies in block table[b * tw + t / bs], token row t % bs. A cache element is
 * addressed by (block, token row, kv head) strides, its last dimension contiguous:
 *   score(h, t) = scale * (q[h] . k[t, hk] + qr[h] . r[t, hk])   (r: MLA's rope part; none for GQA)
 *   out[h]      = sum_t softmax_t(score(h, t)) * v[t, hk]
 * MLA passes kv_c as both k and v (one kv head, g = H); GQA passes k and v. Float32 sums and
 * softmax; a bfloat16 output rounded once. A row of context 0 reads nothing and gives zeros.
 * Long rows are split over several work items (their partial softmax merged after), so that B
 * rows keep `threads` OpenMP threads busy. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "attention_tiles.h"

#if AG_VEC_BITS
typedef struct {
    elem_t k, r, v; /* r.width 0: no rope part */
    const int32_t *table;
    const int32_t *ctx;
    long tw, bs, hk, g;
} attn_t;

/* Tokens t0 .. t1 - 1 of row b, kv head hk: the partial softmax state m[g], l[g] (max, sum) and
 * acc[g][v.width], for the g query heads q (scaled, float32, [g, k.width]) and qr ([g, r.width]).
 * s: scratch of g * bs floats. */
AG_INLINE void attend(const attn_t *a, long b, long hk, long t0, long t1, const float *q, const float *qr,
                      const uint16_t *qb, const uint16_t *qrb, float scale, float *m, float *l, float *acc, float *s,
                      uint32_t *pp, const void **krows, const void **rrows, const void **vrows, int bf16) {
    const int pairs = PAIRS && bf16; /* then qb, qrb (raw bf16) serve, else q, qr (scaled float32) */
    (void)scale;
    const long np = (a->bs + 1) / 2;
    const long g = a->g, bs = a->bs, vw = a->v.width;
    for (long h = 0; h < g; h++) m[h] = -INFINITY, l[h] = 0;
    memset(acc, 0, (size_t)(g * vw) * sizeof(float));
    for (long t = t0; t < t1;) {
        const long j = t / bs, r0 = t % bs, n = (t1 - t < bs - r0) ? t1 - t : bs - r0;
        const long block = a->table[b * a->tw + j];
        for (long i = 0; i < n; i++) {
            krows[i] = row_of(&a->k, block, r0 + i, hk, bf16);
            rrows[i] = a->r.width ? row_of(&a->r, block, r0 + i, hk, bf16) : NULL;
            vrows[i] = row_of(&a->v, block, r0 + i, hk, bf16);
        }
        memset(s, 0, (size_t)(g * bs) * sizeof(float));
        for (long i = 0; i < n; i += TT) {
            int nt = n - i < TT ? (int)(n - i) : TT;
            for (long h = 0; h < g; h += TH) {
                int nh = g - h < TH ? (int)(g - h) : TH;
                float *sh = s + h * bs + i;
#if PAIRS
                if (pairs) {
                    const long kw = a->k.width, rw = a->r.width;
                    if (nh == TH && nt == TT) {
                        score_tile_pairs(qb + h * kw, kw, krows + i, TH, TT, sh, bs, scale);
                        if (rw) score_tile_pairs(qrb + h * rw, rw, rrows + i, TH, TT, sh, bs, scale);
                    } else {
                        score_tile_pairs(qb + h * kw, kw, krows + i, nh, nt, sh, bs, scale);
                        if (rw) score_tile_pairs(qrb + h * rw, rw, rrows + i, nh, nt, sh, bs, scale);
                    }
                    continue;
                }
#endif
                if (nh == TH && nt == TT) { /* the common case, its loops unrolled */
                    score_tile(q + h * a->k.width, a->k.width, krows + i, TH, TT, sh, bs, bf16);
                    if (a->r.width) score_tile(qr + h * a->r.width, a->r.width, rrows + i, TH, TT, sh, bs, bf16);
                } else {
                    score_tile(q + h * a->k.width, a->k.width, krows + i, nh, nt, sh, bs, bf16);
                    if (a->r.width) score_tile(qr + h * a->r.width, a->r.width, rrows + i, nh, nt, sh, bs, bf16);
                }
            }
        }
        for (long h = 0; h < g; h++) { /* the online softmax over this block's n scores */
            float *sh = s + h * bs, mx = m[h];
            for (long i = 0; i < n; i++) mx = sh[i] > mx ? sh[i] : mx;
            const float corr = m[h] == -INFINITY ? 0.0f : expf(m[h] - mx);
            float sum = 0;
            long i = 0;
            for (; i + LANES <= n; i += LANES) {
                vf e = vexp(load_f32(sh + i) - mx);
                memcpy(sh + i, &e, sizeof e);
                sum += hsum(e);
            }
            for (; i < n; i++) sum += (sh[i] = expf(sh[i] - mx));
            l[h] = l[h] * corr + sum, m[h] = mx;
            if (corr != 1.0f)
                for (long c = 0; c < vw; c++) acc[h * vw + c] *= corr;
        }
#if PAIRS
        if (pairs) {
            for (long h = 0; h < g; h++)
                for (long i = 0; i < n; i += 2)
                    pp[h * np + i / 2] = ag_to_bf16(s[h * bs + i]) | (uint32_t)(i + 1 < n ? ag_to_bf16(s[h * bs + i + 1]) : 0) << 16;
            for (long h0 = 0; h0 < g; h0 += VH)
                if (g - h0 >= VH)
                    value_tile_pairs(acc, h0, VH, vw, pp, np, vrows, n);
                else
                    value_tile_pairs(acc, h0, (int)(g - h0), vw, pp, np, vrows, n);
            t += n;
            continue;
        }
#endif
        (void)pp, (void)np, (void)pairs, (void)qb, (void)qrb;
        value_block(acc, g, vw, s, bs, vrows, n, bf16);
        t += n;
    }
}

/* One work item's share: query rows and tokens as cut by decode_attention */
typedef struct {
    long b, hk, t0, t1;
} item_t;

AG_INLINE int run(const attn_t *a, const void *q, const void *qr, void *out, long rows, float scale, int threads,
                  int bf16) {
    const long g = a->g, hq = a->hk * g, kw = a->k.width, rw = a->r.width, vw = a->v.width, bs = a->bs;
    long total = 0;
    for (long b = 0; b < rows; b++) total += a->ctx[b] > 0 ? a->ctx[b] : 0;
    /* a split holds whole blocks, at least 4 of them, about total / (4 threads) tokens */
    long span = (total / (4 * threads * a->hk) + bs - 1) / bs * bs;
    span = span < 4 * bs ? 4 * bs : span;
    long items = 0;
    for (long b = 0; b < rows; b++) items += a->hk * (a->ctx[b] > 0 ? (a->ctx[b] + span - 1) / span : 1);
    item_t *work = malloc((size_t)items * sizeof(item_t));
    long *first = malloc((size_t)(rows + 1) * sizeof(long)); /* row b's items: first[b] .. first[b + 1] - 1 */
    const long state = g * (vw + 2);                          /* m, l, acc per item */
    float *part = malloc((size_t)items * state * sizeof(float));
    float *qf = malloc((size_t)(rows * hq * (kw + rw) + 1) * sizeof(float));
    float *scr = malloc((size_t)(threads * g * bs) * sizeof(float));
    const void **ptrs = malloc((size_t)(threads * 3 * bs) * sizeof(void *));
    uint32_t *pps = malloc((size_t)(threads * g * ((bs + 1) / 2)) * sizeof(uint32_t));
    if (!work || !first || !part || !qf || !scr || !ptrs || !pps) {
        free(work), free(first), free(part), free(qf), free(scr), free(ptrs), free(pps);
        return -1;
    }
    long n = 0;
    for (long b = 0; b < rows; b++) {
        first[b] = n;
        for (long hk = 0; hk < a->hk; hk++) {
            long c = a->ctx[b] > 0 ? a->ctx[b] : 0, t0 = 0;
            do {
                long t1 = t0 + span < c ? t0 + span : c;
                work[n++] = (item_t){b, hk, t0, t1};
                t0 = t1;
            } while (t0 < c);
        }
    }
    first[rows] = n;
    for (long i = 0; i < rows * hq * kw; i++) qf[i] = scalar_elem(q, i, bf16) * scale;
    float *qrf = qf + rows * hq * kw;
    for (long i = 0; i < rows * hq * rw; i++) qrf[i] = scalar_elem(qr, i, bf16) * scale;

#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
    for (long i = 0; i < items; i++) {
        int me = 0;
#ifdef _OPENMP
        me = omp_get_thread_num();
#endif
        float *s = scr + me * g * bs;
        const void **rowp = ptrs + me * 3 * bs;
        const item_t *it = &work[i];
        float *st = part + i * state;
        const long qrow = it->b * hq + it->hk * g;
        const uint16_t *qb = bf16 ? (const uint16_t *)q + qrow * kw : NULL;
        const uint16_t *qrb = bf16 && rw ? (const uint16_t *)qr + qrow * rw : NULL;
        attend(a, it->b, it->hk, it->t0, it->t1, qf + qrow * kw, rw ? qrf + qrow * rw : NULL, qb, qrb, scale, st,
               st + g, st + 2 * g, s, pps + me * g * ((bs + 1) / 2), rowp, rowp + bs, rowp + 2 * bs, bf16);
    }

#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (long b = 0; b < rows; b++)
        for (long hk = 0; hk < a->hk; hk++)
            for (long h = 0; h < g; h++) {
                float mx = -INFINITY, den = 0;
                long i0 = first[b], i1 = first[b + 1];
                for (long i = i0; i < i1; i++)
                    if (work[i].hk == hk && part[i * state + h] > mx) mx = part[i * state + h];
                float o[vw > 0 ? vw : 1];
                memset(o, 0, (size_t)vw * sizeof(float));
                for (long i = i0; i < i1; i++) {
                    if (work[i].hk != hk || work[i].t1 <= work[i].t0) continue;
                    const float *st = part + i * state, f = expf(st[h] - mx);
                    den += st[g + h] * f;
                    for (long c = 0; c < vw; c++) o[c] += st[2 * g + h * vw + c] * f;
                }
                const long at = (b * hq + hk * g + h) * vw;
                const float inv = den > 0 ? 1.0f / den : 0.0f;
                for (long c = 0; c < vw; c++) {
                    if (bf16)
                        ((uint16_t *)out)[at + c] = ag_to_bf16(o[c] * inv);
                    else
                        ((float *)out)[at + c] = o[c] * inv;
                }
            }
    free(work), free(first), free(part), free(qf), free(scr), free(ptrs), free(pps);
    return 0;
}
#endif

/* q [rows, hk * g, kw] and qr [rows, hk * g, rw] (contiguous; qr unused where rw is 0) against the
 * caches k, r, v (each given by its base and its block, token row and kv head strides, in
 * elements; last dimension contiguous), tables [rows, tw] int32, ctx [rows] int32 (each at most tw
 * * bs) -> out [rows, hk * g, vw] contiguous. bf16: every tensor but the two int32 ones is
 * bfloat16, else float32. scale multiplies the scores. Returns 0, or -1 where this build lacks
 * the kernel or memory for its work list. */
AG_EXPORT int decode_attention(const void *q, const void *qr, const void *k, const void *r, const void *v,
                               const int32_t *table, const int32_t *ctx, void *out, long rows, long hk, long g,
                               long kw, long rw, long vw, const long *strides, long tw, long bs, float scale,
                               int bf16, int threads) {
#if AG_VEC_BITS
    attn_t a = {{k, kw, strides[0], strides[1], strides[2]},
                {r, rw, strides[3], strides[4], strides[5]},
                {v, vw, strides[6], strides[7], strides[8]},
                table, ctx, tw, bs, hk, g};
    if (threads < 1) threads = 1;
    return bf16 ? run(&a, q, qr, out, rows, scale, threads, 1) : run(&a, q, qr, out, rows, scale, threads, 0);
#else
    (void)q, (void)qr, (void)k, (void)r, (void)v, (void)table, (void)ctx, (void)out, (void)rows, (void)hk, (void)g;
    (void)kw, (void)rw, (void)vw, (void)strides, (void)tw, (void)bs, (void)scale, (void)bf16, (void)threads;
    return -1;
#endif
}
