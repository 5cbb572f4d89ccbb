/* decode_paged.h — the paged form over an fp32, fp16 or bf16 cache (cpu_decode_attend): one work item
 * per (sequence, KV head, KV split) for each variant. The layout, the walk and the online softmax are
 * described at the top of cpu_decode.c; run_item there picks the item.
 *
 * Contents, in order:
 *   scalar_walk                ISA_SCALAR's item written once for every paged cache, fp8 included (a
 *                              reader per form): plain C, fp32 arithmetic, p kept in fp32
 *   paged_key, paged_value, item_scalar    its readers of fp32 / fp16 / bf16 tiles, and the item
 *   ISA_AVX2 (8 lanes, any dtype; p kept in fp32):
 *     qk_avx2                  the scores of one 16-key K tile for up to 4 heads
 *     softmax_avx2             the online-softmax update of a step (32 keys, masked past n)
 *     pv_avx2                  p·v of a step for up to 4 heads over 8 · NU dims
 *     step_avx2                one step of 1 or 2 tiles: q·k, softmax, p·v
 *     item_avx2_dt             the tile walk (two tiles a step where both lie in one page)
 *     item_avx2_bf16, item_avx2_f16, item_avx2_f32
 *   ISA_AVX512BF16 (bf16; vdpbf16ps, p rounded to bf16 for p·v):
 *     pv_bf16                  p·v over 16 · NU dims and NP key pairs
 *     tile_bf16                one step of 1 or 2 tiles: scores, the online softmax, p·v
 *     item_avx512bf16          the tile walk (two tiles a step where both lie in one page)
 *   ISA_AVX512 (fp32 and fp16; vfmadd231ps in fp32, fp16 widened on load):
 *     softmax_update           the online-softmax update of one tile's scores
 *     pv_f32                   p·v of one tile over 16 · NU dims
 *     tile_f32                 one 16-key tile: scores, softmax, p·v
 *     ITEM_LOOP                the tile walk, one tile at a time
 *     item_avx512
 */
#ifndef CPU_DECODE_DECODE_PAGED_H
#define CPU_DECODE_DECODE_PAGED_H

/* ---- ISA_SCALAR ---------------------------------------------------------------------------------- */
/* Key j's (or value j's) element d of the tile at base, as a float: one reader per cache form */
typedef float (*tile_elem_fn)(const item_t *it, size_t base, int j, int d);

/* The plain-C item of the paged forms, written once: per tile, the G heads' scores, the online-softmax
 * update and p·v in fp32 (p kept in fp32), one addition per tile into the accumulator. An fp8 cache's
 * per-token scales multiply the score (K) and the probability (V); elsewhere they are 1 (exact). */
static inline void scalar_walk(const item_t *it, tile_elem_fn key, tile_elem_fn value) {
    const int G = it->G, D = it->D;
    float s[TILE], ksc[TILE], vsc[TILE];
    float *tmp, *qv = scalar_start(it, &tmp);
    if (!qv) return;
    for (int t = it->t0; t < it->t1; t += TILE) {
        int n = it->t1 - t < TILE ? it->t1 - t : TILE;
        size_t base = tile_offset(it, t), so = it->ks ? scale_offset(it, t) : 0;
        for (int j = 0; j < n; j++) {
            ksc[j] = it->ks ? it->ks[so + j] : 1.0f;
            vsc[j] = it->vs ? it->vs[so + j] : 1.0f;
        }
        for (int g = 0; g < G; g++) {
            const float *qg = qv + (size_t)g * D;
            float mt = -INFINITY;
            for (int j = 0; j < n; j++) {
                float a = 0.0f;
                for (int d = 0; d < D; d++) a += qg[d] * key(it, base, j, d);
                s[j] = a * ksc[j] * it->scale;
                if (s[j] > mt) mt = s[j];
            }
            float mn = mt > it->m[g] ? mt : it->m[g];
            float alpha = expf(it->m[g] - mn), sum = 0.0f;
            float *acc = it->acc + (size_t)g * D;
            for (int d = 0; d < D; d++) tmp[d] = 0.0f;
            for (int j = 0; j < n; j++) {
                float p = expf(s[j] - mn), w = p * vsc[j];
                sum += p;
                for (int d = 0; d < D; d++) tmp[d] += w * value(it, base, j, d);
            }
            for (int d = 0; d < D; d++) acc[d] = acc[d] * alpha + tmp[d]; /* one addition per tile */
            it->l[g] = it->l[g] * alpha + sum;
            it->m[g] = mn;
        }
    }
    free(qv);
}

/* fp32 / fp16 / bf16 tiles: K [D / P, 16, P], V [16 / P, D, P] */
static inline float paged_key(const item_t *it, size_t base, int j, int d) {
    const int P = it->P;
    return load_elem(it->kc, base + ((size_t)(d / P) * TILE + j) * P + d % P, it->dt);
}

