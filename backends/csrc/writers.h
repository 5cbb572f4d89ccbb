/* writers.h — the cache writers: new tokens' K/V rows into the layer's pages (cpu_decode_write, for the
 * fp32 / fp16 / bf16 tiles) and quantised to e4m3 with a scale per row into an fp8 cache
 * (cpu_decode_write_fp8), each taking a cpu_decode_write_args (common.h).
 *
 * Contents, in order:
 *   row_place                  where a new row comes from and where it goes (both writers)
 *   cpu_decode_write           scatter each row into its tile (K in the VNNI order, V transposed)
 *   load_row                   a row in any dtype as floats
 *   row_scale, nonfinite_row   a row's scale from its largest |x|; a row holding NaN or inf
 *   quantise_row               a row's e4m3 bytes and scale in plain C
 *   quantise_row_avx512        the same bytes and scale, 16 lanes at a time
 *   scatter_k, scatter_v       a row's bytes into its tile (fp8_phys of the bf16 tile order)
 *   cpu_decode_write_fp8       quantise and scatter each row, counting the non-finite ones
 */
#ifndef CPU_DECODE_WRITERS_H
#define CPU_DECODE_WRITERS_H

/* Where new row (b, j, h) — token positions[b] + j of sequence b, KV head h — comes from and goes:
 * src, its first element in k and v [B, T, Hkv, D]; tile, its 16-key tile's first element in the cache
 * (2 · the tile_offset of the kernel: K and V tiles alternate); j16, its slot in the tile; so, its scale
 * index in [pages, Hkv, ps] (fp8 caches) */
typedef struct {
    size_t src, tile, j16, so;
} row_place_t;

static inline row_place_t row_place(const cpu_decode_write_args *a, int b, int j, int h) {
    const int Hkv = a->num_kv_heads, D = a->head_dim, ps = a->page_size;
    const int t = a->positions[b] + j, page = a->block_table[(size_t)b * a->max_pages + t / ps], slot = t % ps;
    const row_place_t r = {
        .src = (((size_t)b * a->max_new + j) * Hkv + h) * D,
        .tile = 2 * (((size_t)page * Hkv + h) * ps * D + (size_t)(slot / TILE) * TILE * D),
        .j16 = (size_t)(slot % TILE),
        .so = ((size_t)page * Hkv + h) * ps + slot,
    };
    return r;
}

/* Write new tokens: k, v [B, T, Hkv, D] (T = max_new; right-padded: row j of sequence b is real for
 * j < num_new[b]) at positions[b] + j, into the layer's pages (cpu_decode.c's layout; k_cache and
 * v_cache as the kernel takes them). pair: P; elem_size: bytes per element (2 or 4). The scales,
 * dtype and isa are not read. */
int cpu_decode_write(const cpu_decode_write_args *a) {
    if (!a) return -1;
    void *kc = a->k_cache, *vc = a->v_cache;
    const void *k = a->k, *v = a->v;
    const int D = a->head_dim, P = a->pair, esize = a->elem_size;
    if (P < 1 || D % P || a->page_size % TILE || (esize != 2 && esize != 4)) return -1;
    for (int b = 0; b < a->num_seqs; b++) {
        for (int j = 0; j < a->num_new[b]; j++) {
            for (int h = 0; h < a->num_kv_heads; h++) {
                const row_place_t r = row_place(a, b, j, h);
                const size_t vt = r.tile + (r.j16 / P) * D * P + r.j16 % P;
                /* K: the P values d .. d+P-1 of slot j16 are adjacent, one run every 16·P elements;
                 * V: value d at vt + d·P */
                const char *ks = (const char *)k + r.src * esize, *vs = (const char *)v + r.src * esize;
                char *kd = (char *)kc + (r.tile + r.j16 * P) * esize, *vd = (char *)vc + vt * esize;
                for (int d = 0; d < D; d += P)
                    memcpy(kd + (size_t)d * TILE * esize, ks + (size_t)d * esize, (size_t)P * esize);
                if (esize == 2)
                    for (int d = 0; d < D; d++) ((uint16_t *)vd)[(size_t)d * P] = ((const uint16_t *)vs)[d];
                else
                    for (int d = 0; d < D; d++) ((float *)vd)[(size_t)d * P] = ((const float *)vs)[d];
            }
        }
    }
    return 0;
}

