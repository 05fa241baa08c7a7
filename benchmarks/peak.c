/* One core's peak multiply-add rate: 12 independent accumulator chains of one vector
 * instruction, nothing loaded or stored. Built and called by benchmarks/peak.py. */
#include <immintrin.h>

#define CHAINS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define KEEP(v) __asm__ volatile("" : "+v"(v)) /* distinct, opaque starts: no chain can be merged */

/* FLOPs done by n rounds of float32 fused multiply-adds (0 where the ISA has none). */
double fma_f32(long n) {
#if defined(__AVX512F__)
#define INIT(i) __m512 a##i = _mm512_set1_ps((float)(i)); KEEP(a##i);
#define STEP(i) a##i = _mm512_fmadd_ps(a##i, x, y);
#define SINK(i) KEEP(a##i);
    __m512 x = _mm512_set1_ps(0.999f), y = _mm512_set1_ps(0.001f);
    CHAINS(INIT)
    for (long r = 0; r < n; r++) { CHAINS(STEP) }
    CHAINS(SINK)
    return (double)n * 12 * 16 * 2;
#undef INIT
#undef STEP
#undef SINK
#elif defined(__AVX2__) && defined(__FMA__)
#define INIT(i) __m256 a##i = _mm256_set1_ps((float)(i)); KEEP(a##i);
#define STEP(i) a##i = _mm256_fmadd_ps(a##i, x, y);
#define SINK(i) KEEP(a##i);
    __m256 x = _mm256_set1_ps(0.999f), y = _mm256_set1_ps(0.001f);
    CHAINS(INIT)
    for (long r = 0; r < n; r++) { CHAINS(STEP) }
    CHAINS(SINK)
    return (double)n * 12 * 8 * 2;
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
