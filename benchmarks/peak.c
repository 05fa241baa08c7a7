/* One core's peak multiply-add rate: 12 independent accumulator chains of one vector
 * instruction, nothing loaded or stored. Built and called by benchmarks/peak.py. */
#include <immintrin.h>

#define CHAINS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define KEEP(v) __asm__ volatile("" : "+v"(v)) /* distinct, opaque starts: no chain can be merged */

#if defined(__AVX512F__)
typedef __m512 vf;
#define SET1 _mm512_set1_ps
#define FMADD _mm512_fmadd_ps
#define LANES 16
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 vf;
#define SET1 _mm256_set1_ps
#define FMADD _mm256_fmadd_ps
#define LANES 8
#endif

/* FLOPs done by n rounds of float32 fused multiply-adds (0 where the ISA has none). */
double fma_f32(long n) {
#ifdef LANES
#define INIT(i) vf a##i = SET1((float)(i)); KEEP(a##i);
#define STEP(i) a##i = FMADD(a##i, x, y);
#define SINK(i) KEEP(a##i);
    vf x = SET1(0.999f), y = SET1(0.001f);
    CHAINS(INIT)
    for (long r = 0; r < n; r++) { CHAINS(STEP) }
    CHAINS(SINK)
    return (double)n * 12 * LANES * 2;
#undef INIT
#undef STEP
#undef SINK
#else
    (void)n;
    return 0.0;
#endif
}

/* FLOPs done by n rounds of bfloat16 pair dot products into float32 (vdpbf16ps), 0 without AVX512-BF16. */
double dot_bf16(long n) {
#if defined(__AVX512BF16__)
#define INIT(i) __m512 a##i = _mm512_set1_ps((float)(i)); KEEP(a##i);
#define STEP(i) a##i = _mm512_dpbf16_ps(a##i, x, y);
#define SINK(i) KEEP(a##i);
    __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80), y = (__m512bh)_mm512_set1_epi16(0x3a83);
    CHAINS(INIT)
    for (long r = 0; r < n; r++) { CHAINS(STEP) }
    CHAINS(SINK)
    return (double)n * 12 * 32 * 2;
#else
    (void)n;
    return 0.0;
#endif
}
