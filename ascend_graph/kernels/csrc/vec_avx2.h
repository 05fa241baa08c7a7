/* The vector layer for AVX2 and FMA (included by vec.h): the names vec_avx512.h defines, on
 * 256-bit vectors. There is no bf16 instruction: a bf16 is widened to float32 exactly (shifted
 * into, or masked to, the upper half of a dword) and multiplied and added in float32 FMAs. The
 * 16-lane types are pairs of 256-bit vectors; the tiles and the wide form use their own units,
 * sized for 16 vector registers. */

/* ---- 16 float32 sums, 32 bfloat16 (16 pairs): the [K, N] form's units ---- */
typedef struct { __m256 a, b; } ag_f32x16;
typedef struct { __m256i a, b; } ag_bf16x32;

#define AG_HIGH16 _mm256_set1_epi32((int32_t)0xffff0000u)
AG_INLINE ag_f32x16 ag_f32x16_zero(void) { return (ag_f32x16){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
AG_INLINE ag_f32x16 ag_f32x16_load(const float *p) { return (ag_f32x16){_mm256_load_ps(p), _mm256_load_ps(p + 8)}; }
AG_INLINE void ag_f32x16_store(float *p, ag_f32x16 v) { _mm256_store_ps(p, v.a), _mm256_store_ps(p + 8, v.b); }
AG_INLINE ag_bf16x32 ag_bf16x32_zero(void) { return (ag_bf16x32){_mm256_setzero_si256(), _mm256_setzero_si256()}; }
AG_INLINE ag_bf16x32 ag_bf16x32_load(const void *p) {
    return (ag_bf16x32){((const __m256i *)p)[0], ((const __m256i *)p)[1]};
}
AG_INLINE ag_bf16x32 ag_bf16x32_loadu(const void *p) {
    return (ag_bf16x32){_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)p + 1)};
}
/* the first count (0..32) bfloat16 at p, the rest zero; nothing past them is read */
AG_INLINE ag_bf16x32 ag_bf16x32_load_part(const uint16_t *p, long count) {
    if (count >= 32) return ag_bf16x32_loadu(p);
    uint16_t v[32] = {0};
    memcpy(v, p, (size_t)count * 2);
    return ag_bf16x32_loadu(v);
}
AG_INLINE ag_bf16x32 ag_bf16x32_set_pair(int32_t pair) {
    __m256i v = _mm256_set1_epi32(pair);
    return (ag_bf16x32){v, v};
}

/* 8 lanes of the pair dot product, as vdpbf16ps specifies it, in its order: the odd (upper) bf16
 * of each pair multiplied and added to the sum, then the even one, each a float32 FMA (a bf16
 * times a bf16 is exact in float32); denormals are kept, not flushed */
AG_INLINE __m256 ag_dot_pairs8(__m256 acc, __m256i a, __m256i b) {
    acc = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(a, AG_HIGH16)),
                          _mm256_castsi256_ps(_mm256_and_si256(b, AG_HIGH16)), acc);
    return _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)),
                           _mm256_castsi256_ps(_mm256_slli_epi32(b, 16)), acc);
}
/* acc[j] += a[2j] * b[2j] + a[2j + 1] * b[2j + 1] (bf16 pairs, float32 sums) */
AG_INLINE ag_f32x16 ag_dot_pairs(ag_f32x16 acc, ag_bf16x32 a, ag_bf16x32 b) {
    return (ag_f32x16){ag_dot_pairs8(acc.a, a.a, b.a), ag_dot_pairs8(acc.b, a.b, b.b)};
}

/* r0 and r1 (32 bf16 each) interleaved into pairs: *lo = (r0[j], r1[j]) for j < 16, *hi = the
 * same for j = 16..31 */
AG_INLINE void ag_interleave_pairs(ag_bf16x32 r0, ag_bf16x32 r1, ag_bf16x32 *lo, ag_bf16x32 *hi) {
    __m256i l0 = _mm256_unpacklo_epi16(r0.a, r1.a), h0 = _mm256_unpackhi_epi16(r0.a, r1.a); /* per 128-bit lane */
    __m256i l1 = _mm256_unpacklo_epi16(r0.b, r1.b), h1 = _mm256_unpackhi_epi16(r0.b, r1.b);
    *lo = (ag_bf16x32){_mm256_permute2x128_si256(l0, h0, 0x20), _mm256_permute2x128_si256(l0, h0, 0x31)};
    *hi = (ag_bf16x32){_mm256_permute2x128_si256(l1, h1, 0x20), _mm256_permute2x128_si256(l1, h1, 0x31)};
}