static inline float paged_value(const item_t *it, size_t base, int j, int d) {
    const int P = it->P;
    return load_elem(it->vc, base + ((size_t)(j / P) * it->D + d) * P + j % P, it->dt);
}

static void item_scalar(const item_t *it) { scalar_walk(it, paged_key, paged_value); }
#ifdef CPU_DECODE_X86
/* ---- ISA_AVX2: AVX2 + FMA + F16C, bf16, fp16 and fp32 caches ------------------------------------
 * The same layout, item walk, online softmax and merge as the AVX-512 code; 8-lane vectors, and no
 * bf16 dot product: a bf16 pair is widened by its position in a 32-bit lane (low half << 16, high
 * half & 0xffff0000), so one 32-byte load of a bf16 K row is 8 keys × 2 dims (two FMAs per head)
 * and one of a V row 8 dims × 2 keys. The probabilities stay in fp32 for p·v in every dtype (as in
 * the scalar code; no bf16 rounding of P). AVX2 has 16 registers and no embedded broadcast, so a
 * step's scores pass through a small buffer on the stack, and the operands an FMA broadcasts — q
 * (once per item) and p (once per step) — are stored broadcast to 8 lanes and read as plain loads. */
/* s[g · 32 + j] = scale · q_g · k_j for the 16 keys of the K tile kt and GN heads. qb: the heads'
 * queries in fp32, each element broadcast to 8 lanes ([GN, D, 8], written once per item): an FMA
 * then takes q as a plain load, where a broadcast in the loop would take a vector-unit slot too.
 * Each K row is loaded and widened once for all GN heads. Enough independent FMA chains at 16
 * registers: with 4 heads one accumulator per head and 8 keys, q loaded once for both halves of the
 * row; with fewer, two (even and odd dims); with 3, the two halves of a row one after the other (12
 * accumulators). pf: a future tile (its K and V) to prefetch into L2 over the loop, or NULL */
TGT2 INLINE void qk_avx2(int gn, int dt, int D, const float *qb, const void *kt, float scale, float *s,
                         const char *pf) {
    const int two = gn != 4;
    __m256 a[4][2][2];
    for (int g = 0; g < gn; g++)
        for (int h = 0; h < 2; h++) a[g][h][0] = a[g][h][1] = _mm256_setzero_ps();
    /* bf16 row r = dp: keys 0..15 × dims 2dp, 2dp + 1; fp32/fp16 rows r = d, d + 1: keys 0..15 of a
     * dim. Either way one step of r covers 2 dims, and 2 · 16 · 2 · esize bytes of the tile */
    const size_t pfb = dt == DT_F32 ? 256 : 128;
    for (int r = 0; r < D / 2; r++) {
        if (pf)
            for (size_t i = 0; i < pfb; i += 64) _mm_prefetch(pf + (size_t)r * pfb + i, _MM_HINT_T2);
        __m256 e[2], o[2]; /* keys 8h .. 8h + 7: dim 2r in e[h], dim 2r + 1 in o[h] */
#define KROW(h)                                                                                   \
    do {                                                                                          \
        if (dt == DT_BF16) {                                                                      \
            __m256i x = load_pairs((const uint16_t *)kt + (size_t)r * 32 + 16 * (h));                \
            e[h] = bf16_lo(x);                                                                    \
            o[h] = bf16_hi(x);                                                                    \
        } else {                                                                                  \
            e[h] = load8(dt, kt, (size_t)r * 32 + 8 * (h));                                       \
            o[h] = load8(dt, kt, (size_t)r * 32 + 16 + 8 * (h));                                  \
        }                                                                                         \
    } while (0)
        if (gn == 3) {
            for (int h = 0; h < 2; h++) {
                KROW(h);
                for (int g = 0; g < 3; g++) {
                    const float *qg = qb + ((size_t)g * D + 2 * r) * 8;
                    a[g][h][0] = _mm256_fmadd_ps(e[h], _mm256_load_ps(qg), a[g][h][0]);
                    a[g][h][1] = _mm256_fmadd_ps(o[h], _mm256_load_ps(qg + 8), a[g][h][1]);
                }
            }
        } else {
            KROW(0);
            KROW(1);
            for (int g = 0; g < gn; g++) {
                const float *qg = qb + ((size_t)g * D + 2 * r) * 8;
                __m256 qe = load_reg(qg), qo = load_reg(qg + 8);
                a[g][0][0] = _mm256_fmadd_ps(e[0], qe, a[g][0][0]);
                a[g][1][0] = _mm256_fmadd_ps(e[1], qe, a[g][1][0]);
                a[g][0][two] = _mm256_fmadd_ps(o[0], qo, a[g][0][two]);
                a[g][1][two] = _mm256_fmadd_ps(o[1], qo, a[g][1][two]);
            }
        }
#undef KROW
    }
    const __m256 sc = _mm256_set1_ps(scale);
    for (int g = 0; g < gn; g++)
        for (int h = 0; h < 2; h++) {
            __m256 x = two ? _mm256_add_ps(a[g][h][0], a[g][h][1]) : a[g][h][0];
            _mm256_storeu_ps(s + g * 32 + 8 * h, _mm256_mul_ps(x, sc));
        }
}

