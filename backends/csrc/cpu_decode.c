/* cpu_decode — paged decode attention for CPUs, called from backends/cpu_decode.py through ctypes.
 *
 * Cache layout (one layer; element type T = fp32, fp16 or bf16; P = 2 for bf16, else 1): 16-key
 * tiles, each tile's K followed by its V, one KV head's tiles of one page after each other:
 *   [pages, Hkv, page_size / 16, { K: [D / P, 16, P],  V: [16 / P, D, P] }]
 * (K: P adjacent dims of each key side by side, the VNNI order; V: P adjacent keys of each dim side
 * by side). The kernel takes kc = the layer's first element and vc = kc + 16 · D elements, and finds
 * a tile's K at kc + tile_offset and its V at vc + tile_offset. One page of one KV head is one
 * contiguous run of 2 · page_size · D elements, read front to back: one stream per item rather than
 * separate K and V pages, which one core reads from DRAM faster. With P = 2 one 64-byte
 * row of a K tile is 16 keys × 2 dims and one of V is 16 dims × 2 keys: exactly the operands of
 * vdpbf16ps, so neither q·k nor p·v needs a shuffle or a horizontal sum.
 *
 * Work: one item per (sequence, KV head, KV split). An item walks its tokens in 16-key tiles:
 * scores for every query head of the GQA group (each K row is loaded once for up to 4 heads), an
 * online-softmax update in fp32, and p·v accumulated in fp32. With one split an item writes the
 * normalised output; with more, each writes (m, l, acc) to the workspace and a merge combines them.
 *
 * ISA variants: ISA_AVX512BF16 (bf16 caches: q·k and p·v with vdpbf16ps, p rounded to bf16 for p·v,
 * as flash attention does), ISA_AVX512 (fp32 and fp16 caches: vfmadd231ps, fp16 widened with
 * vcvtph2ps), ISA_AVX2 (any dtype on AVX2 + FMA + F16C: 8-lane vfmadd231ps in fp32; a 32-byte load of
 * a bf16 K row is 8 keys × 2 dims, of a V row 8 dims × 2 keys, widened by a shift and a mask; p kept
 * in fp32) and ISA_SCALAR (any dtype, plain C; p kept in fp32). The AVX-512 and AVX2 code is compiled
 * with target attributes, so the file builds with any x86-64 compiler flags; cpu_decode_isa() says
 * the best variant the running CPU supports (the numbering is ordered: a CPU that runs one variant
 * runs those below it, for the dtypes each takes).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#define CPU_DECODE_X86 1
#define INLINE static inline __attribute__((always_inline))
#if !defined(CPU_DECODE_NO_AVX512)
#define CPU_DECODE_AVX512 1
#if defined(CPU_DECODE_AMX_EMULATE) || (defined(__clang__) ? (__clang_major__ >= 12) : (__GNUC__ >= 11))
#define CPU_DECODE_AMX 1 /* the AMX items: the compiler's intrinsics, or amx_emu.h's emulation */
#endif
#endif
#endif

enum { DT_F32 = 0, DT_F16 = 1, DT_BF16 = 2 };
/* ordered: a CPU that runs one variant runs every variant below it (for the dtypes each takes) */
enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AVX512BF16 = 3 };
/* fp8 caches only: AMX tile multiplies (with ISA_AVX512BF16's exact conversions), GQA groups up to 16;
 * ISA_FP8_SHIFT: ISA_AVX512BF16 with the shift conversion (fp8x64's CV_SHIFT) in place of the lookups */
enum { ISA_AMX = 4, ISA_FP8_SHIFT = 5 };
#define TILE 16
#define MAX_G 64
#define MAX_SPLITS 16 /* KV splits per sequence (cpu_decode.py's MAX_SPLITS: the workspace is sized for them) */

int cpu_decode_abi(void) { return 7; }

/* ---- scratch memory ----------------------------------------------------------------------------
 * Every buffer a kernel allocates comes from scratch() (64-byte aligned, its size rounded up to that);
 * when one is refused, the item flags it (flag_nomem) and the entry point returns ERR_NOMEM instead of
 * writing through a null pointer. cpu_decode_fail_alloc(n) makes the n-th allocation from now fail
 * once (for tests, which take that path on purpose; -1, the default: never). */
#define ERR_NOMEM (-4)
static int fail_alloc = -1;
int cpu_decode_fail_alloc(int n) {
    __atomic_store_n(&fail_alloc, n, __ATOMIC_SEQ_CST);
    return 0;
}
#if defined(__SANITIZE_ADDRESS__) /* gcc */
#define CPU_DECODE_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) /* clang */
#define CPU_DECODE_ASAN 1
#endif
#endif
static void *scratch(size_t bytes) {
    if (__atomic_load_n(&fail_alloc, __ATOMIC_RELAXED) >= 0 && __atomic_fetch_sub(&fail_alloc, 1, __ATOMIC_RELAXED) == 0)
        return NULL;
#ifdef CPU_DECODE_ASAN /* the exact size, so that AddressSanitizer reports a read one byte past it */
    void *p = NULL;
    return posix_memalign(&p, 64, bytes ? bytes : 1) == 0 ? p : NULL;
#else
    return aligned_alloc(64, (bytes + 63) & ~(size_t)63);
#endif
}
static void flag_nomem(int *nomem) { __atomic_store_n(nomem, 1, __ATOMIC_RELAXED); }

