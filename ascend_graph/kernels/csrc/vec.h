/* The vector layer the kernels are written against: vec_avx512.h (AVX512-BF16) or vec_avx2.h
 * (AVX2 and FMA) defines the same types, constants and inline functions for the instruction set
 * this translation unit is compiled for; AG_VEC_BITS says which (512, 256, or 0: no kernel).
 * The row-major forms' units (tiles, wide form) are typed by the element macro AG_F32: 0 for
 * bfloat16 weights and rows (uint16_t), 1 for float32 (matmul_f32.c compiles the same sources so).
 * Design, forms and measurements: docs/cpu-kernels.md. */
#ifndef AG_VEC_H
#define AG_VEC_H

#include <stdint.h>
#include <string.h>

#define AG_INLINE static inline __attribute__((always_inline))
#define AG_HIDDEN __attribute__((visibility("hidden"))) /* shared between the sources, not exported */
#define AG_EXPORT __attribute__((visibility("default")))

#ifndef AG_F32
#define AG_F32 0
#endif
#if AG_F32
typedef float ag_elem_t;            /* an element of the row-major forms' weights, input rows and outputs */
#define AG_TYPED(name) name##_f32   /* an entry point's name for this element type */
#else
typedef uint16_t ag_elem_t;
#define AG_TYPED(name) name
#endif
#define AG_LINE_ELEMS (64 / (long)sizeof(ag_elem_t)) /* elements per 64-byte cache line */

/* an output element from the low bits of the dword a lane's sum was stored in (ag_lanes_round) */
static inline ag_elem_t ag_from_lane(uint32_t d) {
    ag_elem_t e;
    memcpy(&e, &d, sizeof e);
    return e;
}

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
/* ... into L1 */
AG_INLINE void ag_prefetch_l1(const void *p) { _mm_prefetch((const char *)p, _MM_HINT_T0); }
#endif

#endif