/* the online-softmax update of GN heads over the step's keys in s (32 a head, the first n real; a
 * 16-key step evaluates the other 16 too, masked, so that one copy of this serves both steps):
 * pb[(g · 32 + j) · 8 ..] = p_j = e^(s_j - m_new) broadcast to 8 lanes (0 past n; for p·v, as qb is
 * for q·k), m the new running max, lv (per head 8 lanes of the running sum, reduced once per item)
 * lv · alpha + Σ p, alpha = e^(m_old - m_new) (all heads' in one vector). Each operation runs over
 * all heads before the next and the exponentials are evaluated four chains at a time (exp512n's
 * reason); branch-free: m_old = -inf gives alpha = e^-87, which multiplies zeros */
TGT2 INLINE void softmax_avx2(int gn, float *s, int n, float *m, float *lv, float *alpha, float *pb) {
    const int nv = 4, ns = gn * nv;
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 valid[4], ex[4 * 4 + 1];
    float da[4] = {0.0f, 0.0f, 0.0f, 0.0f}; /* m_old - m_new of each head */
    for (int i = 0; i < nv; i++)
        valid[i] = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n - 8 * i), lane));
    for (int g = 0; g < gn; g++) {
        __m256 mx = ninf;
        for (int i = 0; i < nv; i++) {
            ex[g * nv + i] = _mm256_loadu_ps(s + g * 32 + 8 * i);
            mx = _mm256_max_ps(mx, _mm256_blendv_ps(ninf, ex[g * nv + i], valid[i]));
        }
        mx = _mm256_max_ps(mx, _mm256_permute2f128_ps(mx, mx, 1));
        mx = _mm256_max_ps(mx, _mm256_permute_ps(mx, 0x4e));
        mx = _mm256_max_ps(mx, _mm256_permute_ps(mx, 0xb1));
        __m256 mn = _mm256_max_ps(mx, _mm256_set1_ps(m[g]));
        float mnew = _mm256_cvtss_f32(mn);
        da[g] = m[g] - mnew;
        m[g] = mnew;
        for (int i = 0; i < nv; i++) ex[g * nv + i] = _mm256_sub_ps(ex[g * nv + i], mn);
    }
    ex[ns] = _mm256_setr_ps(da[0], da[1], da[2], da[3], 0.0f, 0.0f, 0.0f, 0.0f);
    for (int i = 0; i < ns; i += 4) exp256n(4, ex + i);
    exp256n(1, ex + ns);
    _mm256_storeu_ps(alpha, ex[ns]);
    for (int g = 0; g < gn; g++) {
        __m256 sum = _mm256_setzero_ps();
        for (int i = 0; i < nv; i++) {
            __m256 p = _mm256_and_ps(ex[g * nv + i], valid[i]);
            sum = _mm256_add_ps(sum, p);
            /* each lane broadcast with shuffles: a vector store and then 4-byte broadcast loads of it
             * would wait on the store (no store-to-load forwarding there), several times as slow */
            __m256 lo = _mm256_permute2f128_ps(p, p, 0x00), hi = _mm256_permute2f128_ps(p, p, 0x11);
            float *d = pb + (size_t)(g * 32 + 8 * i) * 8;
            _mm256_store_ps(d + 0, _mm256_permute_ps(lo, 0x00));
            _mm256_store_ps(d + 8, _mm256_permute_ps(lo, 0x55));
            _mm256_store_ps(d + 16, _mm256_permute_ps(lo, 0xaa));
            _mm256_store_ps(d + 24, _mm256_permute_ps(lo, 0xff));
            _mm256_store_ps(d + 32, _mm256_permute_ps(hi, 0x00));
            _mm256_store_ps(d + 40, _mm256_permute_ps(hi, 0x55));
            _mm256_store_ps(d + 48, _mm256_permute_ps(hi, 0xaa));
            _mm256_store_ps(d + 56, _mm256_permute_ps(hi, 0xff));
        }
        __m256 ag = _mm256_permutevar8x32_ps(ex[ns], _mm256_set1_epi32(g)); /* not alpha[g]: just stored */
        _mm256_storeu_ps(lv + 8 * g, _mm256_fmadd_ps(_mm256_loadu_ps(lv + 8 * g), ag, sum));
    }
}