/* the best variant the running CPU (and OS) supports */
int cpu_decode_isa(void) {
#ifdef CPU_DECODE_X86
    __builtin_cpu_init();
#ifdef CPU_DECODE_AVX512
    int f = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
    if (f && __builtin_cpu_supports("avx512bf16")) return ISA_AVX512BF16;
    if (f) return ISA_AVX512;
#endif
    unsigned a, b, c, d; /* F16C from CPUID leaf 1 (not every compiler's __builtin_cpu_supports names it) */
    int f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
    if (f16c && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return ISA_AVX2;
#endif
    return ISA_SCALAR;
}

#ifdef CPU_DECODE_AMX
static int amx_request(void);
#else
static int amx_request(void) { return 0; }
int cpu_decode_amx_emulated(void) { return 0; }
#endif

/* The best variant for fp8 caches: 2 (c-amx: AMX tiles, granted by the OS here), 1 (c-avx512bf16: its
 * byte lookups need AVX512_VBMI), 0 (plain C only) */
int cpu_decode_fp8_fast(void) {
#ifdef CPU_DECODE_AVX512
    __builtin_cpu_init();
    if (cpu_decode_isa() != ISA_AVX512BF16 || !__builtin_cpu_supports("avx512vbmi")) return 0;
    return amx_request() ? 2 : 1;
#else
    return 0;
#endif
}

/* ---- scalar conversions ------------------------------------------------------------------------ */
static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, u;
    float f;
    if (e == 0) {
        f = ldexpf((float)m, -24);
        return sign ? -f : f;
    }
    u = e == 31 ? (sign | 0x7f800000u | (m << 13)) : (sign | ((e + 112u) << 23) | (m << 13));
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_f16(float f) {
    uint32_t x, sign, ax, r, rem;
    memcpy(&x, &f, 4);
    sign = (x >> 16) & 0x8000u;
    ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);
    if (ax < 0x38800000u) {
        float a;
        memcpy(&a, &ax, 4);
        return (uint16_t)(sign | (uint32_t)lrintf(a * 16777216.0f));
    }
    r = (((ax >> 23) - 112u) << 10) + ((ax >> 13) & 0x3ffu);
    rem = ax & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) r++;
    return (uint16_t)(sign | r);
}

static inline float load_elem(const void *p, size_t i, int dt) {
    if (dt == DT_F32) return ((const float *)p)[i];
    if (dt == DT_F16) return f16_to_f32(((const uint16_t *)p)[i]);
    return bf16_to_f32(((const uint16_t *)p)[i]);
}

static inline void store_elem(void *p, size_t i, int dt, float x) {
    if (dt == DT_F32)
        ((float *)p)[i] = x;
    else if (dt == DT_F16)
        ((uint16_t *)p)[i] = f32_to_f16(x);
    else
        ((uint16_t *)p)[i] = f32_to_bf16(x);
}

/* ---- what one work item sees ------------------------------------------------------------------- */
typedef struct {
    const void *q;      /* [G, D] query heads of this KV head */
    const void *kc;     /* layer's K pages */
    const void *vc;     /* layer's V pages */
    const int32_t *bt;  /* block table row of this sequence */
    int t0, t1;         /* token range, t0 a multiple of 16 */
    int G, D, ps, P, Hkv, h, dt;
    int prefetch;       /* tiles ahead to prefetch into L2 (0: none) */
    float scale;
    float *m, *l, *acc; /* [G], [G], [G, D] out: running max, sum, unnormalised p·v */
    float *lv;          /* [G, 16] the running sum per lane (bf16 items; reduced into l at the end) */
    const float *ks, *vs; /* fp8 caches: the layer's per token-head scales [pages, Hkv, ps]; else NULL */
    int *nomem;           /* set to 1 when the item's scratch is refused (the call then returns ERR_NOMEM) */
} item_t;

/* the offset of the tile holding token t (a multiple of 16) from kc for its K, from vc for its V */
static inline size_t tile_offset(const item_t *it, int t) {
    int page = it->bt[t / it->ps], slot = t % it->ps;
    return 2 * (((size_t)page * it->Hkv + it->h) * it->ps * it->D + (size_t)slot * it->D);
}

/* ---- fp8 e4m3 K/V (cpu_decode_fp8) ---------------------------------------------------------------
 * Bytes in the bf16 tile order (K [D/2, 16, 2], V [8, D, 2]), except that within each aligned
 * 64-byte block the two 32-value rows are interleaved byte by byte (fp8_phys: row 0 in the even bytes,
 * row 1 in the odd ones): one 64-byte load holds 32 16-bit lanes, each with row 0's value in its low
 * byte and row 1's in its high byte, so shifts within the lanes give both rows as bf16 in order.
 * A per token-head float32 scale multiplies the score (K) and the probability (V), never the values. */
static inline size_t fp8_phys(size_t L) { return (L & ~(size_t)63) | ((L & 31) << 1) | ((L >> 5) & 1); }

/* the scale index of token t (its page's slot) in [pages, Hkv, ps] */
static inline size_t scale_offset(const item_t *it, int t) {
    int page = it->bt[t / it->ps], slot = t % it->ps;
    return ((size_t)page * it->Hkv + it->h) * it->ps + slot;
}

static inline float e4m3_to_f32(uint8_t b) {
    int e = (b >> 3) & 15, m = b & 7;
    float v = e ? ldexpf(1.0f + (float)m / 8.0f, e - 7) : ldexpf((float)m, -9);
    return (b & 0x80) ? -v : v;
}

/* bf16 bits of every e4m3 magnitude (0..127), low and high bytes: the tables of the byte lookups */
static uint8_t FP8_LO[128] __attribute__((aligned(64))), FP8_HI[128] __attribute__((aligned(64)));

__attribute__((constructor)) static void fp8_tables(void) {
    for (int m = 0; m < 128; m++) {
        uint16_t h = f32_to_bf16(e4m3_to_f32((uint8_t)m));
        FP8_LO[m] = (uint8_t)(h & 0xff);
        FP8_HI[m] = (uint8_t)(h >> 8);
    }
}

