/* decode_fp8.h — the paged form over an fp8 (e4m3) cache with per token-head float32 scales
 * (cpu_decode_attend_fp8): one work item per (sequence, KV head, KV split) for each variant. The bytes'
 * order is fp8_phys's (common.h); run_item (cpu_decode.c) picks the item.
 *
 * Contents, in order:
 *   fp8_key, fp8_value, item_scalar_fp8    ISA_SCALAR: decode_paged.h's scalar_walk over e4m3 bytes
 *   ISA_AVX512BF16 (bf16 q; AVX-512 BF16 + VBMI; fp8x64's conversion CV_LOOKUP or CV_SHIFT):
 *     pv_fp8                   p·v over fp8 V, 16 · NU dims (two chunks per 64-byte load)
 *     fp8_unit_t               one unit of the walk: 1 or 2 tiles of one page for up to 4 heads
 *     qk_fp8                   a unit's scores (through its K scales), prefetching future tiles' K
 *     softmax_fp8              a unit's online-softmax step: weights p · v_scale as bf16 pairs
 *     pvunit_fp8               a unit's p·v, prefetching future tiles' V
 *     FP8_UNIT_SWITCH, qk_fp8_unit, softmax_fp8_unit, pv_fp8_unit    each stage with gn, nt constant
 *     item_fp8_avx512          the walk: unit i's q·k between unit i - 1's softmax and p·v
 *     item_fp8_lookup, item_fp8_shift
 *   ISA_AMX (bf16 q; GQA groups up to 16; the lookups, then AMX tile multiplies):
 *     AMX_STEP_KEYS, item_fp8_amx
 */
#ifndef CPU_DECODE_DECODE_FP8_H
#define CPU_DECODE_DECODE_FP8_H

/* ---- ISA_SCALAR ---------------------------------------------------------------------------------- */
/* e4m3 tiles in the bf16 tile order (P = 2), each 64-byte block's rows interleaved (fp8_phys) */
static inline float fp8_key(const item_t *it, size_t base, int j, int d) {
    return e4m3_to_f32(((const uint8_t *)it->kc)[base + fp8_phys(((size_t)(d / 2) * TILE + j) * 2 + d % 2)]);
}

static inline float fp8_value(const item_t *it, size_t base, int j, int d) {
    return e4m3_to_f32(((const uint8_t *)it->vc)[base + fp8_phys(((size_t)(j / 2) * it->D + d) * 2 + j % 2)]);
}

/* decode_paged.h's plain-C item over e4m3 bytes, the scales from it->ks, it->vs */
static void item_scalar_fp8(const item_t *it) { scalar_walk(it, fp8_key, fp8_value); }
#ifdef CPU_DECODE_AVX512
/* ---- ISA_AVX512BF16: fp8 e4m3 K/V into the bf16 dot products ------------------------------------- */
/* pv_bf16 over fp8 V (NU even: one 64-byte load is two 16-dim chunks); pw: per head, the step's 16 pairs
 * of bf16 weights as 32-bit words, each broadcast from memory by dp_bcast (a load, where pv_bf16's
 * vpermd is a shuffle, which competes with the conversion's shifts); pfv: the future tiles whose V halves
 * to prefetch (NULL: none), ci: which of the step's calls this is (the lines are spread over them) */
TGT_FP8 INLINE void pv_fp8(int gn, int nu, int np, const uint8_t *vt, const uint32_t *pw, const __m512 *alpha,
                           float *acc, int D, int c, const __m512i *tab, int cv, const char *const *pfv, int ci) {
    __m512 a[4][4];
    for (int g = 0; g < gn; g++)
        for (int u = 0; u < nu; u++) a[g][u] = _mm512_setzero_ps();
    for (int jp = 0; jp < np; jp++) {
        if (pfv) { /* the future tiles' V halves (D / 4 lines each), 2 lines per key pair over the calls */
            const int L = (ci * np + jp) * 2, tl = L / (D / 4);
            if (tl < 2 && pfv[tl])
                for (int k = 0; k < 2; k++) _mm_prefetch(pfv[tl] + (size_t)(D / 4 + L % (D / 4) + k) * 64, _MM_HINT_T2);
        }
        const uint8_t *vp = vt + (size_t)(jp >> 3) * 2 * TILE * D + (size_t)(jp & 7) * 2 * D;
        for (int u = 0; u < nu; u += 2) {
            __m512i v0, v1;
            fp8x64(vp + 2 * (c + 16 * u), tab, &v0, &v1, cv);
            for (int g = 0; g < gn; g++) {
                a[g][u] = dp_bcast(a[g][u], v0, pw + 16 * g + jp);
                a[g][u + 1] = dp_bcast(a[g][u + 1], v1, pw + 16 * g + jp);
            }
        }
    }
    for (int g = 0; g < gn; g++)
        for (int u = 0; u < nu; u++) {
            float *o = acc + (size_t)g * D + c + 16 * u;
            acc16(o, alpha[g], a[g][u]);
        }
}

