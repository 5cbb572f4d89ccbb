/* isa_avx2.h — the AVX2 + FMA + F16C vector helpers (8 lanes), compiled with target attributes (TGT2),
 * so the tree builds with any x86-64 compiler flags; the items that use them are in decode_paged.h.
 *
 * Contents, in order:
 *   TGT2                       the target attribute of every AVX2 function
 *   exp256n, exp256, load8,    the width-generic helpers (vec_generic.h) at 8 lanes
 *   acc8
 *   load_reg                   8 floats kept in a register (not folded into each FMA as a load)
 *   load_pairs                 8 bf16 pairs loaded once
 *   bf16_lo, bf16_hi           bf16 pairs in 32-bit lanes → the even and odd elements as fp32
 */
#ifndef CPU_DECODE_ISA_AVX2_H
#define CPU_DECODE_ISA_AVX2_H
#ifdef CPU_DECODE_X86

#define TGT2 __attribute__((target("avx2,fma,f16c")))

#define VTGT TGT2
#define VF __m256
#define VI __m256i
#define V(op) _mm256_##op
#define V_CASTPS_SI _mm256_castps_si256
#define V_CASTSI_PS _mm256_castsi256_ps
#define VH_LOAD(ptr) _mm_loadu_si128((const __m128i *)(ptr))
#define VEXP_MAX 4
#define VNAME_EXPN exp256n
#define VNAME_EXP exp256
#define VNAME_LOAD load8
#define VNAME_ACC acc8
#include "vec_generic.h" /* which #undefs its parameters at its end */

/* 8 floats from p kept in a register: compilers otherwise fold the load into every FMA that uses it
 * (a load each), and at two loads a cycle the loads rather than the FMAs would set the pace */
TGT2 INLINE __m256 load_reg(const float *p) {
    __m256 x = _mm256_load_ps(p);
    __asm__("" : "+x"(x));
    return x;
}

/* 8 bf16 pairs loaded once (not again as the and's memory operand) */
TGT2 INLINE __m256i load_pairs(const uint16_t *p) {
    __m256i x = _mm256_loadu_si256((const __m256i *)p);
    __asm__("" : "+x"(x));
    return x;
}

/* bf16 pairs in 32-bit lanes → the low (even) and high (odd) elements as fp32 */
TGT2 INLINE __m256 bf16_lo(__m256i x) { return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)); }
TGT2 INLINE __m256 bf16_hi(__m256i x) {
    return _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32((int)0xffff0000u)));
}

#endif
#endif