static void item_scalar_fp8(const item_t *it) {
    const int G = it->G, D = it->D, dt = it->dt;
    const uint8_t *kc = (const uint8_t *)it->kc, *vc = (const uint8_t *)it->vc;
    float s[TILE], ksc[TILE], vsc[TILE];
    float *qv = (float *)scratch(sizeof(float) * ((size_t)G + 1) * D), *tmp = qv + (size_t)G * D;
    if (!qv) {
        flag_nomem(it->nomem);
        return;
    }
    for (int i = 0; i < G * D; i++) qv[i] = load_elem(it->q, (size_t)i, dt);
    for (int g = 0; g < G; g++) {
        it->m[g] = -INFINITY;
        it->l[g] = 0.0f;
    }
    memset(it->acc, 0, sizeof(float) * (size_t)G * D);
    for (int t = it->t0; t < it->t1; t += TILE) {
        int n = it->t1 - t < TILE ? it->t1 - t : TILE;
        size_t base = tile_offset(it, t), so = scale_offset(it, t);
        for (int j = 0; j < n; j++) {
            ksc[j] = it->ks[so + j];
            vsc[j] = it->vs[so + j];
        }
        for (int g = 0; g < G; g++) {
            const float *qg = qv + (size_t)g * D;
            float mt = -INFINITY;
            for (int j = 0; j < n; j++) {
                float a = 0.0f;
                for (int d = 0; d < D; d++)
                    a += qg[d] * e4m3_to_f32(kc[base + fp8_phys(((size_t)(d / 2) * TILE + j) * 2 + d % 2)]);
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
                for (int d = 0; d < D; d++)
                    tmp[d] += w * e4m3_to_f32(vc[base + fp8_phys(((size_t)(j / 2) * D + d) * 2 + j % 2)]);
            }
            for (int d = 0; d < D; d++) acc[d] = acc[d] * alpha + tmp[d];
            it->l[g] = it->l[g] * alpha + sum;
            it->m[g] = mn;
        }
    }
    free(qv);
}

static void item_scalar(const item_t *it) {
    const int G = it->G, D = it->D, P = it->P, dt = it->dt;
    float s[TILE];
    float *qv = (float *)scratch(sizeof(float) * ((size_t)G + 1) * D), *tmp = qv + (size_t)G * D;
    if (!qv) {
        flag_nomem(it->nomem);
        return;
    }
    for (int i = 0; i < G * D; i++) qv[i] = load_elem(it->q, (size_t)i, dt);
    for (int g = 0; g < G; g++) {
        it->m[g] = -INFINITY;
        it->l[g] = 0.0f;
    }
    memset(it->acc, 0, sizeof(float) * (size_t)G * D);
    for (int t = it->t0; t < it->t1; t += TILE) {
        int n = it->t1 - t < TILE ? it->t1 - t : TILE;
        size_t base = tile_offset(it, t);
        for (int g = 0; g < G; g++) {
            const float *qg = qv + (size_t)g * D;
            float mt = -INFINITY;
            for (int j = 0; j < n; j++) {
                float a = 0.0f;
                for (int d = 0; d < D; d++)
                    a += qg[d] * load_elem(it->kc, base + ((size_t)(d / P) * TILE + j) * P + d % P, dt);
                s[j] = a * it->scale;
                if (s[j] > mt) mt = s[j];
            }
            float mn = mt > it->m[g] ? mt : it->m[g];
            float alpha = expf(it->m[g] - mn), sum = 0.0f;
            float *acc = it->acc + (size_t)g * D;
            for (int d = 0; d < D; d++) tmp[d] = 0.0f;
            for (int j = 0; j < n; j++) {
                float p = expf(s[j] - mn);
                sum += p;
                for (int d = 0; d < D; d++)
                    tmp[d] += p * load_elem(it->vc, base + ((size_t)(j / P) * D + d) * P + j % P, dt);
            }
            for (int d = 0; d < D; d++) acc[d] = acc[d] * alpha + tmp[d]; /* one addition per tile */
            it->l[g] = it->l[g] * alpha + sum;
            it->m[g] = mn;
        }
    }
    free(qv);
}

#ifdef CPU_DECODE_X86
/* ---- AVX2 + FMA + F16C: bf16, fp16 and fp32 caches ----------------------------------------------
 * The same layout, item walk, online softmax and merge as the AVX-512 code; 8-lane vectors, and no
 * bf16 dot product: a bf16 pair is widened by its position in a 32-bit lane (low half << 16, high
 * half & 0xffff0000), so one 32-byte load of a bf16 K row is 8 keys × 2 dims (two FMAs per head)
 * and one of a V row 8 dims × 2 keys. The probabilities stay in fp32 for p·v in every dtype (as in
 * the scalar code; no bf16 rounding of P). AVX2 has 16 registers and no embedded broadcast, so a
 * step's scores pass through a small buffer on the stack, and the operands an FMA broadcasts — q
 * (once per item) and p (once per step) — are stored broadcast to 8 lanes and read as plain loads. */
#define TGT2 __attribute__((target("avx2,fma,f16c")))

/* e^x for x ≤ 0 of n ≤ 4 vectors in place: exp512n's evaluation on 8 lanes */
TGT2 INLINE void exp256n(int n, __m256 *x) {
    const __m256 magic = _mm256_set1_ps(12582912.0f);
    __m256 t[4], r[4], p[4];
    for (int i = 0; i < n; i++) {
        x[i] = _mm256_max_ps(x[i], _mm256_set1_ps(-87.0f));
        t[i] = _mm256_fmadd_ps(x[i], _mm256_set1_ps(1.44269504088896341f), magic);
    }
    for (int i = 0; i < n; i++) r[i] = _mm256_fnmadd_ps(_mm256_sub_ps(t[i], magic), _mm256_set1_ps(0.693359375f), x[i]);
    for (int i = 0; i < n; i++) r[i] = _mm256_fnmadd_ps(_mm256_sub_ps(t[i], magic), _mm256_set1_ps(-2.12194440e-4f), r[i]);
    for (int i = 0; i < n; i++) p[i] = _mm256_fmadd_ps(_mm256_set1_ps(1.0f / 5040.0f), r[i], _mm256_set1_ps(1.0f / 720.0f));
    for (int i = 0; i < n; i++) p[i] = _mm256_fmadd_ps(p[i], r[i], _mm256_set1_ps(1.0f / 120.0f));
    for (int i = 0; i < n; i++) p[i] = _mm256_fmadd_ps(p[i], r[i], _mm256_set1_ps(1.0f / 24.0f));
    for (int i = 0; i < n; i++) p[i] = _mm256_fmadd_ps(p[i], r[i], _mm256_set1_ps(1.0f / 6.0f));
    for (int i = 0; i < n; i++) p[i] = _mm256_fmadd_ps(p[i], r[i], _mm256_set1_ps(0.5f));
    for (int i = 0; i < n; i++) p[i] = _mm256_fmadd_ps(p[i], r[i], _mm256_set1_ps(1.0f));
    for (int i = 0; i < n; i++) p[i] = _mm256_fmadd_ps(p[i], r[i], _mm256_set1_ps(1.0f));
    for (int i = 0; i < n; i++) {
        __m256i e = _mm256_sub_epi32(_mm256_castps_si256(t[i]), _mm256_castps_si256(magic));
        e = _mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23);
        x[i] = _mm256_mul_ps(p[i], _mm256_castsi256_ps(e));
    }
}