/* One unit of the fp8 item's walk: nt (1 or 2) adjacent 16-key tiles of one page for the gn heads from g0.
 * Its three stages run apart (item_fp8_avx512): the q·k of unit i runs between the softmax and the p·v
 * of unit i - 1, so that the softmax's chains of dependent operations (the max's reductions, e^x) run
 * beside independent dot products instead of right before the p·v that waits for their result */
typedef struct {
    float s[4 * 2 * TILE] __attribute__((aligned(64))); /* scores [gn][nt][16], through the K scales */
    uint32_t pw[4 * 16] __attribute__((aligned(64)));    /* per head, 16 pairs of bf16 weights */
    float alpha[16];                                     /* per head, e^(m_old - m_new) */
    int gn, nt, g0;
    const uint8_t *kt, *vt; /* the first tile's K and V (a second tile's follow each) */
    const float *kst, *vst; /* the first tile's 16 K and V scales (a second tile's follow them) */
    __mmask16 valid[2];     /* the real keys of each tile */
} fp8_unit_t;

/* q·k of unit u into u->s, prefetching the tiles pft (NULL: none) */
TGT_FP8 INLINE void qk_fp8(int gn, int nt, const item_t *it, fp8_unit_t *u, const __m512i *tab, int cv,
                           const char *const *pft) {
    const int D = it->D, D2 = D / 2, npart = 4 / nt;
    const uint32_t *qp = (const uint32_t *)it->q + (size_t)u->g0 * D2;
    const uint8_t *kt = u->kt;
    __m512 a[4][4];
    for (int g = 0; g < gn; g++)
        for (int i = 0; i < 4; i++) a[g][i] = _mm512_setzero_ps();
    for (int dp = 0; dp < D2; dp += npart) {
        /* the future tiles' K (D / 4 lines each), two lines per iteration, spread over q·k so that the
         * prefetches never queue up at once (a burst of them stalls the core); their V follows during
         * p·v (pv_fp8). Spread over both (K and V both during q·k before) one thread's step at batch 1
         * × 32k took 3.4 instead of 4.3 ms a layer, about its warm-cache time */
        if (pft) {
            const int L = dp / npart * 2, tl = L / (D / 4);
            if (pft[tl])
                for (int k = 0; k < 2; k++) _mm_prefetch(pft[tl] + (size_t)(L % (D / 4) + k) * 64, _MM_HINT_T2);
        }
        for (int i = 0; i < npart; i += 2) {
            for (int t = 0; t < nt; t++) {
                __m512i k0, k1;
                fp8x64(kt + (size_t)t * 2 * TILE * D + (size_t)(dp + i) * 32, tab, &k0, &k1, cv);
                for (int g = 0; g < gn; g++) {
                    a[g][t * npart + i] = dp_bcast(a[g][t * npart + i], k0, qp + g * D2 + dp + i);
                    a[g][t * npart + i + 1] = dp_bcast(a[g][t * npart + i + 1], k1, qp + g * D2 + dp + i + 1);
                }
            }
        }
    }
    const __m512 scale = _mm512_set1_ps(it->scale);
    for (int t = 0; t < nt; t++) {
        const __m512 ksv = _mm512_mul_ps(_mm512_loadu_ps(u->kst + 16 * t), scale);
        for (int g = 0; g < gn; g++) {
            __m512 x = a[g][t * npart];
            for (int i = 1; i < npart; i++) x = _mm512_add_ps(x, a[g][t * npart + i]);
            _mm512_store_ps(u->s + (g * nt + t) * TILE, _mm512_mul_ps(x, ksv));
        }
    }
}

