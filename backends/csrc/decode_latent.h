/* decode_latent.h — the MLA latent form (cpu_decode_attend_latent): one work item per (sequence, KV
 * split) that walks its tokens once for all H heads, for each variant; the latent dispatch
 * (run_latent_item, cpu_decode.c) picks the item.
 *
 * The cache: per layer [pages, ps, Dk] rows (the absorbed form's [c | k_pe], one shared KV head; the
 * value is the row's first Dv columns, stored once): the mla backend's LatentCache pages as they are.
 * q [B, H, Dk] → out [B, H, Dv]. Each latent row is read once per step whatever the head count.
 *
 * Contents, in order:
 *   latent_item_scalar         ISA_SCALAR: any dtype, plain C, fp32 arithmetic
 *   the steps both vector items share (TGT_BF16; the AMX item inlines them too):
 *     LAZY, LAT_KJ, LAT_HJ     the lazy rescale's threshold, the register tiles' keys and heads
 *     latent_scratch           a vector item's scratch, laid out, O and the running max and sum reset
 *     latent_qt                Q^T in bf16 pairs, 16 heads a vector
 *     latent_next              the next step's rows, to prefetch
 *     latent_result            an item's m, l and O out of its scratch
 *     latent_softmax           the online softmax of a step, 16 heads a vector, lazily rescaled; P in pairs
 *     latent_v_pairs           V in key pairs [kp][Dv][2]
 *   ISA_AVX512BF16 (bf16; Dk even, Dv % 16 == 0; pages ≤ 128 keys):
 *     latent_scores_bf16       S^T, 6 keys × up to 64 heads in registers
 *     latent_pv_bf16           O += P · V, 6 heads × up to 64 dims in registers
 *     latent_item_bf16
 *   ISA_AMX (bf16; Dk % 32 == 0, Dv % 16 == 0; pages ≤ 128 keys):
 *     latent_item_amx
 */
#ifndef CPU_DECODE_DECODE_LATENT_H
#define CPU_DECODE_DECODE_LATENT_H

/* ---- ISA_SCALAR ---------------------------------------------------------------------------------- */
/* the plain-C latent item: any dtype, fp32 arithmetic (ws part: m [H], l [H], acc [H, Dv]) */
static void latent_item_scalar(const void *q, const void *kc, const int32_t *bt, int t0, int t1, int H, int Dk, int Dv,
                               int ps, int dt, float scale, float *m, float *l, float *acc, int *nomem) {
    float *qv = (float *)scratch(sizeof(float) * ((size_t)H * Dk + TILE + Dv));
    if (!qv) {
        flag_nomem(nomem);
        return;
    }
    float *s = qv + (size_t)H * Dk, *tmp = s + TILE;
    for (size_t i = 0; i < (size_t)H * Dk; i++) qv[i] = load_elem(q, i, dt);
    reset_rows(m, l, acc, H, Dv);
    for (int t = t0; t < t1; t += TILE) {
        int n = t1 - t < TILE ? t1 - t : TILE;
        size_t row0 = ((size_t)bt[t / ps] * ps + t % ps) * Dk; /* a tile never crosses a page */
        for (int h = 0; h < H; h++) {
            const float *qh = qv + (size_t)h * Dk;
            float mt = -INFINITY;
            for (int j = 0; j < n; j++) {
                /* 16 partial sums, as a vector unit's lanes keep them: one running sum over a 576-wide
                 * row drifts by several ulps of the score, past what the gate allows in fp32 */
                float a[16] = {0.0f};
                for (int d = 0; d < Dk; d++) a[d & 15] += qh[d] * load_elem(kc, row0 + (size_t)j * Dk + d, dt);
                for (int w = 8; w > 0; w /= 2)
                    for (int i = 0; i < w; i++) a[i] += a[i + w];
                s[j] = a[0] * scale;
                if (s[j] > mt) mt = s[j];
            }
            float mn = mt > m[h] ? mt : m[h], alpha = expf(m[h] - mn), sum = 0.0f;
            float *o = acc + (size_t)h * Dv;
            for (int d = 0; d < Dv; d++) tmp[d] = 0.0f;
            for (int j = 0; j < n; j++) {
                float p = expf(s[j] - mn);
                sum += p;
                for (int d = 0; d < Dv; d++) tmp[d] += p * load_elem(kc, row0 + (size_t)j * Dk + d, dt);
            }
            for (int d = 0; d < Dv; d++) o[d] = o[d] * alpha + tmp[d]; /* one addition per tile */
            l[h] = l[h] * alpha + sum;
            m[h] = mn;
        }
    }
    free(qv);
}
#ifdef CPU_DECODE_AVX512
/* ---- ISA_AVX512BF16 and the steps the AMX item shares -------------------------------------------- */
/* The AVX-512 BF16 latent item (bf16; Dk even, Dv % 16 == 0): the AMX item's four stages with
 * register tiles of vdpbf16ps in place of the matrix unit. A step is the rest of a page (≤ 128 keys).
 * 1. S^T [keys, heads] = rows · Q^T: 6 keys × 64 heads in 24 accumulators; each of a row's bf16 pairs
 *    is an embedded broadcast (dp_bcast), each Q^T pair vector (16 heads, built once per item) a load
 *    shared by 6 keys. Past the step's keys the broadcasts read a zero row.
 * 2. The online softmax with 16 heads in a vector (no horizontal reduction) and the AMX item's lazy
 *    rescale; P rounded to bf16 in key pairs, transposed to [head][key pair].
 * 3. V in key pairs [kp][Dv][2] from the step's rows.
 * 4. O [H, Dv] fp32 += P · V: 6 heads × 64 dims in 24 accumulators, loaded and stored once per step;
 *    each P pair is a broadcast, each V pair vector a load shared by 6 heads. */