/* p·v for GN heads over dims [c, c + 8 · NU) and the step's 16 · NT keys (NT at run time; pb:
 * softmax_avx2's; vt: the first tile's V, the second lies 2 · 16 · D elements on): acc = acc · alpha
 * + Σ_j p_j · v_j. As in qk_avx2: with 2 or 4 heads each key pair's V chunks are widened first and
 * each head's two p loaded once for all chunks; with 1 or 3, chunk after chunk (p a load per FMA).
 * TWO: even and odd keys in separate accumulators (more independent FMA chains where registers allow) */
TGT2 INLINE void pv_avx2(int gn, int nu, int two, int nt, int dt, int D, int c, const void *vt, const float *pb,
                         const float *alpha, float *acc) {
    __m256 a[4][4][2];
    for (int g = 0; g < gn; g++)
        for (int u = 0; u < nu; u++) a[g][u][0] = a[g][u][1] = _mm256_setzero_ps();
    for (int jp = 0; jp < nt * TILE / 2; jp++) { /* keys 2jp, 2jp + 1 */
        const float *p = pb + (size_t)jp * 16;
        __m256 ve[4], vo[4];
#define VROW(u)                                                                                   \
    do {                                                                                          \
        if (dt == DT_BF16) { /* row jp % 8 of tile jp / 8: the pair's dims side by side */        \
            const uint16_t *row = (const uint16_t *)vt + (size_t)(jp >> 3) * 2 * TILE * D + (size_t)(jp & 7) * 2 * D; \
            __m256i x = load_pairs(row + 2 * (c + 8 * (u)));                                      \
            ve[u] = bf16_lo(x);                                                                   \
            vo[u] = bf16_hi(x);                                                                   \
        } else { /* rows 2jp % 16 and 2jp % 16 + 1 of tile 2jp / 16 */                           \
            size_t row = (size_t)(jp >> 3) * 2 * TILE * D + (size_t)(2 * jp & 15) * D + c + 8 * (u); \
            ve[u] = load8(dt, vt, row);                                                           \
            vo[u] = load8(dt, vt, row + D);                                                       \
        }                                                                                         \
    } while (0)
        if (gn % 2 == 0) {
            for (int u = 0; u < nu; u++) VROW(u);
            for (int g = 0; g < gn; g++) {
                __m256 pe = load_reg(p + (size_t)g * 256), po = load_reg(p + (size_t)g * 256 + 8);
                for (int u = 0; u < nu; u++) {
                    a[g][u][0] = _mm256_fmadd_ps(ve[u], pe, a[g][u][0]);
                    a[g][u][two] = _mm256_fmadd_ps(vo[u], po, a[g][u][two]);
                }
            }
        } else {
            for (int u = 0; u < nu; u++) {
                VROW(u);
                for (int g = 0; g < gn; g++) {
                    a[g][u][0] = _mm256_fmadd_ps(ve[u], _mm256_load_ps(p + (size_t)g * 256), a[g][u][0]);
                    a[g][u][two] = _mm256_fmadd_ps(vo[u], _mm256_load_ps(p + (size_t)g * 256 + 8), a[g][u][two]);
                }
            }
        }
#undef VROW
    }
    /* the step's sum joins the running one once (see pv_f32) */
    for (int g = 0; g < gn; g++)
        for (int u = 0; u < nu; u++) {
            float *o = acc + (size_t)g * D + c + 8 * u;
            __m256 x = two ? _mm256_add_ps(a[g][u][0], a[g][u][1]) : a[g][u][0];
            acc8(o, _mm256_set1_ps(alpha[g]), x);
        }
}

/* one step of NT (1 or 2, at run time) adjacent tiles of one page for heads g0 .. g0 + GN: scores,
 * softmax, p·v. kt, vt: the first tile's K and V; n: the step's real keys; pf[t]: a future tile to
 * prefetch or NULL */
TGT2 INLINE void step_avx2(int gn, int nt, int dt, const item_t *it, int g0, const float *qb, const char *kt,
                           const char *vt, int n, const char *const *pf, float *lv) {
    /* p·v: NU 8-dim chunks at a time, TWO accumulators per chunk (8, 8, 12, 8 accumulators) */
    const int D = it->D, nu = gn == 1 ? 4 : 2, two = gn != 4;
    const size_t stride = (size_t)2 * TILE * D * (dt == DT_F32 ? 4 : 2); /* bytes from one tile to the next */
    float s[4 * 32] __attribute__((aligned(32))), alpha[8], pb[4 * 32 * 8] __attribute__((aligned(32)));
#pragma GCC unroll 1 /* one copy of the loop body: a shorter build */
    for (int t = 0; t < nt; t++)
        qk_avx2(gn, dt, D, qb + (size_t)g0 * D * 8, kt + t * stride, it->scale, s + 16 * t, pf[t]);
    if (nt == 1)
        for (int g = 0; g < gn; g++) memset(s + g * 32 + 16, 0, 16 * sizeof(float)); /* masked, but defined */
    softmax_avx2(gn, s, n, it->m + g0, lv + 8 * g0, alpha, pb);
    float *acc = it->acc + (size_t)g0 * D;
    int c = 0;
    for (; c + 8 * nu <= D; c += 8 * nu) pv_avx2(gn, nu, two, nt, dt, D, c, vt, pb, alpha, acc);
    if (nu == 4 && c < D) pv_avx2(gn, 2, two, nt, dt, D, c, vt, pb, alpha, acc); /* D % 16 == 0: 16 dims left */
}