/* the online-softmax step of unit u's heads from its scores: the new running max, the weights
 * p · v_scale as bf16 pairs into u->pw, e^(m_old - m_new) into u->alpha, the sum per lane into it->lv.
 * Each operation runs over all heads before the next: the max in every lane, the new running max
 * (branch-free: m_old = -inf gives e^-87 · 0 = 0), then e^(s - m_new) of every tile, four vectors
 * interleaved, and every head's alpha in one vector (lane g: head g). (Measured on Zen 4: groups of 4
 * ran 2-9 % faster than groups of 2, 3, 5 or 6, or than the alphas in the groups, per head) */
TGT_FP8 INLINE void softmax_fp8(int gn, int nt, const item_t *it, fp8_unit_t *u, int cv) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    __m512 ex[9], mx[4], mo[4], mn[4];
    const int ns = gn * nt, g0 = u->g0;
    const __m512 vmul = _mm512_set1_ps(cv == CV_SHIFT ? FP8_PRE : 1.0f); /* the weights' pre-scale */
    for (int g = 0; g < gn; g++) {
        mx[g] = ninf;
        for (int t = 0; t < nt; t++) {
            ex[g * nt + t] = _mm512_load_ps(u->s + (g * nt + t) * TILE);
            mx[g] = _mm512_max_ps(mx[g], _mm512_mask_mov_ps(ninf, u->valid[t], ex[g * nt + t]));
        }
    }
    for (int g = 0; g < gn; g++) mx[g] = _mm512_max_ps(mx[g], _mm512_shuffle_f32x4(mx[g], mx[g], 0x4e));
    for (int g = 0; g < gn; g++) mx[g] = _mm512_max_ps(mx[g], _mm512_shuffle_f32x4(mx[g], mx[g], 0xb1));
    for (int g = 0; g < gn; g++) mx[g] = _mm512_max_ps(mx[g], _mm512_permute_ps(mx[g], 0x4e));
    for (int g = 0; g < gn; g++) mx[g] = _mm512_max_ps(mx[g], _mm512_permute_ps(mx[g], 0xb1));
    ex[ns] = _mm512_setzero_ps(); /* lane g: m_old - m_new of head g */
    for (int g = 0; g < gn; g++) {
        mo[g] = _mm512_set1_ps(it->m[g0 + g]);
        mn[g] = _mm512_max_ps(mx[g], mo[g]);
        _mm_store_ss(it->m + g0 + g, _mm512_castps512_ps128(mn[g]));
        for (int t = 0; t < nt; t++) ex[g * nt + t] = _mm512_sub_ps(ex[g * nt + t], mn[g]);
        ex[ns] = _mm512_mask_sub_ps(ex[ns], (__mmask16)(1u << g), mo[g], mn[g]);
    }
    for (int i = 0; i < ns; i += 4) exp512n(ns - i < 4 ? ns - i : 4, ex + i);
    ex[ns] = exp512(ex[ns]);
    _mm512_storeu_ps(u->alpha, ex[ns]);
    for (int g = 0; g < gn; g++) {
        const __m512 alpha = _mm512_permutexvar_ps(_mm512_set1_epi32(g), ex[ns]);
        __m512 sum = _mm512_setzero_ps();
        __m512i pr = _mm512_setzero_si512();
        for (int t = 0; t < nt; t++) {
            __m512 p = _mm512_maskz_mov_ps(u->valid[t], ex[g * nt + t]);
            sum = _mm512_add_ps(sum, p);
            /* the weight of value j is p_j · v_scale_j, rounded to bf16 for the dot product */
            __m512 w = _mm512_mul_ps(_mm512_mul_ps(p, vmul), _mm512_loadu_ps(u->vst + 16 * t));
            __m256i pb = (__m256i)_mm512_cvtneps_pbh(w);
            pr = t ? _mm512_inserti64x4(pr, pb, 1) : _mm512_castsi256_si512(pb);
        }
        _mm512_store_si512((void *)(u->pw + 16 * g), pr);
        float *lv = it->lv + (size_t)(g0 + g) * 16;
        _mm512_storeu_ps(lv, _mm512_fmadd_ps(_mm512_loadu_ps(lv), alpha, sum));
    }
}