/* 8 float32 rounded as ag_to_bf16 rounds each, each in the low half of its lane */
AG_INLINE __m256i ag_round_lanes8(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

/* 4 float32 rounded as ag_to_bf16 rounds each, as 4 bf16 in the low 64 bits */
AG_INLINE __m128i ag_round4(__m128 v) {
    __m128i u = _mm_castps_si128(v);
    __m128i odd = _mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(1));
    __m128i r = _mm_srli_epi32(_mm_add_epi32(u, _mm_add_epi32(odd, _mm_set1_epi32(0x7fff))), 16);
    r = _mm_blendv_epi8(r, _mm_set1_epi32(0x7fc0), _mm_castps_si128(_mm_cmpunord_ps(v, v))); /* NaN */
    return _mm_packus_epi32(r, r);
}

/* the first count (at most 16; none where count <= 0) lanes of v rounded to bf16, stored at p */
AG_INLINE void ag_store_bf16x16(uint16_t *p, ag_f32x16 v, long count) {
    if (count <= 0) return;
    /* packus interleaves 128-bit lanes; the permute puts them back in order */
    __m256i h = _mm256_permute4x64_epi64(_mm256_packus_epi32(ag_round_lanes8(v.a), ag_round_lanes8(v.b)), 0xd8);
    if (count >= 16) {
        _mm256_storeu_si256((__m256i *)p, h);
        return;
    }
    uint16_t w[16];
    _mm256_storeu_si256((__m256i *)w, h);
    memcpy(p, w, (size_t)count * 2);
}

/* ---- the tiles: TM input rows by AG_TILE_N weight rows, a dot product per sum ---- */
#define AG_TILE_STEP 16 /* weight elements per load: their odd ones, then their even ones, widened */
#define AG_TILE_N 3     /* weight rows per tile: 4 x 3 sums of 8 lanes in 12 of the 16 registers */
#define AG_TILE_WEIGHTS_FIRST 0 /* loop order: one widened weight vector at a time against the input rows */
/* an input row as the tiles read it, as float32, zero to ag_xrow_stride: bf16, per 16 elements (a
 * weight load's span) the odd ones, then the even ones; float32 (AG_F32), the row as it is */
typedef float ag_xrow_t;
typedef __m256 ag_tile_acc;
typedef struct { __m256 odd, even; } ag_tile_w;

/* elements between input rows as the tiles read them: whole steps plus 64 bytes (rows 4 KiB
 * apart would share L1 sets) */
AG_INLINE long ag_xrow_stride(long k) { return (k + 15) / 16 * 16 + 16; }
static inline void ag_xrow_put(const ag_elem_t *x, long k, ag_xrow_t *dst, long ldx) {
    memset(dst, 0, (size_t)ldx * sizeof(float));
#if AG_F32
    memcpy(dst, x, (size_t)k * 4);
#else
    for (long e = 0; e < k; e++) {
        uint32_t u = (uint32_t)x[e] << 16;
        memcpy(dst + e / 16 * 16 + (e & 1 ? 0 : 8) + e % 16 / 2, &u, 4);
    }
#endif
}
AG_INLINE ag_tile_acc ag_tile_zero(void) { return _mm256_setzero_ps(); }
AG_INLINE ag_tile_acc ag_tile_add(ag_tile_acc a, ag_tile_acc b) { return _mm256_add_ps(a, b); }
AG_INLINE ag_tile_w ag_tile_widen(__m256i v) {
    return (ag_tile_w){_mm256_castsi256_ps(_mm256_and_si256(v, AG_HIGH16)),
                       _mm256_castsi256_ps(_mm256_slli_epi32(v, 16))};
}
#if AG_F32 /* 16 float32 elements as they are: the first 8, then the next 8 (as the input row holds them) */
AG_INLINE ag_tile_w ag_tile_load(const float *w) { return (ag_tile_w){_mm256_loadu_ps(w), _mm256_loadu_ps(w + 8)}; }
#else
AG_INLINE ag_tile_w ag_tile_load(const uint16_t *w) { return ag_tile_widen(_mm256_loadu_si256((const __m256i *)w)); }
#endif
AG_INLINE ag_tile_w ag_tile_load_part(const ag_elem_t *w, long count) {
    ag_elem_t part[16] = {0};
    memcpy(part, w, (size_t)count * sizeof(ag_elem_t));
    return ag_tile_load(part);
}
/* acc += AG_TILE_STEP weight elements w times the same span of an input row x */
AG_INLINE ag_tile_acc ag_tile_dot(ag_tile_acc acc, ag_tile_w w, const ag_xrow_t *x) {
    acc = _mm256_fmadd_ps(w.odd, _mm256_load_ps(x), acc);
    return _mm256_fmadd_ps(w.even, _mm256_load_ps(x + 8), acc);
}
/* the sums of the 8 lanes of a, b, c and d, in that order: three horizontal adds and one of the
 * halves (the reductions count where rows are short: docs/cpu-kernels.md) */