#define LAZY 8.0f /* the running max is rescaled only when it grows by more than this (both latent items) */
#define LAT_KJ 6 /* keys per score tile */
#define LAT_HJ 6 /* heads per P·V tile */
/* -- the steps both latent items share (TGT_BF16: the AMX item inlines them too) -- */

/* a vector item's scratch, one allocation: Q^T (qt_n dwords), S^T (s_n floats), P (p_n dwords), V in
 * pairs (v_n dwords), O (o_n floats, zeroed), m and l per head of Hp (reset), then extra_n dwords */
typedef struct {
    uint32_t *qt, *p, *vb, *extra;
    float *sb, *ob, *mr, *lr;
} latent_scratch_t;

/* 0, or -1 when the allocation is refused (flagged: the entry point returns ERR_NOMEM) */
static int latent_scratch(latent_scratch_t *w, size_t qt_n, size_t s_n, size_t p_n, size_t v_n, size_t o_n, int Hp,
                          size_t extra_n, int *nomem) {
    uint32_t *qt = (uint32_t *)scratch(4 * (qt_n + s_n + p_n + v_n + o_n + 2 * (size_t)Hp + extra_n));
    if (!qt) {
        flag_nomem(nomem);
        return -1;
    }
    w->qt = qt;
    w->sb = (float *)(qt + qt_n);
    w->p = (uint32_t *)(w->sb + s_n);
    w->vb = w->p + p_n;
    w->ob = (float *)(w->vb + v_n);
    w->mr = w->ob + o_n;
    w->lr = w->mr + Hp;
    w->extra = (uint32_t *)(w->lr + Hp);
    memset(w->ob, 0, sizeof(float) * o_n);
    for (int h = 0; h < Hp; h++) {
        w->mr[h] = -INFINITY;
        w->lr[h] = 0.0f;
    }
    return 0;
}

/* Q^T in pairs: vector (hb, r) = dims 2r, 2r + 1 of heads hb·16 .. hb·16 + 15 (0 past H), r < Dk / 2;
 * for AMX, rows 16kk .. 16kk + 15 of hb's block are the B tile of dims 32kk .. 32kk + 31 */
TGT_BF16 INLINE void latent_qt(const uint16_t *q, int H, int Dk, int nb, uint32_t *qt) {
    const int np = Dk / 2;
    for (int hb = 0; hb < nb; hb++)
        for (int r = 0; r < np; r++)
            for (int e = 0; e < 16; e++) {
                int h = hb * 16 + e;
                uint32_t v = 0;
                if (h < H) v = q[(size_t)h * Dk + 2 * r] | (uint32_t)q[(size_t)h * Dk + 2 * r + 1] << 16;
                qt[((size_t)hb * np + r) * 16 + e] = v;
            }
}

/* the next step's rows (its page, from its first key), to prefetch into L2 over this step's score
 * multiplies: their lines (0 at the item's end) and their address in *next */