/* p·v of unit u into it->acc (after its softmax) */
TGT_FP8 INLINE void pvunit_fp8(int gn, int nt, const item_t *it, const fp8_unit_t *u, const __m512i *tab, int cv,
                               const char *const *pfv) {
    const int D = it->D, np = nt * TILE / 2;
    __m512 alpha[4];
    for (int g = 0; g < gn; g++) alpha[g] = _mm512_set1_ps(u->alpha[g]);
    float *acc = it->acc + (size_t)u->g0 * D;
    int c = 0, ci = 0;
    for (; c + 64 <= D; c += 64, ci++) pv_fp8(gn, 4, np, u->vt, u->pw, alpha, acc, D, c, tab, cv, pfv, ci);
    if (c < D) pv_fp8(gn, 2, np, u->vt, u->pw, alpha, acc, D, c, tab, cv, pfv, ci); /* D % 32 == 0: 32 dims left */
}

/* each stage of a unit with its gn and nt as constants */
#define FP8_UNIT_SWITCH(u, CALL)                                                                           \
    switch ((u)->gn * 2 + (u)->nt) {                                                                       \
        case 10: CALL(4, 2); break;                                                                        \
        case 9: CALL(4, 1); break;                                                                         \
        case 8: CALL(3, 2); break;                                                                         \
        case 7: CALL(3, 1); break;                                                                         \
        case 6: CALL(2, 2); break;                                                                         \
        case 5: CALL(2, 1); break;                                                                         \
        case 4: CALL(1, 2); break;                                                                         \
        default: CALL(1, 1); break;                                                                        \
    }
TGT_FP8 static void qk_fp8_unit(const item_t *it, fp8_unit_t *u, const __m512i *tab, int cv, const char *const *pft) {
#define QK(gn, nt) qk_fp8(gn, nt, it, u, tab, cv, pft)
    FP8_UNIT_SWITCH(u, QK)
#undef QK
}

TGT_FP8 static void softmax_fp8_unit(const item_t *it, fp8_unit_t *u, int cv) {
#define SM(gn, nt) softmax_fp8(gn, nt, it, u, cv)
    FP8_UNIT_SWITCH(u, SM)
#undef SM
}

TGT_FP8 static void pv_fp8_unit(const item_t *it, const fp8_unit_t *u, const __m512i *tab, int cv,
                                const char *const *pfv) {
#define PV(gn, nt) pvunit_fp8(gn, nt, it, u, tab, cv, pfv)
    FP8_UNIT_SWITCH(u, PV)
#undef PV
}

/* cv: CV_LOOKUP or CV_SHIFT (fp8x64); with CV_SHIFT, q and the weights are pre-scaled by FP8_PRE and
 * the scores (through the softmax scale) and the item's p·v are multiplied by FP8_POST */
