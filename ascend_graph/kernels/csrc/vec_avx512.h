/* The vector layer for AVX512-BF16 (included by vec.h): 512-bit vectors, the bf16 pair dot
 * product vdpbf16ps (float32 sums), masked loads and stores for tails. vec_avx2.h defines the
 * same names for AVX2 and FMA. */

/* ---- 16 float32 sums, 32 bfloat16 (16 pairs): the [K, N] form's and the pairs form's units ---- */
typedef __m512 ag_f32x16;
typedef __m512i ag_bf16x32;

AG_INLINE ag_f32x16 ag_f32x16_zero(void) { return _mm512_setzero_ps(); }
AG_INLINE ag_f32x16 ag_f32x16_load(const float *p) { return _mm512_load_ps(p); } /* 64-byte aligned */
AG_INLINE void ag_f32x16_store(float *p, ag_f32x16 v) { _mm512_store_ps(p, v); }  /* 64-byte aligned */
AG_INLINE ag_bf16x32 ag_bf16x32_zero(void) { return _mm512_setzero_si512(); }
AG_INLINE ag_bf16x32 ag_bf16x32_load(const void *p) { return _mm512_load_si512(p); } /* 64-byte aligned */
AG_INLINE ag_bf16x32 ag_bf16x32_loadu(const void *p) { return _mm512_loadu_si512(p); }
/* the first count (0..32) bfloat16 at p, the rest zero; nothing past them is read */
AG_INLINE ag_bf16x32 ag_bf16x32_load_part(const uint16_t *p, long count) {
    return _mm512_maskz_loadu_epi16((__mmask32)((1ull << count) - 1), p);
}
AG_INLINE ag_bf16x32 ag_bf16x32_set_pair(int32_t pair) { return _mm512_set1_epi32(pair); } /* every lane */
AG_INLINE ag_bf16x32 ag_bf16x32_set_quad(int64_t quad) { return _mm512_set1_epi64(quad); } /* 2 pairs, every 64 bits */