/* the tile walk of one item (dt constant once inlined): two tiles (32 keys) a step where both lie in
 * one page, as the AVX-512 bf16 loop does, in every dtype */
TGT2 INLINE void item_avx2_dt(const item_t *it, int dt) {
    const int G = it->G, D = it->D, pf = it->prefetch;
    const size_t esize = dt == DT_F32 ? 4 : 2;
    const char *kc = (const char *)it->kc, *vc = (const char *)it->vc;
    float lv[MAX_G * 8] __attribute__((aligned(32)));
    float *qb = (float *)scratch(sizeof(float) * 8 * (size_t)G * D); /* [G, D, 8] */
    if (!qb) {
        flag_nomem(it->nomem);
        return;
    }
    for (int i = 0; i < G * D; i++)
        _mm256_store_ps(qb + (size_t)i * 8, _mm256_set1_ps(load_elem(it->q, (size_t)i, dt)));
    reset_rows(it->m, it->l, it->acc, G, D);
    memset(lv, 0, sizeof(float) * 8 * (size_t)G);
    for (int t = it->t0; t < it->t1;) {
        const int nt = it->ps >= 2 * TILE && t % (2 * TILE) == 0 && t + TILE < it->t1 ? 2 : 1;
        const int n = it->t1 - t < nt * TILE ? it->t1 - t : nt * TILE;
        const char *pk[2] = {NULL, NULL}, *none[2] = {NULL, NULL};
        for (int j = 0; j < nt; j++) {
            int f = t + (pf + j) * TILE;
            if (pf > 0 && f < it->t1) pk[j] = kc + tile_offset(it, f) * esize;
        }
        const size_t base = tile_offset(it, t) * esize;
        for (int g0 = 0; g0 < G; g0 += 4) {
            const char *const *p = g0 ? none : pk; /* the first head group prefetches */
#define AVX2_STEP(gn) step_avx2(gn, nt, dt, it, g0, qb, kc + base, vc + base, n, p, lv)
            HEADS_SWITCH(G - g0, AVX2_STEP)
#undef AVX2_STEP
        }
        t += nt * TILE;
    }
    for (int g = 0; g < G; g++) {
        float l = 0.0f;
        for (int i = 0; i < 8; i++) l += lv[8 * g + i];
        it->l[g] = l;
    }
    free(qb);
}

TGT2 static void item_avx2_bf16(const item_t *it) { item_avx2_dt(it, DT_BF16); }
TGT2 static void item_avx2_f16(const item_t *it) { item_avx2_dt(it, DT_F16); }
TGT2 static void item_avx2_f32(const item_t *it) { item_avx2_dt(it, DT_F32); }
#endif

#ifdef CPU_DECODE_AVX512
/* ---- ISA_AVX512BF16: bf16 caches, vdpbf16ps -------------------------------------------------------- */
/* p·v for GN heads over d in [c, c + 16·NU) and NP key pairs: acc[g] = acc[g]·alpha[g] + Σ v_pair · p_pair
 * (pr: per head, the step's 16 pairs of bf16 probabilities in one vector) */
TGT_BF16 INLINE void pv_bf16(int gn, int nu, int np, const uint16_t *vt, const __m512i *pr, const __m512 *alpha,
                             float *acc, int D, int c, const char *const *pfv, int ci) {
    __m512 a[4][4];
    for (int g = 0; g < gn; g++)
        for (int u = 0; u < nu; u++)
            a[g][u] = _mm512_setzero_ps();
    for (int jp = 0; jp < np; jp++) {
        /* four lines of the future V tiles per key pair: over the step's calls (ci) the whole tiles
         * (D / 2 lines each), spread over p·v as the K lines are over q·k */
        if (pfv) {
            int L = (ci * np + jp) * 4, lines = D / 2, t = L >= lines; /* np / 8 ≤ 2 tiles; D / 2 % 4 == 0 */
            if (L < np / 8 * lines && pfv[t]) {
                const char *p = pfv[t] + (size_t)(L - t * lines) * 64;
                for (int k = 0; k < 4; k++) _mm_prefetch(p + 64 * k, _MM_HINT_T2);
            }
        }
        __m512i b[4], idx = _mm512_set1_epi32(jp);
        for (int g = 0; g < gn; g++) b[g] = _mm512_permutexvar_epi32(idx, pr[g]);
        for (int u = 0; u < nu; u++) {
            /* key pair jp: tile jp / 8 (two tiles lie 2 · 16 · D elements apart: K, V, K, V) */
            const uint16_t *vp = vt + (size_t)(jp >> 3) * 2 * TILE * D + (size_t)(jp & 7) * 2 * D;
            __m512i v = _mm512_loadu_si512((const void *)(vp + 2 * (c + 16 * u)));
            for (int g = 0; g < gn; g++)
                a[g][u] = _mm512_dpbf16_ps(a[g][u], (__m512bh)v, (__m512bh)b[g]);
        }
    }
    for (int g = 0; g < gn; g++)
        for (int u = 0; u < nu; u++) {
            float *o = acc + (size_t)g * D + c + 16 * u;
            acc16(o, alpha[g], a[g][u]);
        }
}