/* 8 fp32 or fp16 elements from p + i as fp32 */
TGT2 INLINE __m256 load8(int dt, const void *p, size_t i) {
    if (dt == DT_F32) return _mm256_loadu_ps((const float *)p + i);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
}

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
            _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_loadu_ps(o), _mm256_set1_ps(alpha[g]), x));
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
    for (int g = 0; g < G; g++) {
        it->m[g] = -INFINITY;
        it->l[g] = 0.0f;
    }
    memset(lv, 0, sizeof(float) * 8 * (size_t)G);
    memset(it->acc, 0, sizeof(float) * (size_t)G * D);
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
            switch (G - g0 < 4 ? G - g0 : 4) {
                case 4: AVX2_STEP(4); break;
                case 3: AVX2_STEP(3); break;
                case 2: AVX2_STEP(2); break;
                default: AVX2_STEP(1); break;
            }
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
#define TGT __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))
#define TGT_BF16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))

/* e^x for x ≤ 0 of n ≤ 6 vectors in place (Cephes' range reduction, degree-7 Taylor on |r| ≤ ln2/2:
 * < 1e-8 relative; x·log2(e) is rounded and 2^n formed with integer arithmetic on the float bits, as
 * adding 1.5·2^23 leaves the integer in the low mantissa bits). The steps of the n evaluations are
 * interleaved: each is a chain of dependent operations, and one chain after another would leave the
 * core waiting on each (in the bf16 softmax that waiting was half of a step's time) */
TGT INLINE void exp512n(int n, __m512 *x) {
    const __m512 magic = _mm512_set1_ps(12582912.0f);
    __m512 t[6], r[6], p[6];
    for (int i = 0; i < n; i++) {
        x[i] = _mm512_max_ps(x[i], _mm512_set1_ps(-87.0f));
        t[i] = _mm512_fmadd_ps(x[i], _mm512_set1_ps(1.44269504088896341f), magic);
    }
    for (int i = 0; i < n; i++) r[i] = _mm512_fnmadd_ps(_mm512_sub_ps(t[i], magic), _mm512_set1_ps(0.693359375f), x[i]);
    for (int i = 0; i < n; i++) r[i] = _mm512_fnmadd_ps(_mm512_sub_ps(t[i], magic), _mm512_set1_ps(-2.12194440e-4f), r[i]);
    for (int i = 0; i < n; i++) p[i] = _mm512_fmadd_ps(_mm512_set1_ps(1.0f / 5040.0f), r[i], _mm512_set1_ps(1.0f / 720.0f));
    for (int i = 0; i < n; i++) p[i] = _mm512_fmadd_ps(p[i], r[i], _mm512_set1_ps(1.0f / 120.0f));
    for (int i = 0; i < n; i++) p[i] = _mm512_fmadd_ps(p[i], r[i], _mm512_set1_ps(1.0f / 24.0f));
    for (int i = 0; i < n; i++) p[i] = _mm512_fmadd_ps(p[i], r[i], _mm512_set1_ps(1.0f / 6.0f));
    for (int i = 0; i < n; i++) p[i] = _mm512_fmadd_ps(p[i], r[i], _mm512_set1_ps(0.5f));
    for (int i = 0; i < n; i++) p[i] = _mm512_fmadd_ps(p[i], r[i], _mm512_set1_ps(1.0f));
    for (int i = 0; i < n; i++) p[i] = _mm512_fmadd_ps(p[i], r[i], _mm512_set1_ps(1.0f));
    for (int i = 0; i < n; i++) {
        __m512i e = _mm512_sub_epi32(_mm512_castps_si512(t[i]), _mm512_castps_si512(magic));
        e = _mm512_slli_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(127)), 23);
        x[i] = _mm512_mul_ps(p[i], _mm512_castsi512_ps(e));
    }
}

TGT INLINE __m512 exp512(__m512 x) {
    exp512n(1, &x);
    return x;
}

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

TGT INLINE void prefetch_tile(const char *p, size_t bytes) {
    for (size_t i = 0; i < bytes; i += 64) _mm_prefetch(p + i, _MM_HINT_T2);
}

/* -- bf16: vdpbf16ps --------------------------------------------------------------------------- */
/* acc += dot of bf16 pairs of x with the pair at b broadcast to every lane; the broadcast is the
 * instruction's embedded {1to16} memory operand (a load, no shuffle), which compilers do not form
 * from _mm512_set1_epi32 here */
TGT_BF16 INLINE __m512 dp_bcast(__m512 acc, __m512i x, const uint32_t *b) {
    __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(x), "m"(*b));
    return acc;
}

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
            _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_loadu_ps(o), alpha[g], a[g][u]));
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

/* -- fp32 / fp16: vfmadd231ps ------------------------------------------------------------------ */
TGT INLINE __m512 load16(const void *p, size_t i, int dt) {
    if (dt == DT_F32) return _mm512_loadu_ps((const float *)p + i);
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)));
}

TGT INLINE void pv_f32(int gn, int nu, int dt, const void *vc, size_t vbase, const float *p, const float *alpha,
                       float *acc, int D, int c) {
    __m512 a[4][4];
    for (int g = 0; g < gn; g++)
        for (int u = 0; u < nu; u++)
            a[g][u] = _mm512_setzero_ps();
    for (int j = 0; j < TILE; j++) {
        for (int u = 0; u < nu; u++) {
            __m512 v = load16(vc, vbase + (size_t)j * D + c + 16 * u, dt);
            for (int g = 0; g < gn; g++) a[g][u] = _mm512_fmadd_ps(v, _mm512_set1_ps(p[g * TILE + j]), a[g][u]);
        }
    }
    /* the step's sum joins the running one once: over n keys the running sum takes n / 16 or n / 32
     * additions, not n (fp32 error growth), at the cost of the multiply it replaces */
    for (int g = 0; g < gn; g++)
        for (int u = 0; u < nu; u++) {
            float *o = acc + (size_t)g * D + c + 16 * u;
            _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_loadu_ps(o), _mm512_set1_ps(alpha[g]), a[g][u]));
        }
}