INLINE size_t latent_next(const uint16_t *kc, const int32_t *bt, int stop, int t1, int ps, int Dk, const char **next) {
    *next = NULL;
    if (stop >= t1) return 0;
    const int next_stop = (stop / ps + 1) * ps < t1 ? (stop / ps + 1) * ps : t1;
    *next = (const char *)(kc + ((size_t)bt[stop / ps] * ps + stop % ps) * Dk);
    return ((size_t)(next_stop - stop) * Dk * 2 + 63) / 64;
}

/* an item's result: its running max, sum and unnormalised O for the H real heads, out of the scratch */
INLINE void latent_result(int H, int Dv, const float *mr, const float *lr, const float *ob, float *m, float *l, float *acc) {
    memcpy(m, mr, sizeof(float) * (size_t)H);
    memcpy(l, lr, sizeof(float) * (size_t)H);
    memcpy(acc, ob, sizeof(float) * (size_t)H * Dv);
}

/* The online softmax of a step's n ≤ 128 scores S^T [n][Hp] (16 heads a vector: no horizontal
 * reduction) with the running max mr and sums lr [Hp], rescaled lazily: O [.][Dv] and l only when a
 * head's max grows by more than LAZY (e^8 ≈ 3000, so the probabilities stay ≤ 3000, exact enough in
 * bf16 and far from fp32's range), so most steps never touch O. P is rounded to bf16 in key pairs
 * (0 past the step's keys) and transposed 16 × 16 dwords at a time: head hb·16 + i's key pairs
 * c·16 .. c·16 + 15 go to p + hb·1024 + c·cs + i·is (AMX: the A tiles; AVX-512: rows of 64 pairs). */
TGT_BF16 INLINE void latent_softmax(int nb, int n, int Hp, int Dv, const float *sb, float scale, float *mr, float *lr,
                                    float *ob, uint32_t *p, int cs, int is) {
    const __m512 sc = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY), lazy = _mm512_set1_ps(LAZY);
    const int nc = (n + 31) / 32; /* 32-key chunks */
    for (int hb = 0; hb < nb; hb++) {
        __m512 mx = ninf;
        for (int j = 0; j < n; j++) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sb + (size_t)j * Hp + hb * 16));
        mx = _mm512_mul_ps(mx, sc);
        __m512 mo = _mm512_loadu_ps(mr + hb * 16);
        __mmask16 grow = _mm512_cmp_ps_mask(mx, _mm512_add_ps(mo, lazy), _CMP_GT_OQ);
        if (grow) { /* a new reference max for these heads: rescale their O rows and sums */
            __m512 mn = _mm512_mask_mov_ps(mo, grow, mx), al = _mm512_sub_ps(mo, mn);
            exp512n(1, &al);
            float a16[16];
            _mm512_storeu_ps(a16, al);
            for (int e = 0; e < 16; e++) {
                if (!((grow >> e) & 1)) continue;
                float *o = ob + (size_t)(hb * 16 + e) * Dv;
                const __m512 a = _mm512_set1_ps(a16[e]);
                for (int d = 0; d < Dv; d += 16) _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), a));
            }
            _mm512_storeu_ps(lr + hb * 16, _mm512_mul_ps(_mm512_loadu_ps(lr + hb * 16), al));
            _mm512_storeu_ps(mr + hb * 16, mn);
            mo = mn;
        }
        __m512 sum = _mm512_loadu_ps(lr + hb * 16);
        for (int c = 0; c < nc; c++) {
            __m512i r[16];
            for (int i = 0; i < 16; i++) { /* key pair c·16 + i */
                __m512 x[2];
                for (int k = 0; k < 2; k++) {
                    int j = c * 32 + 2 * i + k;
                    x[k] = j < n ? _mm512_fmsub_ps(_mm512_loadu_ps(sb + (size_t)j * Hp + hb * 16), sc, mo) : ninf;
                }
                exp512n(2, x);
                for (int k = 0; k < 2; k++) /* past the step's keys: 0, not e^-87 */
                    if (c * 32 + 2 * i + k >= n) x[k] = _mm512_setzero_ps();
                __m256i b0 = (__m256i)_mm512_cvtneps_pbh(x[0]), b1 = (__m256i)_mm512_cvtneps_pbh(x[1]);
                __m512i w0 = _mm512_cvtepu16_epi32(b0), w1 = _mm512_cvtepu16_epi32(b1);
                /* the sum takes p as rounded for p·v, so the weights sum to one */
                sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(w0, 16)));
                sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(w1, 16)));
                r[i] = _mm512_or_si512(w0, _mm512_slli_epi32(w1, 16));
            }
            transpose16(r); /* [key pair][head] → [head][key pair] */
            for (int i = 0; i < 16; i++) _mm512_store_si512(p + (size_t)hb * 1024 + (size_t)c * cs + (size_t)i * is, r[i]);
        }
        _mm512_storeu_ps(lr + hb * 16, sum);
    }
}

