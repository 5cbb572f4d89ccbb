/* isa_avx512.h — the AVX-512 vector helpers (16 lanes), compiled with target attributes, so the tree
 * builds with any x86-64 compiler flags; the items that use them are in decode_paged.h, decode_fp8.h,
 * decode_latent.h and writers.h.
 *
 * Contents, in order:
 *   TGT, TGT_BF16, TGT_FP8     the target attributes: AVX-512 F/BW/DQ/VL, + BF16, + BF16 and VBMI
 *   exp512n, exp512, load16,   the width-generic helpers (vec_generic.h) at 16 lanes
 *   acc16
 *   prefetch_tile              a run of bytes into L2, a line at a time
 *   tile_mask                  the lanes of a 16-key tile's first n keys
 *   dp_bcast                   vdpbf16ps with the pair at b broadcast from memory ({1to16})
 *   transpose16                16 × 16 dwords transposed in place (the latent items' P)
 *   fp8x64                     64 fp8 bytes → two rows of 32 bf16: CV_LOOKUP (exact) or CV_SHIFT (scaled),
 *                              with the shift conversion's FP8_PRE and FP8_POST
 */
#ifndef CPU_DECODE_ISA_AVX512_H
#define CPU_DECODE_ISA_AVX512_H
#ifdef CPU_DECODE_AVX512

#define TGT __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))
#define TGT_BF16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))
#define TGT_FP8 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx512vbmi")))

#define VTGT TGT
#define VF __m512
#define VI __m512i
#define V(op) _mm512_##op
#define V_CASTPS_SI _mm512_castps_si512
#define V_CASTSI_PS _mm512_castsi512_ps
#define VH_LOAD(ptr) _mm256_loadu_si256((const __m256i *)(ptr))
#define VEXP_MAX 6
#define VNAME_EXPN exp512n
#define VNAME_EXP exp512
#define VNAME_LOAD load16
#define VNAME_ACC acc16
#include "vec_generic.h" /* which #undefs its parameters at its end */

TGT INLINE void prefetch_tile(const char *p, size_t bytes) {
    for (size_t i = 0; i < bytes; i += 64) _mm_prefetch(p + i, _MM_HINT_T2);
}

static inline __mmask16 tile_mask(int n) { return (__mmask16)(n >= TILE ? 0xffffu : n <= 0 ? 0u : ((1u << n) - 1u)); }
/* acc += dot of bf16 pairs of x with the pair at b broadcast to every lane; the broadcast is the
 * instruction's embedded {1to16} memory operand (a load, no shuffle), which compilers do not form
 * from _mm512_set1_epi32 here */
TGT_BF16 INLINE __m512 dp_bcast(__m512 acc, __m512i x, const uint32_t *b) {
    __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(x), "m"(*b));
    return acc;
}

/* 16 × 16 dwords transposed in place: four block-swap stages (distance 8, 4, 2, 1) of vpermt2d */
TGT INLINE void transpose16(__m512i *r) {
    for (int s = 8; s >= 1; s >>= 1) {
        int lo[16], hi[16];
        for (int e = 0; e < 16; e++) {
            lo[e] = (e & s) ? 16 + e - s : e;
            hi[e] = (e & s) ? 16 + e : e + s;
        }
        const __m512i il = _mm512_loadu_si512(lo), ih = _mm512_loadu_si512(hi);
        for (int k = 0; k < 16; k++) {
            if (k & s) continue;
            __m512i a = r[k], b = r[k + s];
            r[k] = _mm512_permutex2var_epi32(a, il, b);
            r[k + s] = _mm512_permutex2var_epi32(a, ih, b);
        }
    }
}

/* The two conversions of 64 fp8 bytes (fp8_phys order) into two rows of 32 bf16 (cv):
 * CV_LOOKUP — exact: two byte lookups (vpermt2b) give each value's low and high bf16 byte, the sign is
 *   or-ed into the high one, and a shift and a ternary-logic blend per row put each row's two bytes
 *   into its 16-bit lanes (7 instructions). Every e4m3 value, subnormals included, is a normal bf16.
 * CV_SHIFT — scaled: an arithmetic shift of each 16-bit lane by 4 (after one by 8 for row 0) and a mask
 *   put the sign at bit 15 and the 4 exponent and 3 mantissa bits under the bf16 ones (5 instructions):
 *   the bf16 value is the e4m3 value × 2^-120, exactly for the normal values; the subnormal ones
 *   (|x| < 2^-6, below 1/28,672 of the largest value a token-head's scale allows) become bf16
 *   denormals, which vdpbf16ps reads as zero. The caller multiplies q and the weights p by
 *   FP8_PRE = 2^64 (exact: powers of two; bf16 holds them below 2^127, so |q| and p · v_scale below
 *   2^63) and the scores and p·v by FP8_POST = 2^56.
 * tab: FP8_LO, FP8_HI (CV_LOOKUP only). (CV_LOOKUP, CV_SHIFT: common.h, the attend args' fp8_convert) */
#define FP8_PRE 0x1p64f
#define FP8_POST 0x1p56f
TGT_FP8 INLINE void fp8x64(const uint8_t *p, const __m512i *tab, __m512i *r0, __m512i *r1, int cv) {
    const __m512i x = _mm512_loadu_si512((const void *)p);
    if (cv == CV_SHIFT) {
        const __m512i m = _mm512_set1_epi16((short)0x87F0);
        *r0 = _mm512_and_si512(_mm512_srai_epi16(_mm512_slli_epi16(x, 8), 4), m);
        *r1 = _mm512_and_si512(_mm512_srai_epi16(x, 4), m);
        return;
    }
    __m512i lo = _mm512_permutex2var_epi8(tab[0], x, tab[1]);
    __m512i hi = _mm512_permutex2var_epi8(tab[2], x, tab[3]);
    hi = _mm512_ternarylogic_epi32(hi, x, _mm512_set1_epi8((char)0x80), 0xF8); /* hi | (x & 0x80) */
    const __m512i low = _mm512_set1_epi16(0x00FF);
    *r0 = _mm512_ternarylogic_epi32(low, lo, _mm512_slli_epi16(hi, 8), 0xCA); /* low ? lo : hi << 8 */
    *r1 = _mm512_ternarylogic_epi32(low, _mm512_srli_epi16(lo, 8), hi, 0xCA); /* low ? lo >> 8 : hi */
}
#endif
#endif