TGT INLINE void tile_f32(int gn, const item_t *it, int g0, const float *qv, size_t base, __mmask16 valid) {
    const int D = it->D, dt = it->dt;
    __m512 a[4][4], s[4];
    for (int g = 0; g < gn; g++)
        for (int u = 0; u < 4; u++) a[g][u] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 4) {
        for (int u = 0; u < 4; u++) {
            __m512 k = load16(it->kc, base + (size_t)(d + u) * TILE, dt);
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
    for (int g = 0; g < G; g++) {                                                                \
        it->m[g] = -INFINITY;                                                                    \
        it->l[g] = 0.0f;                                                                         \
    }                                                                                            \
    memset(it->acc, 0, sizeof(float) * (size_t)G * D);                                          \
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
            switch (G - g0 < 4 ? G - g0 : 4) {                                                   \
                case 4: TILE_CALL(4); break;                                                     \
                case 3: TILE_CALL(3); break;                                                     \
                case 2: TILE_CALL(2); break;                                                     \
                default: TILE_CALL(1); break;                                                    \
            }                                                                                    \
        }                                                                                        \
    }

static inline __mmask16 tile_mask(int n) { return (__mmask16)(n >= TILE ? 0xffffu : n <= 0 ? 0u : ((1u << n) - 1u)); }

/* bf16 items step two tiles (32 keys) at a time where both lie in one page, halving the softmax's
 * reductions and the accumulators' loads and stores per key */
TGT_BF16 static void item_avx512bf16(const item_t *it) {
    const int G = it->G, D = it->D, pf = it->prefetch;
    const uint16_t *kc = (const uint16_t *)it->kc, *vc = (const uint16_t *)it->vc;
    float lv[MAX_G * 16] __attribute__((aligned(64)));
    item_t own = *it;
    own.lv = lv;
    it = &own;
    for (int g = 0; g < G; g++) {
        it->m[g] = -INFINITY;
        it->l[g] = 0.0f;
    }
    memset(lv, 0, sizeof(float) * 16 * (size_t)G);
    memset(it->acc, 0, sizeof(float) * (size_t)G * D);
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
            switch (G - g0 < 4 ? G - g0 : 4) {
                case 4: BF16_TILE(4); break;
                case 3: BF16_TILE(3); break;
                case 2: BF16_TILE(2); break;
                default: BF16_TILE(1); break;
            }
#undef BF16_TILE
        }
        t += nt * TILE;
    }
    for (int g = 0; g < G; g++) it->l[g] = _mm512_reduce_add_ps(_mm512_load_ps(lv + 16 * g));
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

/* -- fp8 e4m3 K/V into the bf16 dot products ----------------------------------------------------- */
#define TGT_FP8 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx512vbmi")))

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
 * tab: FP8_LO, FP8_HI (CV_LOOKUP only) */
enum { CV_LOOKUP = 0, CV_SHIFT = 1 };
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
            _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_loadu_ps(o), alpha[g], a[g][u]));
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
    for (int g = 0; g < G; g++) {
        it->m[g] = -INFINITY;
        it->l[g] = 0.0f;
    }
    memset(lv, 0, sizeof(float) * 16 * (size_t)G);
    memset(it->acc, 0, sizeof(float) * (size_t)G * D);
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


#ifdef CPU_DECODE_AMX
/* -- fp8 e4m3 K/V on AMX: the byte lookups above convert a step's tiles to bf16 in a scratch buffer
 * (exactly the bf16 kernel's tile layout), and AMX tile multiplies (tdpbf16ps) compute the GN ≤ 16
 * heads' scores (q [GN, 32 dims] × K [32 dims, 16 keys] per 32 dims) and p·v (P [GN, 32 keys] × V
 * [32 keys, 16 dims] per 16 dims); the online softmax stays in AVX-512, in fp32. One step covers the
 * rest of a page (up to 128 keys), so that the multiplies of a step are many and independent. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tilecfg_t;

#ifdef CPU_DECODE_AMX_EMULATE
/* the tile operations in plain C (amx_emu.h): the AMX items run wherever their AVX-512 parts do */
#include "amx_emu.h"
#define TGT_AMX __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx512vbmi")))

static int amx_request(void) {
    __builtin_cpu_init();
    return cpu_decode_isa() == ISA_AVX512BF16 && __builtin_cpu_supports("avx512vbmi");
}
int cpu_decode_amx_emulated(void) { return 1; }
#else
#include <sys/syscall.h>
#include <unistd.h>
#define TGT_AMX __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx512vbmi,amx-tile,amx-bf16")))

static int amx_granted = 0;

/* AMX-TILE and AMX-BF16 in CPUID, and the kernel's permission to use the tile data (once per process) */
static int amx_request(void) {
    unsigned a, b, c, d;
    if (amx_granted) return 1;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 22) & 1u) || !((d >> 24) & 1u)) return 0;
    amx_granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return amx_granted;
}
int cpu_decode_amx_emulated(void) { return 0; }
#endif

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
    for (int g = 0; g < G; g++) {
        it->m[g] = -INFINITY;
        it->l[g] = 0.0f;
    }
    memset(it->acc, 0, sizeof(float) * (size_t)G * D);
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
                _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(_mm512_loadu_ps(acc + d), a, _mm512_loadu_ps(o + d)));
        }
        t = stop;
    }
    _tile_release();
    free(buf);
}
#endif
#endif

/* One output row from the KV splits' partial results: split s's max m[s · part], sum l[s · part] and
 * unnormalised accumulator acc[s · part .. + D] (each a row of its split's workspace part), weighted
 * e^(m_s - max) (once per split, not per element; 0 for a split with no keys), normalised, stored at
 * out[o .. o + D] in dtype dt */