/* D values of p from element off, in dt, to floats: one loop per dtype, so that each vectorises */
static void load_row(const void *p, size_t off, int dt, float *row, int D) {
    if (dt == DT_F32) {
        memcpy(row, (const float *)p + off, sizeof(float) * (size_t)D);
    } else if (dt == DT_BF16) {
        const uint16_t *h = (const uint16_t *)p + off;
        for (int d = 0; d < D; d++) row[d] = bf16_to_f32(h[d]);
    } else {
        const uint16_t *h = (const uint16_t *)p + off;
        for (int d = 0; d < D; d++) row[d] = f16_to_f32(h[d]);
    }
}

/* The scale of a row whose largest |x| bit pattern is umax: amax / 448, at least the smallest normal
 * float; 0 when the row holds NaN or inf (its bit pattern lies at or above inf's) */
static inline float row_scale(uint32_t umax) {
    const float tiny = 1.17549435e-38f;
    if (umax >= 0x7f800000u) return 0.0f;
    float amax;
    memcpy(&amax, &umax, 4);
    float s = amax / 448.0f;
    return s >= tiny ? s : tiny;
}

/* a row holding NaN or inf: stored as zeros with the smallest scale, and counted */
static float nonfinite_row(uint8_t *q, int D, int *bad) {
    memset(q, 0, (size_t)D);
    *bad += 1;
    return 1.17549435e-38f;
}

/* One row's e4m3 bytes (row / scale, scale = amax(|row|) / 448, at least the smallest normal float)
 * and its scale, as attnbench.kernels.fp8_cache.quantize computes them; a row holding NaN or inf is
 * stored as zeros with the smallest scale and counted in *bad. The e4m3 rounding is to nearest even,
 * subnormals included (torch's conversion). Branch-free, so that both loops vectorise: amax is the
 * largest |x| bit pattern (ordered as the floats are; NaN's lie above inf's), and both cases of the
 * rounding are computed and one selected. */
static float quantise_row(const float *row, uint8_t *q, int D, int *bad) {
    uint32_t umax = 0;
    for (int d = 0; d < D; d++) {
        uint32_t u;
        memcpy(&u, row + d, 4);
        u &= 0x7fffffffu;
        umax = u > umax ? u : umax;
    }
    const float s = row_scale(umax);
    if (s == 0.0f) return nonfinite_row(q, D, bad);
    for (int d = 0; d < D; d++) {
        float x = row[d] / s;
        x = x > 448.0f ? 448.0f : x;
        x = x < -448.0f ? -448.0f : x;
        uint32_t u;
        memcpy(&u, &x, 4);
        uint32_t sign = (u >> 24) & 0x80u, ua = u & 0x7fffffffu;
        float a;
        memcpy(&a, &ua, 4);
        /* below 2^-6: m · 2^-9, m = a · 512 rounded to nearest even by adding and removing 2^23 */
        int32_t sub = (int32_t)((a * 512.0f + 8388608.0f) - 8388608.0f);
        uint32_t norm = ((ua + 0x7ffffu + ((ua >> 20) & 1u)) >> 20) - (120u << 3);
        q[d] = (uint8_t)(sign | (a < 0.015625f ? (uint32_t)sub : norm));
    }
    return s;
}

#ifdef CPU_DECODE_AVX512
/* quantise_row in 16 lanes: the same bytes and scale (the division is IEEE's in both; cvtps2dq rounds
 * a · 512 to nearest even as the scalar's 2^23 trick does) */
TGT static float quantise_row_avx512(const float *row, uint8_t *q, int D, int *bad) {
    const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
    __m512i mx = _mm512_setzero_si512();
    for (int d = 0; d < D; d += 16)
        mx = _mm512_max_epu32(mx, _mm512_and_si512(_mm512_loadu_si512(row + d), abs_mask));
    const float s = row_scale((uint32_t)_mm512_reduce_max_epu32(mx));
    if (s == 0.0f) return nonfinite_row(q, D, bad);
    const __m512 vs = _mm512_set1_ps(s), hi = _mm512_set1_ps(448.0f), lo = _mm512_set1_ps(-448.0f);
    const __m512i sign_bit = _mm512_set1_epi32((int)0x80000000u), half = _mm512_set1_epi32(0x7ffff);
    const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(120 << 3);
    for (int d = 0; d < D; d += 16) {
        __m512 x = _mm512_max_ps(_mm512_min_ps(_mm512_div_ps(_mm512_loadu_ps(row + d), vs), hi), lo);
        __m512i u = _mm512_castps_si512(x), ua = _mm512_and_si512(u, abs_mask);
        __m512 a = _mm512_castsi512_ps(ua);
        __m512i sub = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(512.0f)));
        __m512i up = _mm512_add_epi32(_mm512_add_epi32(ua, half), _mm512_and_si512(_mm512_srli_epi32(ua, 20), one));
        __m512i norm = _mm512_sub_epi32(_mm512_srli_epi32(up, 20), bias);
        __mmask16 small = _mm512_cmp_ps_mask(a, _mm512_set1_ps(0.015625f), _CMP_LT_OQ);
        __m512i mag = _mm512_mask_blend_epi32(small, norm, sub);
        __m512i byte = _mm512_or_si512(mag, _mm512_srli_epi32(_mm512_and_si512(u, sign_bit), 24));
        _mm_storeu_si128((__m128i *)(q + d), _mm512_cvtepi32_epi8(byte));
    }
    return s;
}
#endif