/* NT (1 or 2) adjacent 16-key tiles of one page for GN heads: scores, online softmax, p·v.
 * valid[t]: the real keys of tile t; pk/pv: future tiles to prefetch (NULL: none) */
TGT_BF16 INLINE void tile_bf16(int gn, int nt, const item_t *it, int g0, const uint16_t *kt, const uint16_t *vt,
                               const __mmask16 *valid, const char *const *pk, const char *const *pv) {
    const int D = it->D, D2 = D / 2, npart = 4 / nt;
    const uint32_t *qp = (const uint32_t *)it->q + (size_t)g0 * D2;
    __m512 a[4][4];
    for (int g = 0; g < gn; g++)
        for (int u = 0; u < 4; u++) a[g][u] = _mm512_setzero_ps();
    for (int dp = 0; dp < D2; dp += npart) {
        for (int t = 0; t < nt; t++) {
            if (pk[t]) { /* 64·npart bytes of each future K tile per iteration: whole tiles per loop */
                for (int i = 0; i < 64 * npart; i += 64) {
                    _mm_prefetch(pk[t] + (size_t)dp * 64 + i, _MM_HINT_T2);

                }
            }
        }
        for (int u = 0; u < npart; u++) {
            for (int t = 0; t < nt; t++) {
                __m512i k = _mm512_loadu_si512((const void *)(kt + (size_t)t * 2 * TILE * D + (size_t)(dp + u) * 32));
                for (int g = 0; g < gn; g++)
                    a[g][t * npart + u] = dp_bcast(a[g][t * npart + u], k, qp + g * D2 + dp + u);
            }
        }
    }
    const __m512 scale = _mm512_set1_ps(it->scale), ninf = _mm512_set1_ps(-INFINITY);
    __m512 alpha[4];
    __m512i pr[4];
    /* the online-softmax step of the gn heads, each operation over all heads before the next: scores,
     * their max in every lane, the new running max (branch-free: m_old = -inf gives e^-87 · 0 = 0),
     * then e^(s - m_new) of every tile and alpha = e^(m_old - m_new) of every head, interleaved */
    __m512 ex[12], mx[4], mo[4], mn[4];
    const int ns = gn * nt;
    for (int g = 0; g < gn; g++) {
        mx[g] = ninf;
        for (int t = 0; t < nt; t++) {
            __m512 x = a[g][t * npart];
            for (int u = 1; u < npart; u++) x = _mm512_add_ps(x, a[g][t * npart + u]);
            ex[g * nt + t] = _mm512_mul_ps(x, scale);
            mx[g] = _mm512_max_ps(mx[g], _mm512_mask_mov_ps(ninf, valid[t], ex[g * nt + t]));
        }
    }
    for (int g = 0; g < gn; g++) mx[g] = _mm512_max_ps(mx[g], _mm512_shuffle_f32x4(mx[g], mx[g], 0x4e));
    for (int g = 0; g < gn; g++) mx[g] = _mm512_max_ps(mx[g], _mm512_shuffle_f32x4(mx[g], mx[g], 0xb1));
    for (int g = 0; g < gn; g++) mx[g] = _mm512_max_ps(mx[g], _mm512_permute_ps(mx[g], 0x4e));
    for (int g = 0; g < gn; g++) mx[g] = _mm512_max_ps(mx[g], _mm512_permute_ps(mx[g], 0xb1));
    for (int g = 0; g < gn; g++) {
        mo[g] = _mm512_set1_ps(it->m[g0 + g]);
        mn[g] = _mm512_max_ps(mx[g], mo[g]);
        _mm_store_ss(it->m + g0 + g, _mm512_castps512_ps128(mn[g]));
        for (int t = 0; t < nt; t++) ex[g * nt + t] = _mm512_sub_ps(ex[g * nt + t], mn[g]);
        ex[ns + g] = _mm512_sub_ps(mo[g], mn[g]);
    }
    for (int i = 0; i < ns + gn; i += 6) exp512n(ns + gn - i < 6 ? ns + gn - i : 6, ex + i);
    for (int g = 0; g < gn; g++) {
        alpha[g] = ex[ns + g];
        __m512 sum = _mm512_setzero_ps();
        for (int t = 0; t < nt; t++) {
            __m512 p = _mm512_maskz_mov_ps(valid[t], ex[g * nt + t]);
            __m256i pb = (__m256i)_mm512_cvtneps_pbh(p);
            pr[g] = t ? _mm512_inserti64x4(pr[g], pb, 1) : _mm512_castsi256_si512(pb);
            /* the sum uses p as rounded for p·v, so the weights sum to one */
            sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(pb), 16)));
        }
        float *lv = it->lv + (size_t)(g0 + g) * 16; /* the sum per lane; reduced once per item */
        _mm512_storeu_ps(lv, _mm512_fmadd_ps(_mm512_loadu_ps(lv), alpha[g], sum));
    }
    float *acc = it->acc + (size_t)g0 * D;
    const int np = nt * TILE / 2;
    int c = 0;
    const char *const *pfv = pv[0] ? pv : NULL;
    int ci = 0;
    for (; c + 64 <= D; c += 64, ci++) pv_bf16(gn, 4, np, vt, pr, alpha, acc, D, c, pfv, ci);
    switch ((D - c) / 16) {
        case 3: pv_bf16(gn, 3, np, vt, pr, alpha, acc, D, c, pfv, ci); break;
        case 2: pv_bf16(gn, 2, np, vt, pr, alpha, acc, D, c, pfv, ci); break;
        case 1: pv_bf16(gn, 1, np, vt, pr, alpha, acc, D, c, pfv, ci); break;
        default: break;
    }
}