static void combine_row(const float *m, const float *l, const float *acc, size_t part, int splits, int D, void *out,
                        size_t o, int dt) {
    float mx = -INFINITY, sum = 0.0f, wt[MAX_SPLITS];
    for (int s = 0; s < splits; s++) mx = fmaxf(mx, m[s * part]);
    for (int s = 0; s < splits; s++) {
        wt[s] = l[s * part] > 0.0f ? expf(m[s * part] - mx) : 0.0f;
        sum += l[s * part] * wt[s];
    }
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (int d = 0; d < D; d++) {
        float a = 0.0f;
        for (int s = 0; s < splits; s++) a += acc[s * part + (size_t)d] * wt[s];
        store_elem(out, o + (size_t)d, dt, a * inv);
    }
}

static void run_item(const item_t *it, int isa) {
    if (it->ks) { /* an fp8 cache: AMX, the AVX-512 BF16 lookup variant (bf16 q), else plain C */
#ifdef CPU_DECODE_AMX
        if (isa == ISA_AMX) {
            item_fp8_amx(it);
            return;
        }
#endif
#ifdef CPU_DECODE_AVX512
        if (isa == ISA_AVX512BF16 || isa == ISA_FP8_SHIFT) {
            (isa == ISA_FP8_SHIFT ? item_fp8_shift : item_fp8_lookup)(it);
            return;
        }
#endif
        item_scalar_fp8(it);
        return;
    }
#ifdef CPU_DECODE_X86
    if (isa == ISA_AVX2) {
        if (it->dt == DT_BF16)
            item_avx2_bf16(it);
        else if (it->dt == DT_F16)
            item_avx2_f16(it);
        else
            item_avx2_f32(it);
        return;
    }
#endif
#ifdef CPU_DECODE_AVX512
    if (isa == ISA_AVX512BF16) {
        item_avx512bf16(it);
        return;
    }
    if (isa == ISA_AVX512) {
        item_avx512(it);
        return;
    }
#endif
    item_scalar(it);
}

/* ---- entry points ------------------------------------------------------------------------------ */

/* the attention of one layer over a bf16/fp16/fp32 cache (ks = vs = NULL) or an fp8 one */
static int attend(const void *q, const void *kc, const void *vc, const float *ks, const float *vs,
                  const int32_t *block_table, const int32_t *seq_lens, void *out, float *ws, int B, int Hq, int Hkv,
                  int D, int ps, int maxp, int splits, int dt, int isa, int threads, int prefetch, float scale) {
    if (Hkv <= 0 || Hq % Hkv || Hq / Hkv > MAX_G || D % 16 || ps % TILE || splits < 1 || splits > MAX_SPLITS) return -1;
    if (ks && (D % 32 || (isa != ISA_SCALAR && isa != ISA_AVX512BF16 && isa != ISA_AMX && isa != ISA_FP8_SHIFT)))
        return -1;
    if (!ks && isa == ISA_FP8_SHIFT) return -1;
    if (isa == ISA_AMX && (!ks || !amx_request() || Hq / Hkv > 16 || dt != DT_BF16)) return -3;
    if ((isa == ISA_AVX512BF16 || isa == ISA_FP8_SHIFT) && dt != DT_BF16) return -2;
    if (isa == ISA_AVX512 && dt == DT_BF16) return -2;
    const int G = Hq / Hkv, P = dt == DT_BF16 ? 2 : 1;
    const long items = (long)B * Hkv * splits;
    const size_t part = (size_t)G * (D + 2);
    int nomem = 0;
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads) if (threads > 1 && items > 1)
    {
        float *own = splits == 1 ? (float *)scratch(sizeof(float) * part) : NULL;
        if (splits == 1 && !own) flag_nomem(&nomem);
#pragma omp for schedule(dynamic, 1)
        for (long w = 0; w < items; w++) {
            int b = (int)(w / ((long)Hkv * splits)), h = (int)(w / splits % Hkv), s = (int)(w % splits);
            int len = seq_lens[b], ntiles = (len + TILE - 1) / TILE, per = (ntiles + splits - 1) / splits;
            int t0 = s * per * TILE, t1 = (s + 1) * per * TILE;
            if (t1 > len) t1 = len;
            float *buf = splits == 1 ? own : ws + (size_t)w * part;
            if (!buf) continue;
            item_t it = {
                .q = (const char *)q + ((size_t)b * Hq + (size_t)h * G) * D * (dt == DT_F32 ? 4 : 2),
                .kc = kc, .vc = vc, .bt = block_table + (size_t)b * maxp, .t0 = t0, .t1 = t1,
                .G = G, .D = D, .ps = ps, .P = P, .Hkv = Hkv, .h = h, .dt = dt, .prefetch = prefetch,
                .scale = scale,
                .m = buf, .l = buf + G, .acc = buf + 2 * G, .ks = ks, .vs = vs, .nomem = &nomem,
            };
            if (t0 < t1) {
                run_item(&it, isa);
            } else {
                for (int g = 0; g < G; g++) {
                    it.m[g] = -INFINITY;
                    it.l[g] = 0.0f;
                }
                memset(it.acc, 0, sizeof(float) * (size_t)G * D);
            }
            if (splits == 1) {
                size_t o = ((size_t)b * Hq + (size_t)h * G) * D;
                for (int g = 0; g < G; g++) {
                    float inv = it.l[g] > 0.0f ? 1.0f / it.l[g] : 0.0f;
                    for (int d = 0; d < D; d++) store_elem(out, o + (size_t)g * D + d, dt, it.acc[(size_t)g * D + d] * inv);
                }
            }
        }
        free(own);
        if (splits > 1) {
#pragma omp for schedule(static)
            for (long w = 0; w < (long)B * Hkv; w++) {
                const float *p0 = ws + (size_t)w * splits * part;
                size_t o = (size_t)w * G * D; /* (b, h) → heads h·G.. of sequence b: same flat order */
                for (int g = 0; g < G; g++)
                    combine_row(p0 + g, p0 + G + g, p0 + 2 * G + (size_t)g * D, part, splits, D, out, o + (size_t)g * D, dt);
            }
        }
    }
    return nomem ? ERR_NOMEM : 0;
}

/* Decode attention of one layer. q [B, Hq, D] and out [B, Hq, D] in dtype dt; block_table [B, maxp]
 * int32; seq_lens [B] int32; ws: fp32 workspace of B · Hkv · splits · G · (D + 2) floats (used only
 * when splits > 1). Returns 0, ERR_NOMEM when a scratch allocation is refused, or another negative
 * code for arguments it refuses. */