AG_INLINE __m128 ag_hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}
/* out[b] = the sum of sums[b]'s lanes (bf16: rounded), for b < n: 4 reduced, rounded and stored together */
AG_INLINE void ag_tile_store(ag_elem_t *out, const ag_tile_acc *sums, const int n) {
    const __m256 zero = _mm256_setzero_ps();
    for (int b = 0; b < n; b += 4) {
        ag_elem_t o[4];
        __m128 four = ag_hsum4(sums[b], b + 1 < n ? sums[b + 1] : zero, b + 2 < n ? sums[b + 2] : zero,
                               b + 3 < n ? sums[b + 3] : zero);
#if AG_F32
        _mm_storeu_ps(o, four);
#else
        _mm_storel_epi64((__m128i *)o, ag_round4(four));
#endif
        memcpy(out + b, o, (size_t)(n - b < 4 ? n - b : 4) * sizeof(ag_elem_t));
    }
}

/* ---- the wide form: each sum in its own lane, AG_LANES input rows by one pair per vector ---- */
#define AG_LANES 8          /* input rows per vector */
#define AG_WIDE_ROWS 16     /* input rows per chunk: 2 vectors */
#define AG_WIDE_NW 4        /* weight rows per tile: 8 sums, 4 input vectors, a weight pair's 2 */
#define AG_WIDE_SUMS 8
#define AG_WIDE_MIN 16      /* whole chunks only; part chunks take the tiles (docs/cpu-kernels.md) */
#if AG_F32
#define AG_STREAM_ROWS 2    /* up to 2 rows one weight row at a time (matmul_tiles.c) */
#else
#define AG_STREAM_ROWS 1    /* the bf16 dot product's widening is shared by a tile's weight rows from 2 rows */
#endif
#define AG_WIDE_WHOLE 1
#define AG_PAIRS_FORM 0
#define AG_LANES_DWORDS 16  /* dwords of one packed vector: 8 rows' odd elements, then their even ones, as float32 */
typedef __m256 ag_lanes_acc;
typedef struct { __m256 odd, even; } ag_lanes_x;
typedef ag_tile_w ag_lanes_w; /* a weight pair broadcast (and widened): its odd element, its even one */

AG_INLINE ag_lanes_acc ag_lanes_zero(void) { return _mm256_setzero_ps(); }
/* (the empty asm keeps each loaded vector in a register: GCC otherwise folds the load into each
 * of its AG_WIDE_NW FMAs, and the loads, not the FMAs, bound the loop) */
AG_INLINE ag_lanes_x ag_lanes_load(const uint32_t *xq) {
    __m256 odd = _mm256_load_ps((const float *)xq), even = _mm256_load_ps((const float *)xq + 8);
    __asm__("" : "+x"(odd), "+x"(even));
    return (ag_lanes_x){odd, even};
}
/* the weight pair (w[0], w[1]) broadcast; ag_lanes_wlast: the pair (w, 0) */
#if AG_F32
AG_INLINE ag_lanes_w ag_lanes_wpair(const float *w) { return (ag_lanes_w){_mm256_set1_ps(w[1]), _mm256_set1_ps(w[0])}; }
AG_INLINE ag_lanes_w ag_lanes_wlast(float w) { return (ag_lanes_w){_mm256_setzero_ps(), _mm256_set1_ps(w)}; }
#else
AG_INLINE ag_lanes_w ag_lanes_wpair(const uint16_t *w) {
    int32_t pair;
    memcpy(&pair, w, 4);
    return ag_tile_widen(_mm256_set1_epi32(pair));
}
AG_INLINE ag_lanes_w ag_lanes_wlast(uint16_t w) { return ag_tile_widen(_mm256_set1_epi32((int32_t)w)); }
#endif
AG_INLINE ag_lanes_acc ag_lanes_dot(ag_lanes_acc acc, ag_lanes_w w, ag_lanes_x x) {
    return _mm256_fmadd_ps(w.even, x.even, _mm256_fmadd_ps(w.odd, x.odd, acc));
}
/* a packed vector's lanes for input row `lane`: the pair (x0, x1) = (x[2p], x[2p + 1]) as float32,
 * x1 among the odd elements, x0 among the even ones */
AG_INLINE void ag_lanes_pack(uint32_t *vec, int lane, ag_elem_t x0, ag_elem_t x1) {
#if AG_F32
    memcpy(vec + lane, &x1, 4);
    memcpy(vec + 8 + lane, &x0, 4);
#else
    vec[lane] = (uint32_t)x1 << 16;
    vec[8 + lane] = (uint32_t)x0 << 16;
#endif
}
/* the AG_LANES sums (bf16: rounded, each in the low half of its dword) at dst (32-byte aligned) */
AG_INLINE void ag_lanes_round(uint32_t *dst, ag_lanes_acc acc) {
#if AG_F32
    _mm256_store_ps((float *)dst, acc);
#else
    _mm256_store_si256((__m256i *)dst, ag_round_lanes8(acc));
#endif
}