/* bf16 items step two tiles (32 keys) at a time where both lie in one page, halving the softmax's
 * reductions and the accumulators' loads and stores per key */
TGT_BF16 static void item_avx512bf16(const item_t *it) {
    const int G = it->G, D = it->D, pf = it->prefetch;
    const uint16_t *kc = (const uint16_t *)it->kc, *vc = (const uint16_t *)it->vc;
    float lv[MAX_G * 16] __attribute__((aligned(64)));
    item_t own = *it;
    own.lv = lv;
    it = &own;
    reset_rows(it->m, it->l, it->acc, G, D);
    memset(lv, 0, sizeof(float) * 16 * (size_t)G);
    for (int t = it->t0; t < it->t1;) {
        int nt = it->ps >= 2 * TILE && t % (2 * TILE) == 0 && t + TILE < it->t1 ? 2 : 1;
        __mmask16 valid[2] = {tile_mask(it->t1 - t), tile_mask(it->t1 - t - TILE)};
        const char *pk[2] = {NULL, NULL}, *pv[2] = {NULL, NULL};
        for (int j = 0; j < nt; j++) {
            int f = t + (pf + j) * TILE;
            if (pf > 0 && f < it->t1) {
                size_t next = tile_offset(it, f) * 2;
                pk[j] = (const char *)kc + next;
                pv[j] = (const char *)vc + next;
            }
        }
        size_t base = tile_offset(it, t);
        const char *none[2] = {NULL, NULL};
        for (int g0 = 0; g0 < G; g0 += 4) {
            const char *const *k_pf = g0 ? none : pk, *const *v_pf = g0 ? none : pv;
#define BF16_TILE(gn)                                                                                    \
    (nt == 2 ? tile_bf16(gn, 2, it, g0, kc + base, vc + base, valid, k_pf, v_pf)                      \
             : tile_bf16(gn, 1, it, g0, kc + base, vc + base, valid, k_pf, v_pf))
            HEADS_SWITCH(G - g0, BF16_TILE)
#undef BF16_TILE
        }
        t += nt * TILE;
    }
    for (int g = 0; g < G; g++) it->l[g] = _mm512_reduce_add_ps(_mm512_load_ps(lv + 16 * g));
}

/* ---- ISA_AVX512: fp32 and fp16 caches, vfmadd231ps ----------------------------------------------- */
/* online-softmax update of GN heads from their scores s[g] (16 keys, `valid` lanes real):
 * p = e^(s - m_new) (0 where invalid), alpha = e^(m_old - m_new); returns p in s, alpha in alpha */
TGT INLINE void softmax_update(int gn, __m512 *s, __mmask16 valid, float *m, float *alpha) {
    for (int g = 0; g < gn; g++) {
        float mt = _mm512_mask_reduce_max_ps(valid, s[g]);
        float mn = mt > m[g] ? mt : m[g];
        alpha[g] = mn == m[g] ? 1.0f : expf(m[g] - mn);
        m[g] = mn;
        s[g] = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(s[g], _mm512_set1_ps(mn))));
    }
}