int cpu_decode_attend(const void *q, const void *kc, const void *vc, const int32_t *block_table, const int32_t *seq_lens,
                      void *out, float *ws, int B, int Hq, int Hkv, int D, int ps, int maxp, int splits, int dt,
                      int isa, int threads, int prefetch, float scale) {
    return attend(q, kc, vc, NULL, NULL, block_table, seq_lens, out, ws, B, Hq, Hkv, D, ps, maxp, splits, dt, isa,
                  threads, prefetch, scale);
}

/* The same over an fp8 cache: kc, vc its bytes (fp8_phys order), ks, vs the layer's float32 scales
 * [pages, Hkv, ps]; q and out in dt (bf16 for the AVX-512 variant); D a multiple of 32. */
int cpu_decode_attend_fp8(const void *q, const void *kc, const void *vc, const float *ks, const float *vs,
                          const int32_t *block_table, const int32_t *seq_lens, void *out, float *ws, int B, int Hq,
                          int Hkv, int D, int ps, int maxp, int splits, int dt, int isa, int threads, int prefetch,
                          float scale) {
    if (!ks || !vs) return -1;
    return attend(q, kc, vc, ks, vs, block_table, seq_lens, out, ws, B, Hq, Hkv, D, ps, maxp, splits, dt, isa,
                  threads, prefetch, scale);
}

/* ---- MLA latent form (cpu_decode_mla) ------------------------------------------------------------
 * The cache: per layer [pages, ps, Dk] rows (the absorbed form's [c | k_pe], one shared KV head; the
 * value is the row's first Dv columns, stored once): the mla backend's LatentCache pages as they are.
 * q [B, H, Dk] → out [B, H, Dv]. One item per (sequence, KV split) walks its tokens once for all H
 * heads, so each latent row is read once per step whatever the head count. */

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
    for (int h = 0; h < H; h++) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)H * Dv);
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
    uint32_t *qt = (uint32_t *)scratch(4 * (qt_n + s_n + p_n + v_n + o_n + 2 * (size_t)Hp + z_n));
    if (!qt) {
        flag_nomem(nomem);
        return;
    }
    float *sb = (float *)(qt + qt_n);
    uint32_t *pt = (uint32_t *)(sb + s_n), *vb = pt + p_n;
    float *ob = (float *)(vb + v_n), *mr = ob + o_n, *lr = mr + Hp;
    uint32_t *zrow = (uint32_t *)(lr + Hp);
    memset(zrow, 0, 4 * z_n);
    memset(pt, 0, 4 * p_n);
    latent_qt(q, H, Dk, nb, qt);
    memset(ob, 0, sizeof(float) * o_n);
    for (int h = 0; h < Hp; h++) {
        mr[h] = -INFINITY;
        lr[h] = 0.0f;
    }
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
    uint32_t *qt = (uint32_t *)scratch(4 * (qt_n + s_n + p_n + v_n + o_n + 2 * (size_t)Hp));
    if (!qt) {
        flag_nomem(nomem);
        return;
    }
    float *sb = (float *)(qt + qt_n);
    uint32_t *pb = (uint32_t *)(sb + s_n), *vb = pb + p_n;
    float *ob = (float *)(vb + v_n), *mr = ob + o_n, *lr = mr + Hp;
    latent_qt(q, H, Dk, nb, qt); /* row i of tile (hb, kk): dims 2(16kk + i), +1 of heads hb·16.. */
    memset(ob, 0, sizeof(float) * o_n);
    for (int h = 0; h < Hp; h++) {
        mr[h] = -INFINITY;
        lr[h] = 0.0f;
    }
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

/* Decode attention of one layer in the MLA latent form: q [B, H, Dk] and out [B, H, Dv] in dtype dt;
 * kc: the layer's rows [pages, ps, Dk]; block_table [B, maxp] int32; seq_lens [B] int32; ws: fp32
 * workspace of B · splits · H · (Dv + 2) floats (used only when splits > 1). isa: ISA_AMX or
 * ISA_AVX512BF16 (bf16, Dk % 32 == 0 for AMX, even for AVX-512 BF16, Dv % 16 == 0; pages of ≤ 128
 * keys) or ISA_SCALAR. Returns 0, ERR_NOMEM when a scratch allocation is refused, or another negative
 * code for arguments it refuses. */