/* V in key pairs [kp][Dv][2] for the step's np pairs from its rows (zeros past the page's avail rows;
 * Dv % 32 == 16: the last chunk is half a vector) */
TGT_BF16 INLINE void latent_v_pairs(int np, int avail, const uint16_t *rows, int Dk, int Dv, uint32_t *vb) {
    int16_t lo[32], hi[32]; /* interleave 16 bf16 of two rows: a0 b0 a1 b1 … */
    for (int e = 0; e < 32; e++) {
        lo[e] = (int16_t)((e & 1 ? 32 : 0) + e / 2);
        hi[e] = (int16_t)((e & 1 ? 32 : 0) + 16 + e / 2);
    }
    const __m512i ilo = _mm512_loadu_si512(lo), ihi = _mm512_loadu_si512(hi);
    for (int kp = 0; kp < np; kp++) {
        const int j0 = 2 * kp, j1 = 2 * kp + 1;
        for (int d = 0; d < Dv; d += 32) {
            const __mmask32 cols = Dv - d < 32 ? 0xffffu : 0xffffffffu;
            __m512i a = j0 < avail ? _mm512_maskz_loadu_epi16(cols, rows + (size_t)j0 * Dk + d) : _mm512_setzero_si512();
            __m512i b = j1 < avail ? _mm512_maskz_loadu_epi16(cols, rows + (size_t)j1 * Dk + d) : _mm512_setzero_si512();
            _mm512_store_si512(vb + (size_t)kp * Dv + d, _mm512_permutex2var_epi16(a, ilo, b));
            if (Dv - d >= 32) _mm512_store_si512(vb + (size_t)kp * Dv + d + 16, _mm512_permutex2var_epi16(a, ihi, b));
        }
    }
}

TGT_BF16 INLINE void latent_scores_bf16(int hbn, int np, const uint32_t *const *rp, const uint32_t *qt, size_t qs,
                                        float *st, int Hp) {
    __m512 acc[LAT_KJ][4];
    for (int k = 0; k < LAT_KJ; k++)
        for (int h = 0; h < hbn; h++) acc[k][h] = _mm512_setzero_ps();
    for (int r = 0; r < np; r++) {
        __m512i qv[4];
        for (int h = 0; h < hbn; h++) qv[h] = _mm512_load_si512(qt + h * qs + (size_t)r * 16);
        for (int k = 0; k < LAT_KJ; k++)
            for (int h = 0; h < hbn; h++) acc[k][h] = dp_bcast(acc[k][h], qv[h], rp[k] + r);
    }
    for (int k = 0; k < LAT_KJ; k++)
        for (int h = 0; h < hbn; h++) _mm512_storeu_ps(st + (size_t)k * Hp + h * 16, acc[k][h]);
}

TGT_BF16 INLINE void latent_pv_bf16(int du, int nkp, const uint32_t *pt, const uint32_t *vb, int Dv, float *o) {
    __m512 acc[LAT_HJ][4];
    for (int h = 0; h < LAT_HJ; h++)
        for (int u = 0; u < du; u++) acc[h][u] = _mm512_loadu_ps(o + (size_t)h * Dv + u * 16);
    for (int kp = 0; kp < nkp; kp++) {
        __m512i vv[4];
        for (int u = 0; u < du; u++) vv[u] = _mm512_load_si512(vb + (size_t)kp * Dv + u * 16);
        for (int h = 0; h < LAT_HJ; h++)
            for (int u = 0; u < du; u++) acc[h][u] = dp_bcast(acc[h][u], vv[u], pt + (size_t)h * 64 + kp);
    }
    for (int h = 0; h < LAT_HJ; h++)
        for (int u = 0; u < du; u++) _mm512_storeu_ps(o + (size_t)h * Dv + u * 16, acc[h][u]);
}