/* One row's bytes into its tile (fp8_phys of the bf16 tile order, spelled out): K's values 4m .. 4m+3
 * of slot j16 are the 4 bytes at 64m + 4·j16, in the order 4m, 4m+2, 4m+1, 4m+3; V's values 32c + r
 * and 32c + 16 + r of slot j16 are the 2 bytes at (j16/2)·2D + 64c + 4r + 2·(j16 % 2). */
static void scatter_k(uint8_t *tile, const uint8_t *q, size_t j16, int D) {
    for (int m = 0; m < D / 4; m++) {
        const uint8_t *x = q + 4 * m;
        uint8_t w[4] = {x[0], x[2], x[1], x[3]};
        memcpy(tile + 64 * (size_t)m + 4 * j16, w, 4);
    }
}

static void scatter_v(uint8_t *tile, const uint8_t *q, size_t j16, int D) {
    uint8_t *base = tile + (j16 / 2) * 2 * (size_t)D + 2 * (j16 % 2);
    for (int c = 0; c < D / 32; c++)
        for (int r = 0; r < 16; r++) {
            uint8_t w[2] = {q[32 * c + r], q[32 * c + 16 + r]};
            memcpy(base + 64 * (size_t)c + 4 * (size_t)r, w, 2);
        }
}

/* Quantise and write new tokens into an fp8 cache: k, v [B, T, Hkv, D] in dtype (right-padded, as for
 * cpu_decode_write), each row stored as e4m3 bytes of row / scale with scale = amax(|row|) / 448 (the
 * smallest normal float where that is 0), exactly as attnbench.kernels.fp8_cache.quantize does; k_cache,
 * v_cache as cpu_decode_attend_fp8 takes them, k_scales, v_scales the layer's scales. A row holding NaN
 * or inf is stored as zeros. isa: the cache's variant; ISA_AVX512 and up quantise 16 values at a time,
 * below in plain C (the same bytes). pair and elem_size are not read. Returns the number of such rows
 * (0: all finite), ERR_NOMEM when its row buffer is refused (nothing written), or another negative code
 * for bad arguments. */
int cpu_decode_write_fp8(const cpu_decode_write_args *a) {
    if (!a || !a->k_scales || !a->v_scales) return -1;
    uint8_t *kc = (uint8_t *)a->k_cache, *vc = (uint8_t *)a->v_cache;
    float *ksc = a->k_scales, *vsc = a->v_scales;
    const void *k = a->k, *v = a->v;
    const int D = a->head_dim, dt = a->dtype;
    if (D % 32 || a->page_size % TILE || dt < DT_F32 || dt > DT_BF16) return -1;
    float (*quantise)(const float *, uint8_t *, int, int *) = quantise_row;
#ifdef CPU_DECODE_AVX512
    if (a->isa >= ISA_AVX512) quantise = quantise_row_avx512; /* c-avx512, c-avx512bf16, c-amx */
#endif
    int bad = 0;
    float *row = (float *)scratch(sizeof(float) * (size_t)D + (size_t)D);
    if (!row) return ERR_NOMEM;
    uint8_t *bytes = (uint8_t *)(row + D);
    for (int b = 0; b < a->num_seqs; b++) {
        for (int j = 0; j < a->num_new[b]; j++) {
            for (int h = 0; h < a->num_kv_heads; h++) {
                const row_place_t r = row_place(a, b, j, h);
                load_row(k, r.src, dt, row, D);
                ksc[r.so] = quantise(row, bytes, D, &bad);
                scatter_k(kc + r.tile, bytes, r.j16, D);
                load_row(v, r.src, dt, row, D);
                vsc[r.so] = quantise(row, bytes, D, &bad);
                scatter_v(vc + r.tile, bytes, r.j16, D);
            }
        }
    }
    free(row);
    return bad;
}
#endif