TGT_FP8 INLINE void item_fp8_avx512(const item_t *it, int cv) {
    const int G = it->G, D = it->D, pf = it->prefetch;
    const uint8_t *kc = (const uint8_t *)it->kc, *vc = (const uint8_t *)it->vc;
    float lv[MAX_G * 16] __attribute__((aligned(64)));
    const __m512i tab[4] = {_mm512_load_si512(FP8_LO), _mm512_load_si512(FP8_LO + 64), _mm512_load_si512(FP8_HI),
                            _mm512_load_si512(FP8_HI + 64)};
    item_t own = *it;
    own.lv = lv;
    uint16_t *qs = NULL;
    if (cv == CV_SHIFT) { /* q × FP8_PRE, exact in bf16 */
        qs = (uint16_t *)scratch(sizeof(uint16_t) * (size_t)G * D);
        if (!qs) {
            flag_nomem(it->nomem);
            return;
        }
        for (int i = 0; i < G * D; i++) qs[i] = f32_to_bf16(bf16_to_f32(((const uint16_t *)it->q)[i]) * FP8_PRE);
        own.q = qs;
        own.scale = it->scale * FP8_POST;
    }
    it = &own;
    reset_rows(it->m, it->l, it->acc, G, D);
    memset(lv, 0, sizeof(float) * 16 * (size_t)G);
    fp8_unit_t units[2], *prev = NULL;
    int cur = 0;
    for (int t = it->t0; t < it->t1;) {
        int nt = it->ps >= 2 * TILE && t % (2 * TILE) == 0 && t + TILE < it->t1 ? 2 : 1;
        const char *pft[2] = {NULL, NULL}; /* the tiles pf ahead: their scales now, K during q·k, V during p·v */
        for (int j = 0; j < nt; j++) {
            int f = t + (pf + j) * TILE;
            if (pf > 0 && f < it->t1) {
                pft[j] = (const char *)kc + tile_offset(it, f);
                _mm_prefetch((const char *)(it->ks + scale_offset(it, f)), _MM_HINT_T2);
                _mm_prefetch((const char *)(it->vs + scale_offset(it, f)), _MM_HINT_T2);
            }
        }
        const size_t base = tile_offset(it, t), so = scale_offset(it, t);
        for (int g0 = 0; g0 < G; g0 += 4) {
            fp8_unit_t *u = &units[cur];
            *u = (fp8_unit_t){.gn = G - g0 < 4 ? G - g0 : 4, .nt = nt, .g0 = g0, .kt = kc + base, .vt = vc + base,
                              .kst = it->ks + so, .vst = it->vs + so,
                              .valid = {tile_mask(it->t1 - t), tile_mask(it->t1 - t - TILE)}};
            if (prev) softmax_fp8_unit(it, prev, cv);
            qk_fp8_unit(it, u, tab, cv, g0 == 0 ? pft : NULL); /* prefetched during the first heads' q·k */
            if (prev) pv_fp8_unit(it, prev, tab, cv, g0 == 0 ? pft : NULL);
            prev = u;
            cur ^= 1;
        }
        t += nt * TILE;
    }
    if (prev) {
        softmax_fp8_unit(it, prev, cv);
        pv_fp8_unit(it, prev, tab, cv, NULL);
    }
    for (int g = 0; g < G; g++) it->l[g] = _mm512_reduce_add_ps(_mm512_load_ps(lv + 16 * g));
    if (cv == CV_SHIFT) {
        for (int i = 0; i < G * D; i++) it->acc[i] *= FP8_POST;
        free(qs);
    }
}

TGT_FP8 static void item_fp8_lookup(const item_t *it) { item_fp8_avx512(it, CV_LOOKUP); }
TGT_FP8 static void item_fp8_shift(const item_t *it) { item_fp8_avx512(it, CV_SHIFT); }
#endif

#ifdef CPU_DECODE_AMX
/* ---- ISA_AMX ---------------------------------------------------------------------------------------
 * (exactly the bf16 kernel's tile layout), and AMX tile multiplies (tdpbf16ps) compute the GN ≤ 16
 * heads' scores (q [GN, 32 dims] × K [32 dims, 16 keys] per 32 dims) and p·v (P [GN, 32 keys] × V
 * [32 keys, 16 dims] per 16 dims); the online softmax stays in AVX-512, in fp32. One step covers the
 * rest of a page (up to 128 keys), so that the multiplies of a step are many and independent. */
#define AMX_STEP_KEYS 128 /* the keys of one step of item_fp8_amx: 8 tiles, what its scratch holds */

