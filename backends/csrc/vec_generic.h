/* vec_generic.h — the vector helpers the AVX2 and the AVX-512 code share, written once for either width.
 *
 * Included twice, on purpose without an include guard: by isa_avx2.h with the 8-lane parameters and by
 * isa_avx512.h with the 16-lane ones. Each inclusion expands to exactly the intrinsic sequence the two
 * widths used to spell out by hand, so the instructions, their order and every result are unchanged.
 *
 * Contents, in order:
 *   VNAME_EXPN  e^x for x ≤ 0 of n ≤ VEXP_MAX vectors in place (exp256n: n ≤ 4; exp512n: n ≤ 6)
 *   VNAME_EXP   e^x of one vector (exp256, exp512)
 *   VNAME_LOAD  VLANES fp32 or fp16 elements from p + i as fp32 (load8, load16)
 *   VNAME_ACC   o[0 .. VLANES) = o · alpha + x, the accumulator update every p·v ends with (acc8, acc16)
 *
 * The parameters, which the including header defines and this file undefines at its end: VTGT (the target attribute),
 * VF and VI (the float and the integer vector), V(op) (the intrinsic op of that width, _mm256_op or
 * _mm512_op), V_CASTPS_SI and V_CASTSI_PS (the casts, whose names carry the width), VH_LOAD(ptr) (the
 * unaligned load of VLANES fp16 values, half a vector), VEXP_MAX, and the four names.
 */

/* e^x for x ≤ 0 of n ≤ VEXP_MAX vectors in place (Cephes' range reduction, degree-7 Taylor on
 * |r| ≤ ln2/2: < 1e-8 relative; x·log2(e) is rounded and 2^n formed with integer arithmetic on the
 * float bits, as adding 1.5·2^23 leaves the integer in the low mantissa bits). The steps of the n
 * evaluations are interleaved: each is a chain of dependent operations, and one chain after another
 * would leave the core waiting on each (in the bf16 softmax that waiting was half of a step's time) */
VTGT INLINE void VNAME_EXPN(int n, VF *x) {
    const VF magic = V(set1_ps)(12582912.0f);
    VF t[VEXP_MAX], r[VEXP_MAX], p[VEXP_MAX];
    for (int i = 0; i < n; i++) {
        x[i] = V(max_ps)(x[i], V(set1_ps)(-87.0f));
        t[i] = V(fmadd_ps)(x[i], V(set1_ps)(1.44269504088896341f), magic);
    }
    for (int i = 0; i < n; i++) r[i] = V(fnmadd_ps)(V(sub_ps)(t[i], magic), V(set1_ps)(0.693359375f), x[i]);
    for (int i = 0; i < n; i++) r[i] = V(fnmadd_ps)(V(sub_ps)(t[i], magic), V(set1_ps)(-2.12194440e-4f), r[i]);
    for (int i = 0; i < n; i++) p[i] = V(fmadd_ps)(V(set1_ps)(1.0f / 5040.0f), r[i], V(set1_ps)(1.0f / 720.0f));
    for (int i = 0; i < n; i++) p[i] = V(fmadd_ps)(p[i], r[i], V(set1_ps)(1.0f / 120.0f));
    for (int i = 0; i < n; i++) p[i] = V(fmadd_ps)(p[i], r[i], V(set1_ps)(1.0f / 24.0f));
    for (int i = 0; i < n; i++) p[i] = V(fmadd_ps)(p[i], r[i], V(set1_ps)(1.0f / 6.0f));
    for (int i = 0; i < n; i++) p[i] = V(fmadd_ps)(p[i], r[i], V(set1_ps)(0.5f));
    for (int i = 0; i < n; i++) p[i] = V(fmadd_ps)(p[i], r[i], V(set1_ps)(1.0f));
    for (int i = 0; i < n; i++) p[i] = V(fmadd_ps)(p[i], r[i], V(set1_ps)(1.0f));
    for (int i = 0; i < n; i++) {
        VI e = V(sub_epi32)(V_CASTPS_SI(t[i]), V_CASTPS_SI(magic));
        e = V(slli_epi32)(V(add_epi32)(e, V(set1_epi32)(127)), 23);
        x[i] = V(mul_ps)(p[i], V_CASTSI_PS(e));
    }
}

VTGT INLINE VF VNAME_EXP(VF x) {
    VNAME_EXPN(1, &x);
    return x;
}

/* VLANES fp32 or fp16 elements from p + i as fp32 (dt: DT_F32 or DT_F16; fp16 widened by vcvtph2ps) */
VTGT INLINE VF VNAME_LOAD(int dt, const void *p, size_t i) {
    if (dt == DT_F32) return V(loadu_ps)((const float *)p + i);
    return V(cvtph_ps)(VH_LOAD((const uint16_t *)p + i));
}

/* the accumulator update of a p·v: o = o · alpha + x (o unaligned) */
VTGT INLINE void VNAME_ACC(float *o, VF alpha, VF x) { V(storeu_ps)(o, V(fmadd_ps)(V(loadu_ps)(o), alpha, x)); }

/* the parameters end here, so the next width can define its own */
#undef VTGT
#undef VF
#undef VI
#undef V
#undef V_CASTPS_SI
#undef V_CASTSI_PS
#undef VH_LOAD
#undef VEXP_MAX
#undef VNAME_EXPN
#undef VNAME_EXP
#undef VNAME_LOAD
#undef VNAME_ACC