int cpu_decode_attend_latent(const void *q, const void *kc, const int32_t *block_table, const int32_t *seq_lens,
                             void *out, float *ws, int B, int H, int Dk, int Dv, int ps, int maxp, int splits, int dt,
                             int isa, int threads, float scale) {
    if (H < 1 || Dv > Dk || ps % TILE || splits < 1 || splits > MAX_SPLITS) return -1;
    if (isa != ISA_SCALAR && isa != ISA_AVX512BF16 && isa != ISA_AMX) return -1;
    if (isa != ISA_SCALAR && (dt != DT_BF16 || Dk % (isa == ISA_AMX ? 32 : 2) || Dv % 16 || ps > 128)) return -3;
    if ((isa == ISA_AMX && !amx_request()) || (isa == ISA_AVX512BF16 && cpu_decode_isa() < ISA_AVX512BF16)) return -3;
    const long items = (long)B * splits;
    const size_t part = (size_t)H * (Dv + 2);
    int nomem = 0;
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads) if (threads > 1 && items > 1)
    {
        float *own = splits == 1 ? (float *)scratch(sizeof(float) * part) : NULL;
        if (splits == 1 && !own) flag_nomem(&nomem);
#pragma omp for schedule(dynamic, 1)
        for (long w = 0; w < items; w++) {
            int b = (int)(w / splits), s = (int)(w % splits);
            int len = seq_lens[b], ntiles = (len + TILE - 1) / TILE, per = (ntiles + splits - 1) / splits;
            int t0 = s * per * TILE, t1 = (s + 1) * per * TILE;
            if (t1 > len) t1 = len;
            float *buf = splits == 1 ? own : ws + (size_t)w * part, *m = buf, *l = buf + H, *acc = buf + 2 * H;
            if (!buf) continue;
            const char *qb = (const char *)q + (size_t)b * H * Dk * (dt == DT_F32 ? 4 : 2);
            if (t0 >= t1) {
                for (int h = 0; h < H; h++) {
                    m[h] = -INFINITY;
                    l[h] = 0.0f;
                }
                memset(acc, 0, sizeof(float) * (size_t)H * Dv);
            }
#ifdef CPU_DECODE_AMX
            else if (isa == ISA_AMX)
                latent_item_amx((const uint16_t *)qb, (const uint16_t *)kc, block_table + (size_t)b * maxp, t0, t1, H,
                                Dk, Dv, ps, scale, m, l, acc, &nomem);
#endif
#ifdef CPU_DECODE_AVX512
            else if (isa == ISA_AVX512BF16)
                latent_item_bf16((const uint16_t *)qb, (const uint16_t *)kc, block_table + (size_t)b * maxp, t0, t1, H,
                                 Dk, Dv, ps, scale, m, l, acc, &nomem);
#endif
            else
                latent_item_scalar(qb, kc, block_table + (size_t)b * maxp, t0, t1, H, Dk, Dv, ps, dt, scale, m, l, acc,
                                   &nomem);
            if (splits == 1) {
                size_t o = (size_t)b * H * Dv;
                for (int h = 0; h < H; h++) {
                    float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
                    for (int d = 0; d < Dv; d++) store_elem(out, o + (size_t)h * Dv + d, dt, acc[(size_t)h * Dv + d] * inv);
                }
            }
        }
        free(own);
        if (splits > 1) {
#pragma omp for schedule(static) /* one row (sequence, head) at a time: all threads take part at batch 1 */
            for (long bh = 0; bh < (long)B * H; bh++) {
                const long b = bh / H, h = bh % H;
                const float *p0 = ws + (size_t)b * splits * part;
                combine_row(p0 + h, p0 + H + h, p0 + 2 * H + (size_t)h * Dv, part, splits, Dv, out, (size_t)bh * Dv, dt);
            }
        }
    }
    return nomem ? ERR_NOMEM : 0;
}

/* Write new tokens: k, v [B, T, Hkv, D] (right-padded; row j of sequence b is real for j < num_new[b])
 * at positions[b] + j, into the layer's pages (layout above; kc and vc as the kernel takes them).
 * esize: bytes per element (2 or 4). */
int cpu_decode_write(void *kc, void *vc, const void *k, const void *v, const int32_t *block_table,
                     const int32_t *positions, const int32_t *num_new, int B, int T, int Hkv, int D, int ps,
                     int maxp, int P, int esize) {
    if (D % P || ps % TILE || (esize != 2 && esize != 4)) return -1;
    for (int b = 0; b < B; b++) {
        for (int j = 0; j < num_new[b]; j++) {
            int t = positions[b] + j, page = block_table[(size_t)b * maxp + t / ps], slot = t % ps;
            for (int h = 0; h < Hkv; h++) {
                size_t src = (((size_t)b * T + j) * Hkv + h) * D;
                size_t tile = 2 * (((size_t)page * Hkv + h) * ps * D + (size_t)(slot / TILE) * TILE * D);
                size_t j16 = (size_t)(slot % TILE), vt = tile + (j16 / P) * D * P + j16 % P;
                /* K: the P values d .. d+P-1 of slot j16 are adjacent, one run every 16·P elements;
                 * V: value d at vt + d·P */
                const char *ks = (const char *)k + src * esize, *vs = (const char *)v + src * esize;
                char *kd = (char *)kc + (tile + j16 * P) * esize, *vd = (char *)vc + vt * esize;
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

/* Quantise and write new tokens into an fp8 cache: k, v [B, T, Hkv, D] in dt (right-padded, as for
 * cpu_decode_write), each row stored as e4m3 bytes of row / scale with scale = amax(|row|) / 448 (the
 * smallest normal float where that is 0), exactly as attnbench.kernels.fp8_cache.quantize does; kc, vc as
 * cpu_decode_attend_fp8 takes them, ksc, vsc the layer's scales. A row holding NaN or inf is stored
 * as zeros. isa: the cache's variant code; the AVX-512 ones quantise 16 values at a time, c-scalar in
 * plain C (the same bytes). Returns the number of such rows (0: all finite), ERR_NOMEM when its row
 * buffer is refused (nothing written), or another negative code for bad arguments. */
int cpu_decode_write_fp8(uint8_t *kc, uint8_t *vc, float *ksc, float *vsc, const void *k, const void *v,
                         const int32_t *block_table, const int32_t *positions, const int32_t *num_new, int B, int T,
                         int Hkv, int D, int ps, int maxp, int dt, int isa) {
    if (D % 32 || ps % TILE || dt < DT_F32 || dt > DT_BF16) return -1;
    float (*quantise)(const float *, uint8_t *, int, int *) = quantise_row;
#ifdef CPU_DECODE_AVX512
    if (isa >= ISA_AVX512) quantise = quantise_row_avx512; /* c-avx512bf16 (either conversion), c-amx */
#endif
    int bad = 0;
    float *row = (float *)scratch(sizeof(float) * (size_t)D + (size_t)D);
    if (!row) return ERR_NOMEM;
    uint8_t *bytes = (uint8_t *)(row + D);
    for (int b = 0; b < B; b++) {
        for (int j = 0; j < num_new[b]; j++) {
            int t = positions[b] + j, page = block_table[(size_t)b * maxp + t / ps], slot = t % ps;
            for (int h = 0; h < Hkv; h++) {
                size_t src = (((size_t)b * T + j) * Hkv + h) * D;
                size_t tile = 2 * (((size_t)page * Hkv + h) * ps * D + (size_t)(slot / TILE) * TILE * D);
                size_t j16 = (size_t)(slot % TILE), so = ((size_t)page * Hkv + h) * ps + slot;
                load_row(k, src, dt, row, D);
                ksc[so] = quantise(row, bytes, D, &bad);
                scatter_k(kc + tile, bytes, j16, D);
                load_row(v, src, dt, row, D);
                vsc[so] = quantise(row, bytes, D, &bad);
                scatter_v(vc + tile, bytes, j16, D);
            }
        }
    }
    free(row);
    return bad;
}