TGT_BF16 static void latent_item_bf16(const uint16_t *q, const uint16_t *kc, const int32_t *bt, int t0, int t1, int H,
                                      int Dk, int Dv, int ps, float scale, float *m, float *l, float *acc,
                                      int *nomem) {
    const int Hp = (H + 15) / 16 * 16, nb = Hp / 16, np = Dk / 2;
    const int Hq = (Hp + LAT_HJ - 1) / LAT_HJ * LAT_HJ; /* P and O rows: whole P·V tiles (the extra P rows 0) */
    /* scratch: Q^T pairs [nb][np][16], S^T [128 + LAT_KJ][Hp] fp32, P [Hq][64] dwords, V pairs [64][Dv]
     * dwords, O [Hq][Dv] fp32, m and l [Hp], a zero row of Dk */
    const size_t qt_n = (size_t)nb * np * 16, s_n = (size_t)(128 + LAT_KJ) * Hp, p_n = (size_t)Hq * 64,
                 v_n = (size_t)64 * Dv, o_n = (size_t)Hq * Dv, z_n = (size_t)Dk / 2 + 16;
    latent_scratch_t w;
    if (latent_scratch(&w, qt_n, s_n, p_n, v_n, o_n, Hp, z_n, nomem)) return;
    uint32_t *qt = w.qt, *pt = w.p, *vb = w.vb, *zrow = w.extra;
    float *sb = w.sb, *ob = w.ob, *mr = w.mr, *lr = w.lr;
    memset(zrow, 0, 4 * z_n);
    memset(pt, 0, 4 * p_n);
    latent_qt(q, H, Dk, nb, qt);
    for (int t = t0; t < t1;) {
        const int page_end = (t / ps + 1) * ps, stop = page_end < t1 ? page_end : t1, n = stop - t;
        const int nc = (n + 31) / 32; /* 32-key chunks */
        const uint16_t *rows = kc + ((size_t)bt[t / ps] * ps + t % ps) * Dk;
        const int avail = page_end - t; /* rows that exist in this page from t */
        const char *next; /* the next step's rows, prefetched over the score tiles, an equal share before each */
        const size_t next_lines = latent_next(kc, bt, stop, t1, ps, Dk, &next);
        size_t pf_done = 0;
        const size_t calls = (size_t)((n + LAT_KJ - 1) / LAT_KJ) * ((nb + 3) / 4);
        const size_t pf_per = (next_lines + calls - 1) / calls;
        /* 1. S^T, 6 keys × up to 64 heads a tile */
        for (int j0 = 0; j0 < n; j0 += LAT_KJ) {
            const uint32_t *rp[LAT_KJ];
            for (int k = 0; k < LAT_KJ; k++) rp[k] = j0 + k < n ? (const uint32_t *)(rows + (size_t)(j0 + k) * Dk) : zrow;
            for (int hb = 0; hb < nb; hb += 4) {
                for (size_t i = 0; i < pf_per && pf_done < next_lines; i++, pf_done++)
                    _mm_prefetch(next + pf_done * 64, _MM_HINT_T1);
                const uint32_t *qb = qt + (size_t)hb * np * 16;
                float *st = sb + (size_t)j0 * Hp + hb * 16;
                switch (nb - hb < 4 ? nb - hb : 4) { /* constant tile widths: the accumulators stay in registers */
                case 1: latent_scores_bf16(1, np, rp, qb, (size_t)np * 16, st, Hp); break;
                case 2: latent_scores_bf16(2, np, rp, qb, (size_t)np * 16, st, Hp); break;
                case 3: latent_scores_bf16(3, np, rp, qb, (size_t)np * 16, st, Hp); break;
                default: latent_scores_bf16(4, np, rp, qb, (size_t)np * 16, st, Hp); break;
                }
            }
        }
        /* 2. the online softmax; P to rows of 64 key pairs per head */
        latent_softmax(nb, n, Hp, Dv, sb, scale, mr, lr, ob, pt, 16, 64);
        /* 3. V in key pairs [kp][Dv][2] */
        latent_v_pairs(nc * 16, avail, rows, Dk, Dv, vb);
        /* 4. O += P · V, 6 heads × up to 64 dims a tile (P's rows past the step's pairs are 0) */
        const int nkp = (n + 1) / 2;
        for (int h0 = 0; h0 < Hq; h0 += LAT_HJ)
            for (int d = 0; d < Dv; d += 64) {
                const uint32_t *pp = pt + (size_t)h0 * 64;
                const uint32_t *vv = vb + d;
                float *o = ob + (size_t)h0 * Dv + d;
                switch (Dv - d < 64 ? (Dv - d) / 16 : 4) {
                case 1: latent_pv_bf16(1, nkp, pp, vv, Dv, o); break;
                case 2: latent_pv_bf16(2, nkp, pp, vv, Dv, o); break;
                case 3: latent_pv_bf16(3, nkp, pp, vv, Dv, o); break;
                default: latent_pv_bf16(4, nkp, pp, vv, Dv, o); break;
                }
            }
        t = stop;
    }
    latent_result(H, Dv, mr, lr, ob, m, l, acc);
    free(qt);
}

