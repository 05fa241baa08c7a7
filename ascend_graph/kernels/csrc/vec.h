/* The vector layer the kernels are written against: vec_avx512.h (AVX512-BF16) or vec_avx2.h
 * (AVX2 and FMA) defines the same types, constants and inline functions for the instruction set
 * this translation unit is compiled for; AG_VEC_BITS says which (512, 256, or 0: no kernel).
 * Design, forms and measurements: docs/cpu-kernels.md. */
#ifndef AG_VEC_H
#define AG_VEC_H

#include <stdint.h>
#include <string.h>

#define AG_INLINE static inline __attribute__((always_inline))
#define AG_HIDDEN __attribute__((visibility("hidden"))) /* shared between the sources, not exported */
#define AG_EXPORT __attribute__((visibility("default")))

/* f rounded to bfloat16, to nearest even; any NaN becomes the quiet NaN 0x7fc0 */
static inline uint16_t ag_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#if (defined(__x86_64__) || defined(__i386__)) && defined(__AVX512BF16__)
#define AG_VEC_BITS 512
#include <immintrin.h>
#include "vec_avx512.h"
#elif (defined(__x86_64__) || defined(__i386__)) && defined(__AVX2__) && defined(__FMA__)
#define AG_VEC_BITS 256
#include <immintrin.h>
#include "vec_avx2.h"
#else
#define AG_VEC_BITS 0
#endif

#if AG_VEC_BITS
/* Prefetch the 64-byte line at p into L2 (never faults) */
AG_INLINE void ag_prefetch_l2(const void *p) { _mm_prefetch((const char *)p, _MM_HINT_T2); }
#endif

#endif