TGT INLINE void pv_f32(int gn, int nu, int dt, const void *vc, size_t vbase, const float *p, const float *alpha,
                       float *acc, int D, int c) {
    __m512 a[4][4];
    for (int g = 0; g < gn; g++)
        for (int u = 0; u < nu; u++)
            a[g][u] = _mm512_setzero_ps();
    for (int j = 0; j < TILE; j++) {
        for (int u = 0; u < nu; u++) {
            __m512 v = load16(dt, vc, vbase + (size_t)j * D + c + 16 * u);
            for (int g = 0; g < gn; g++) a[g][u] = _mm512_fmadd_ps(v, _mm512_set1_ps(p[g * TILE + j]), a[g][u]);
        }
    }
    /* the step's sum joins the running one once: over n keys the running sum takes n / 16 or n / 32
     * additions, not n (fp32 error growth), at the cost of the multiply it replaces */
    for (int g = 0; g < gn; g++)
        for (int u = 0; u < nu; u++) {
            float *o = acc + (size_t)g * D + c + 16 * u;
            acc16(o, _mm512_set1_ps(alpha[g]), a[g][u]);
        }
}

TGT INLINE void tile_f32(int gn, const item_t *it, int g0, const float *qv, size_t base, __mmask16 valid) {
    const int D = it->D, dt = it->dt;
    __m512 a[4][4], s[4];
    for (int g = 0; g < gn; g++)
        for (int u = 0; u < 4; u++) a[g][u] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 4) {
        for (int u = 0; u < 4; u++) {
            __m512 k = load16(dt, it->kc, base + (size_t)(d + u) * TILE);
            for (int g = 0; g < gn; g++)
                a[g][u] = _mm512_fmadd_ps(k, _mm512_set1_ps(qv[(size_t)(g0 + g) * D + d + u]), a[g][u]);
        }
    }
    for (int g = 0; g < gn; g++)
        s[g] = _mm512_mul_ps(_mm512_add_ps(_mm512_add_ps(a[g][0], a[g][1]), _mm512_add_ps(a[g][2], a[g][3])),
                             _mm512_set1_ps(it->scale));
    float alpha[4], p[4 * TILE];
    softmax_update(gn, s, valid, it->m + g0, alpha);
    for (int g = 0; g < gn; g++) {
        _mm512_storeu_ps(p + g * TILE, s[g]);
        it->l[g0 + g] = it->l[g0 + g] * alpha[g] + _mm512_reduce_add_ps(s[g]);
    }
    float *acc = it->acc + (size_t)g0 * D;
    int c = 0;
    for (; c + 64 <= D; c += 64) pv_f32(gn, 4, dt, it->vc, base, p, alpha, acc, D, c);
    switch ((D - c) / 16) {
        case 3: pv_f32(gn, 3, dt, it->vc, base, p, alpha, acc, D, c); break;
        case 2: pv_f32(gn, 2, dt, it->vc, base, p, alpha, acc, D, c); break;
        case 1: pv_f32(gn, 1, dt, it->vc, base, p, alpha, acc, D, c); break;
        default: break;
    }
}

/* the tile walk of one item; TILE_CALL(gn) runs one 16-key tile for heads g0 .. g0 + gn */
#define ITEM_LOOP(TILE_CALL)                                                                     \
    reset_rows(it->m, it->l, it->acc, G, D);                                                     \
    for (int t = it->t0; t < it->t1; t += TILE) {                                               \
        int n = it->t1 - t < TILE ? it->t1 - t : TILE;                                           \
        __mmask16 valid = (__mmask16)(n == TILE ? 0xffffu : ((1u << n) - 1u));                   \
        size_t base = tile_offset(it, t);                                                        \
        const char *pk = NULL, *pv = NULL;                                                       \
        if (it->prefetch > 0 && t + it->prefetch * TILE < it->t1) {                              \
            size_t next = tile_offset(it, t + it->prefetch * TILE) * esize;                      \
            pk = (const char *)it->kc + next;                                                    \
            pv = (const char *)it->vc + next;                                                    \
            PREFETCH_WHOLE(pk, pv);                                                              \
        }                                                                                        \
        for (int g0 = 0; g0 < G; g0 += 4) {                                                      \
            HEADS_SWITCH(G - g0, TILE_CALL)                                                      \
        }                                                                                        \
    }
TGT static void item_avx512(const item_t *it) {
    const int G = it->G, D = it->D;
    const size_t esize = it->dt == DT_F32 ? 4 : 2, tile_bytes = (size_t)TILE * D * esize;
    float *qv = (float *)scratch(sizeof(float) * (size_t)G * D);
    if (!qv) {
        flag_nomem(it->nomem);
        return;
    }
    for (int i = 0; i < G * D; i++) qv[i] = load_elem(it->q, (size_t)i, it->dt);
#define F32_TILE(gn) tile_f32(gn, it, g0, qv, base, valid)
#define PREFETCH_WHOLE(pk, pv) (prefetch_tile(pk, tile_bytes), prefetch_tile(pv, tile_bytes))
    ITEM_LOOP(F32_TILE)
#undef PREFETCH_WHOLE
#undef F32_TILE
    free(qv);
}
#endif

#endif