#endif

#ifdef CPU_DECODE_AMX
/* ---- ISA_AMX --------------------------------------------------------------------------------------- */
/* The AMX latent item (bf16; Dk % 32 == 0, Dv % 16 == 0). A step is the rest of a page (≤ 128 keys):
 * scores transposed, S^T [keys, heads] = rows [keys, Dk] · Q^T (the page's rows are the A tiles as
 * stored; Q^T in pairs is built once per item), so the online softmax runs with 16 heads in a vector
 * and no horizontal reduction; P (bf16, transposed back 16 × 16 dwords at a time) · V [key pairs, Dv,
 * 2] (the step's rows interleaved in pairs into a scratch buffer) accumulates into O [H, Dv] fp32 in
 * memory, loaded into the tiles and stored back once per step and 64 dims. The running max is
 * rescaled lazily: O and l are rescaled only when a head's max grows by more than 8 (e^8 ≈ 3000, so
 * the probabilities stay ≤ 3000, exact enough in bf16 and far from fp32's range), so most steps
 * never touch O outside the tiles. */
TGT_AMX static void latent_item_amx(const uint16_t *q, const uint16_t *kc, const int32_t *bt, int t0, int t1, int H,
                                    int Dk, int Dv, int ps, float scale, float *m, float *l, float *acc,
                                    int *nomem) {
    const int Hp = (H + 15) / 16 * 16, nb = Hp / 16, nk = Dk / 32;
    /* scratch: Q^T pair tiles [nb][nk][16 rows][16], S^T [128][Hp] fp32, P tiles [nb][4][16][16]
     * dwords, V pairs [64][Dv] dwords, O [Hp][Dv] fp32, m and l [Hp] */
    const size_t qt_n = (size_t)nb * nk * 256, s_n = (size_t)128 * Hp, p_n = (size_t)nb * 4 * 256,
                 v_n = (size_t)64 * Dv, o_n = (size_t)Hp * Dv;
    latent_scratch_t w;
    if (latent_scratch(&w, qt_n, s_n, p_n, v_n, o_n, Hp, 0, nomem)) return;
    uint32_t *qt = w.qt, *pb = w.p, *vb = w.vb;
    float *sb = w.sb, *ob = w.ob, *mr = w.mr, *lr = w.lr;
    latent_qt(q, H, Dk, nb, qt); /* row i of tile (hb, kk): dims 2(16kk + i), +1 of heads hb·16.. */
    tilecfg_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
    for (int t = t0; t < t1;) {
        const int page_end = (t / ps + 1) * ps, stop = page_end < t1 ? page_end : t1, n = stop - t;
        const int nt = (n + 15) / 16, nc = (nt + 1) / 2; /* 16-key tiles, 32-key chunks */
        const uint16_t *rows = kc + ((size_t)bt[t / ps] * ps + t % ps) * Dk;
        const int avail = page_end - t; /* rows that exist in this page from t */
        /* the next step's rows, prefetched over the score multiplies: a tile load of 16 rows 1,152 bytes
         * apart would wait on each from DRAM */
        const char *next;
        const size_t next_lines = latent_next(kc, bt, stop, t1, ps, Dk, &next);
        size_t pf_done = 0;
        const size_t pf_per = next ? (next_lines + (size_t)((nt + 3) / 4) * nb * nk - 1) / ((size_t)((nt + 3) / 4) * nb * nk) : 0;
        /* 1. S^T for up to 64 keys × 16 heads at a time: each Q^T tile (B, from L2) is loaded once for
         * four 16-row A tiles (the page's rows, from L1) */
        for (int u0 = 0; u0 < nt; u0 += 4) {
            const int n4 = nt - u0 < 4 ? nt - u0 : 4;
            for (int hb = 0; hb < nb; hb++) {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int kk = 0; kk < nk; kk++) {
                    for (size_t i = 0; i < pf_per && pf_done < next_lines; i++, pf_done++)
                        _mm_prefetch(next + pf_done * 64, _MM_HINT_T1);
                    const uint16_t *a = rows + (size_t)u0 * 16 * Dk + kk * 32;
                    _tile_loadd(6, qt + ((size_t)hb * nk + kk) * 256, 64);
                    _tile_loadd(4, a, Dk * 2);
                    _tile_dpbf16ps(0, 4, 6);
                    if (n4 > 1) {
                        _tile_loadd(5, a + (size_t)16 * Dk, Dk * 2);
                        _tile_dpbf16ps(1, 5, 6);
                    }
                    if (n4 > 2) {
                        _tile_loadd(7, a + (size_t)32 * Dk, Dk * 2);
                        _tile_dpbf16ps(2, 7, 6);
                    }
                    if (n4 > 3) {
                        _tile_loadd(4, a + (size_t)48 * Dk, Dk * 2);
                        _tile_dpbf16ps(3, 4, 6);
                    }
                }
                float *st = sb + (size_t)u0 * 16 * Hp + hb * 16;
                _tile_stored(0, st, Hp * 4);
                if (n4 > 1) _tile_stored(1, st + (size_t)16 * Hp, Hp * 4);
                if (n4 > 2) _tile_stored(2, st + (size_t)32 * Hp, Hp * 4);
                if (n4 > 3) _tile_stored(3, st + (size_t)48 * Hp, Hp * 4);
            }
        }
        /* 2. the online softmax; P to the A tiles [nb][4 chunks][16 heads][16 pairs] */
        latent_softmax(nb, n, Hp, Dv, sb, scale, mr, lr, ob, pb, 256, 16);
        /* 3. V in key pairs [kp][Dv][2] */
        latent_v_pairs(nc * 16, avail, rows, Dk, Dv, vb);
        /* 4. O [64 heads, 16 dims] += P · V through the tiles once per step: each V tile (B, from L2)
         * is loaded once for four head blocks' P tiles (A, from L1) */
        for (int db = 0; db < Dv / 16; db++)
            for (int h0 = 0; h0 < nb; h0 += 4) {
                const int n4 = nb - h0 < 4 ? nb - h0 : 4;
                float *o = ob + (size_t)h0 * 16 * Dv + db * 16;
                _tile_loadd(0, o, Dv * 4);
                if (n4 > 1) _tile_loadd(1, o + (size_t)16 * Dv, Dv * 4);
                if (n4 > 2) _tile_loadd(2, o + (size_t)32 * Dv, Dv * 4);
                if (n4 > 3) _tile_loadd(3, o + (size_t)48 * Dv, Dv * 4);
                for (int c = 0; c < nc; c++) {
                    const uint32_t *pp = pb + ((size_t)h0 * 4 + c) * 256; /* head block h0 + j: + j · 1024 */
                    _tile_loadd(6, vb + (size_t)c * 16 * Dv + db * 16, Dv * 4);
                    _tile_loadd(4, pp, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    if (n4 > 1) {
                        _tile_loadd(5, pp + 1024, 64);
                        _tile_dpbf16ps(1, 5, 6);
                    }
                    if (n4 > 2) {
                        _tile_loadd(7, pp + 2048, 64);
                        _tile_dpbf16ps(2, 7, 6);
                    }
                    if (n4 > 3) {
                        _tile_loadd(4, pp + 3072, 64);
                        _tile_dpbf16ps(3, 4, 6);
                    }
                }
                _tile_stored(0, o, Dv * 4);
                if (n4 > 1) _tile_stored(1, o + (size_t)16 * Dv, Dv * 4);
                if (n4 > 2) _tile_stored(2, o + (size_t)32 * Dv, Dv * 4);
                if (n4 > 3) _tile_stored(3, o + (size_t)48 * Dv, Dv * 4);
            }
        t = stop;
    }
    _tile_release();
    latent_result(H, Dv, mr, lr, ob, m, l, acc);
    free(qt);
}
#endif

#endif