/* acc[j] += a[2j] * b[2j] + a[2j + 1] * b[2j + 1] (bf16 pairs, float32 sums), as vdpbf16ps */
AG_INLINE ag_f32x16 ag_dot_pairs(ag_f32x16 acc, ag_bf16x32 a, ag_bf16x32 b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

/* r0 and r1 (32 bf16 each) interleaved into pairs: *lo = (r0[j], r1[j]) for j < 16, *hi = the
 * same for j = 16..31 */
AG_INLINE void ag_interleave_pairs(ag_bf16x32 r0, ag_bf16x32 r1, ag_bf16x32 *lo, ag_bf16x32 *hi) {
    const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                                            6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi_idx = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24, 55, 23,
                                            54, 22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
    *lo = _mm512_permutex2var_epi16(r0, lo_idx, r1);
    *hi = _mm512_permutex2var_epi16(r0, hi_idx, r1);
}

/* each lane rounded as ag_to_bf16 rounds it, in the low 16 bits of its 32 */
AG_INLINE __m512i ag_round_lanes16(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
    return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
}

/* the first count (at most 16; none where count <= 0) lanes of v rounded to bf16, stored at p */
AG_INLINE void ag_store_bf16x16(uint16_t *p, ag_f32x16 v, long count) {
    if (count <= 0) return;
    __mmask16 mask = (__mmask16)(count >= 16 ? 0xffff : (1u << count) - 1);
    _mm256_mask_storeu_epi16(p, mask, _mm512_cvtepi32_epi16(ag_round_lanes16(v)));
}

/* ---- the tiles: TM input rows by AG_TILE_N weight rows, a dot product per sum ---- */
#define AG_TILE_STEP AG_LINE_ELEMS /* weight elements per load: one 64-byte vector */
#define AG_TILE_N 6     /* weight rows per tile: 4 x 6 sums, 6 weight vectors and one row's in registers */
#define AG_TILE_WEIGHTS_FIRST 1 /* loop order: the tile's weight vectors, then each input row once against them */
typedef ag_elem_t ag_xrow_t; /* an input row as the tiles read it: the row, zero to ag_xrow_stride */
typedef __m512 ag_tile_acc;

/* elements between input rows as the tiles read them: whole steps plus 64 bytes (rows 4 KiB
 * apart would share L1 sets) */
AG_INLINE long ag_xrow_stride(long k) { return (k + AG_TILE_STEP - 1) / AG_TILE_STEP * AG_TILE_STEP + AG_TILE_STEP; }
static inline void ag_xrow_put(const ag_elem_t *x, long k, ag_xrow_t *dst, long ldx) {
    memcpy(dst, x, (size_t)k * sizeof(ag_elem_t));
    memset(dst + k, 0, (size_t)(ldx - k) * sizeof(ag_elem_t));
}
AG_INLINE ag_tile_acc ag_tile_zero(void) { return _mm512_setzero_ps(); }
AG_INLINE ag_tile_acc ag_tile_add(ag_tile_acc a, ag_tile_acc b) { return _mm512_add_ps(a, b); }

#if AG_F32
/* ---- float32 (AG_F32): the tiles' and the wide form's units over float32, in float32 FMAs ---- */
typedef __m512 ag_tile_w;

AG_INLINE ag_tile_w ag_tile_load(const float *w) { return _mm512_loadu_ps(w); }
AG_INLINE ag_tile_w ag_tile_load_part(const float *w, long count) {
    return _mm512_maskz_loadu_ps((__mmask16)((1u << count) - 1), w);
}
AG_INLINE ag_tile_acc ag_tile_dot(ag_tile_acc acc, ag_tile_w w, const ag_xrow_t *x) {
    return _mm512_fmadd_ps(w, _mm512_loadu_ps(x), acc);
}
AG_INLINE void ag_tile_store(float *out, const ag_tile_acc *sums, const int n) {
    for (int b = 0; b < n; b++) out[b] = _mm512_reduce_add_ps(sums[b]);
}

#define AG_LANES 16         /* input rows per vector */
#define AG_WIDE_ROWS 64     /* input rows per chunk: 4 vectors */
#define AG_WIDE_NW 8        /* weight rows per tile */
#define AG_WIDE_SUMS 24     /* sums in registers at most */
#define AG_WIDE_MIN 9       /* up to 8 rows the tiles (docs/cpu-kernels.md) */
#define AG_STREAM_ROWS 3    /* up to 3 rows one weight row at a time (matmul_tiles.c) */
#define AG_WIDE_WHOLE 0
#define AG_PAIRS_FORM 0
#define AG_LANES_DWORDS 32  /* dwords of one packed vector: 16 rows' odd elements, then their even ones */
typedef __m512 ag_lanes_acc;
typedef struct { __m512 odd, even; } ag_lanes_x;
typedef ag_lanes_x ag_lanes_w; /* a weight pair, each element broadcast */

AG_INLINE ag_lanes_acc ag_lanes_zero(void) { return _mm512_setzero_ps(); }
AG_INLINE ag_lanes_x ag_lanes_load(const uint32_t *xq) {
    return (ag_lanes_x){_mm512_load_ps((const float *)xq), _mm512_load_ps((const float *)xq + 16)};
}
AG_INLINE ag_lanes_w ag_lanes_wpair(const float *w) { return (ag_lanes_w){_mm512_set1_ps(w[1]), _mm512_set1_ps(w[0])}; }
AG_INLINE ag_lanes_w ag_lanes_wlast(float w) { return (ag_lanes_w){_mm512_setzero_ps(), _mm512_set1_ps(w)}; }
AG_INLINE ag_lanes_acc ag_lanes_dot(ag_lanes_acc acc, ag_lanes_w w, ag_lanes_x x) {
    return _mm512_fmadd_ps(w.even, x.even, _mm512_fmadd_ps(w.odd, x.odd, acc));
}
AG_INLINE void ag_lanes_pack(uint32_t *vec, int lane, float x0, float x1) {
    memcpy(vec + lane, &x1, 4);
    memcpy(vec + 16 + lane, &x0, 4);
}
/* the AG_LANES sums as they are, one per dword at dst (64-byte aligned) */
AG_INLINE void ag_lanes_round(uint32_t *dst, ag_lanes_acc acc) { _mm512_store_ps((float *)dst, acc); }
#else
/* ---- bfloat16: the tiles' units in vdpbf16ps ---- */
typedef __m512bh ag_tile_w;

AG_INLINE ag_tile_w ag_tile_load(const uint16_t *w) { return (__m512bh)_mm512_loadu_si512(w); }
AG_INLINE ag_tile_w ag_tile_load_part(const uint16_t *w, long count) {
    return (__m512bh)ag_bf16x32_load_part(w, count);
}
/* acc += AG_TILE_STEP weight elements w times the same span of an input row x */
AG_INLINE ag_tile_acc ag_tile_dot(ag_tile_acc acc, ag_tile_w w, const ag_xrow_t *x) {
    return _mm512_dpbf16_ps(acc, w, (__m512bh)_mm512_loadu_si512(x));
}
/* out[b] = the sum of sums[b]'s lanes, rounded to bf16, for b < n */
AG_INLINE void ag_tile_store(uint16_t *out, const ag_tile_acc *sums, const int n) {
    for (int b = 0; b < n; b++) out[b] = ag_to_bf16(_mm512_reduce_add_ps(sums[b]));
}

/* ---- the wide form: each sum in its own lane, AG_LANES input rows by one pair per vector ---- */
#define AG_LANES 16         /* input rows per vector */
#define AG_WIDE_ROWS 64     /* input rows per chunk: 4 vectors */
#define AG_WIDE_NW 8        /* weight rows per tile (more rows 4 KiB apart share L1 sets) */
#define AG_WIDE_SUMS 24     /* sums in registers at most: 6 weight rows where a chunk takes 4 vectors */
#define AG_WIDE_MIN 5       /* rows of one weight from which the wide forms take them all */
#define AG_STREAM_ROWS 4    /* up to 4 rows one weight row at a time (matmul_tiles.c) */
#define AG_WIDE_WHOLE 0     /* the last chunk may be part full */
#define AG_PAIRS_FORM 1     /* up to 8 rows: the pairs form (matmul_wide.c) */
#define AG_LANES_DWORDS 16  /* dwords of one packed vector (one pair per input row) */
typedef __m512 ag_lanes_acc;
typedef __m512bh ag_lanes_x;
typedef __m512bh ag_lanes_w;

AG_INLINE ag_lanes_acc ag_lanes_zero(void) { return _mm512_setzero_ps(); }
AG_INLINE ag_lanes_x ag_lanes_load(const uint32_t *xq) { return (__m512bh)_mm512_loadu_si512(xq); }
/* the weight pair (w[0], w[1]) broadcast; ag_lanes_wlast: the pair (w, 0) */
AG_INLINE ag_lanes_w ag_lanes_wpair(const ag_elem_t *w) {
    int32_t pair;
    memcpy(&pair, w, 4);
    return (__m512bh)_mm512_set1_epi32(pair);
}
AG_INLINE ag_lanes_w ag_lanes_wlast(ag_elem_t w) { return (__m512bh)_mm512_set1_epi32((int32_t)w); }
AG_INLINE ag_lanes_acc ag_lanes_dot(ag_lanes_acc acc, ag_lanes_w w, ag_lanes_x x) {
    return _mm512_dpbf16_ps(acc, w, x);
}
/* a packed vector's lane for input row `lane`: the pair (x0, x1) = (x[2p], x[2p + 1]) as one dword */
AG_INLINE void ag_lanes_pack(uint32_t *vec, int lane, ag_elem_t x0, ag_elem_t x1) {
    vec[lane] = x0 | (uint32_t)x1 << 16;
}
/* the AG_LANES sums rounded to bf16, each in the low half of its dword at dst (64-byte aligned) */
AG_INLINE void ag_lanes_round(uint32_t *dst, ag_lanes_acc acc) { _mm512_store_si512(dst, ag_round_lanes16(acc)); }
#endif