TGT_AMX static void item_fp8_amx(const item_t *it) {
    const int G = it->G, D = it->D, pf = it->prefetch;
    const uint8_t *kc = (const uint8_t *)it->kc, *vc = (const uint8_t *)it->vc;
    const size_t tile_bytes = (size_t)2 * TILE * D;
    const __m512i tab[4] = {_mm512_load_si512(FP8_LO), _mm512_load_si512(FP8_LO + 64), _mm512_load_si512(FP8_HI),
                            _mm512_load_si512(FP8_HI + 64)};
    /* scratch for a step of up to 8 tiles (AMX_STEP_KEYS keys): K as bf16 [8][D/2][16][2], V [64 key
     * pairs][D][2], scores [8][G][16] fp32, P [G][128] bf16, the step's p·v [G][D] fp32 */
    const size_t kvb = (size_t)256 * D;
    char *buf = (char *)scratch(2 * kvb + 8192 + 4096 + (size_t)64 * D);
    if (!buf) {
        flag_nomem(it->nomem);
        return;
    }
    char *kb = buf, *vb = buf + kvb;
    float *sbuf = (float *)(buf + 2 * kvb), *obuf = (float *)(buf + 2 * kvb + 12288);
    uint16_t *pbuf = (uint16_t *)(buf + 2 * kvb + 8192);
    memset(vb, 0, kvb); /* an odd tile count's last key pairs meet P = 0: zeros, never NaN */
    tilecfg_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = t >= 5 ? 16 : (uint8_t)G; /* 0-3: C (scores, p·v), 4: A (q, P), 5-7: B (K, V) */
    }
    _tile_loadconfig(&cfg);
    reset_rows(it->m, it->l, it->acc, G, D);
    const __m512 scale = _mm512_set1_ps(it->scale), ninf = _mm512_set1_ps(-INFINITY);
    for (int t = it->t0; t < it->t1;) {
        /* the step: the tiles from t to the end of its page, of the range, or of AMX_STEP_KEYS keys —
         * whichever comes first. The scratch above holds one step of at most 8 tiles (x[] 8 + alpha),
         * so a page of 256 or 512 keys is walked in steps of 128 (a step ran to the page's end once,
         * and overran every buffer of the item at those page sizes) */
        const int page_end = (t / it->ps + 1) * it->ps, cap = t + AMX_STEP_KEYS;
        const int stop = page_end < it->t1 ? (page_end < cap ? page_end : cap) : (it->t1 < cap ? it->t1 : cap);
        const int nt = (stop - t + TILE - 1) / TILE, nc = (nt + 1) / 2; /* tiles, 32-key chunks */
        if (pf > 0) { /* the next step's first tiles, and its scales */
            for (int j = 0; j < pf; j++) {
                int f = stop + j * TILE;
                if (f >= it->t1) break;
                prefetch_tile((const char *)kc + tile_offset(it, f), tile_bytes);
                if (j == 0) {
                    const int in_page = it->ps - f % it->ps, n = in_page < AMX_STEP_KEYS ? in_page : AMX_STEP_KEYS;
                    prefetch_tile((const char *)(it->ks + scale_offset(it, f)), 4 * (size_t)n);
                    prefetch_tile((const char *)(it->vs + scale_offset(it, f)), 4 * (size_t)n);
                }
            }
        }
        const size_t base = tile_offset(it, t), so = scale_offset(it, t);
        for (int u = 0; u < nt; u++) { /* fp8 → bf16, K and V of each tile */
            const uint8_t *sk = kc + base + u * tile_bytes, *sv = vc + base + u * tile_bytes;
            char *dk = kb + (size_t)u * 32 * D, *dv = vb + (size_t)u * 32 * D;
            for (int i = 0; i < 16 * D; i += 64) {
                __m512i r0, r1;
                fp8x64(sk + i, tab, &r0, &r1, CV_LOOKUP);
                _mm512_store_si512((void *)(dk + 2 * i), r0);
                _mm512_store_si512((void *)(dk + 2 * i + 64), r1);
                fp8x64(sv + i, tab, &r0, &r1, CV_LOOKUP);
                _mm512_store_si512((void *)(dv + 2 * i), r0);
                _mm512_store_si512((void *)(dv + 2 * i + 64), r1);
            }
        }
        for (int c = 0; c < nt; c += 4) { /* scores of up to 4 tiles at a time, 32 dims per multiply */
            const int n4 = nt - c < 4 ? nt - c : 4;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int k = 0; k < D / 32; k++) {
                _tile_loadd(4, (const char *)it->q + k * 64, D * 2);
                const char *kk = kb + (size_t)c * 32 * D + k * 1024;
                _tile_loadd(5, kk, 64);
                _tile_dpbf16ps(0, 4, 5);
                if (n4 > 1) {
                    _tile_loadd(6, kk + (size_t)32 * D, 64);
                    _tile_dpbf16ps(1, 4, 6);
                }
                if (n4 > 2) {
                    _tile_loadd(7, kk + (size_t)64 * D, 64);
                    _tile_dpbf16ps(2, 4, 7);
                }
                if (n4 > 3) {
                    _tile_loadd(5, kk + (size_t)96 * D, 64);
                    _tile_dpbf16ps(3, 4, 5);
                }
            }
            float *sc = sbuf + (size_t)c * 16 * G;
            _tile_stored(0, sc, 64);
            if (n4 > 1) _tile_stored(1, sc + 16 * G, 64);
            if (n4 > 2) _tile_stored(2, sc + 32 * G, 64);
            if (n4 > 3) _tile_stored(3, sc + 48 * G, 64);
        }
        float alpha[16];
        for (int g = 0; g < G; g++) { /* the online softmax of head g over the step's keys */
            __m512 x[9], mx = ninf;
            for (int u = 0; u < nt; u++) {
                __m512 ks = _mm512_mul_ps(_mm512_loadu_ps(it->ks + so + 16 * u), scale);
                x[u] = _mm512_mul_ps(_mm512_loadu_ps(sbuf + (size_t)(u * G + g) * 16), ks);
                mx = _mm512_max_ps(mx, _mm512_mask_mov_ps(ninf, tile_mask(stop - t - 16 * u), x[u]));
            }
            float mt = _mm512_reduce_max_ps(mx), mo = it->m[g], mn = mt > mo ? mt : mo;
            const __m512 mv = _mm512_set1_ps(mn);
            for (int u = 0; u < nt; u++) x[u] = _mm512_sub_ps(x[u], mv);
            x[nt] = _mm512_set1_ps(mo - mn);
            for (int i = 0; i <= nt; i += 6) exp512n(nt + 1 - i < 6 ? nt + 1 - i : 6, x + i);
            alpha[g] = _mm512_cvtss_f32(x[nt]);
            __m512 sum = _mm512_setzero_ps();
            for (int u = 0; u < 2 * nc; u++) {
                __m512 pu = u < nt ? _mm512_maskz_mov_ps(tile_mask(stop - t - 16 * u), x[u]) : _mm512_setzero_ps();
                sum = _mm512_add_ps(sum, pu);
                __m512 w = u < nt ? _mm512_mul_ps(pu, _mm512_loadu_ps(it->vs + so + 16 * u)) : pu;
                _mm256_store_si256((__m256i *)(pbuf + 128 * g + 16 * u), (__m256i)_mm512_cvtneps_pbh(w));
            }
            it->l[g] = it->l[g] * alpha[g] + _mm512_reduce_add_ps(sum);
            it->m[g] = mn;
        }
        for (int db = 0; db < D / 16; db += 4) { /* p·v: 4 × 16 dims at a time, 32 keys per multiply */
            const int n4 = D / 16 - db < 4 ? D / 16 - db : 4;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int ch = 0; ch < nc; ch++) {
                _tile_loadd(4, (const char *)pbuf + ch * 64, 256);
                const char *vv = vb + (size_t)ch * 64 * D + db * 64;
                _tile_loadd(5, vv, D * 4);
                _tile_dpbf16ps(0, 4, 5);
                if (n4 > 1) {
                    _tile_loadd(6, vv + 64, D * 4);
                    _tile_dpbf16ps(1, 4, 6);
                }
                if (n4 > 2) {
                    _tile_loadd(7, vv + 128, D * 4);
                    _tile_dpbf16ps(2, 4, 7);
                }
                if (n4 > 3) {
                    _tile_loadd(5, vv + 192, D * 4);
                    _tile_dpbf16ps(3, 4, 5);
                }
            }
            _tile_stored(0, obuf + db * 16, D * 4);
            if (n4 > 1) _tile_stored(1, obuf + db * 16 + 16, D * 4);
            if (n4 > 2) _tile_stored(2, obuf + db * 16 + 32, D * 4);
            if (n4 > 3) _tile_stored(3, obuf + db * 16 + 48, D * 4);
        }
        for (int g = 0; g < G; g++) {
            float *acc = it->acc + (size_t)g * D;
            const float *o = obuf + (size_t)g * D;
            const __m512 a = _mm512_set1_ps(alpha[g]);
            for (int d = 0; d < D; d += 16)
                acc16(acc + d, a, _mm512_loadu_ps(o + d));
        }
        t = stop;
    }
    _tile_release();
    free(buf);
}
#endif

#endif
