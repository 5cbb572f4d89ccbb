/* common.h — what every part of the cpu_decode kernel shares: the first header cpu_decode.c includes.
 *
 * Contents, in order:
 *   1. the build: CPU_DECODE_X86 (the x86-64 items), CPU_DECODE_AVX512 (unless -DCPU_DECODE_NO_AVX512),
 *      CPU_DECODE_AMX (the AMX items: a compiler with the AMX intrinsics, or -DCPU_DECODE_AMX_EMULATE),
 *      CPU_DECODE_ASAN (an AddressSanitizer build), INLINE
 *   2. enums and limits: DT_* (element types), ISA_* (the variants), CV_* (the fp8 conversions of the
 *      c-avx512bf16 item), TILE, MAX_G, MAX_SPLITS, ERR_NOMEM
 *   3. the entry points' argument structs, cpu_decode_attend_args and cpu_decode_write_args, each field
 *      listed once (CPU_DECODE_ATTEND_FIELDS, CPU_DECODE_WRITE_FIELDS) so that cpu_decode_args_layout
 *      (cpu_decode.c) reports the offset of every field the struct has
 *   4. scratch memory: scratch(), flag_nomem() and the failure injection cpu_decode_fail_alloc sets
 *   5. scalar conversions: bf16 and fp16 to and from fp32, load_elem / store_elem, e4m3 to fp32, and the
 *      e4m3 → bf16 byte tables FP8_LO / FP8_HI (filled at load by a constructor)
 *   6. what one work item sees (item_t), HEADS_SWITCH, its rows reset (reset_rows), and the cache's
 *      addressing: tile_offset, fp8_phys, scale_offset
 *   7. the plain-C items' start: scalar_start
 */
#ifndef CPU_DECODE_COMMON_H
#define CPU_DECODE_COMMON_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ---- 1. the build ------------------------------------------------------------------------------ */
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
#if defined(__SANITIZE_ADDRESS__) /* gcc */
#define CPU_DECODE_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) /* clang */
#define CPU_DECODE_ASAN 1
#endif
#endif

/* ---- 2. enums and limits ----------------------------------------------------------------------- */
enum { DT_F32 = 0, DT_F16 = 1, DT_BF16 = 2 };
/* ordered: a CPU that runs one variant runs every variant below it (for the dtypes each takes);
 * ISA_AMX: fp8 and latent caches only (AMX tile multiplies), GQA groups up to 16 */
enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AVX512BF16 = 3, ISA_AMX = 4 };
/* the conversion of fp8 bytes to bf16 in the c-avx512bf16 fp8 item (fp8x64, isa_avx512.h); the
 * attend args' fp8_convert: CV_SHIFT is accepted only with an fp8 cache and ISA_AVX512BF16 */
enum { CV_LOOKUP = 0, CV_SHIFT = 1 };
#define TILE 16
#define MAX_G 64
#define MAX_SPLITS 16 /* KV splits per sequence (cpu_kernel.py's MAX_SPLITS: the workspace is sized for them) */
#define ERR_NOMEM (-4) /* what an entry point returns when a scratch allocation is refused */

/* ---- 3. the entry points' argument structs -------------------------------------------------------
 * Each field is listed once, as X(type, name): the struct is declared from the list, and
 * cpu_decode_args_layout reports sizeof and every field's offsetof and sizeof from the same list, so
 * that the ctypes Structures (backends/cpu_kernel.py) are checked field by field when the library is
 * loaded. Integers are int32_t and the pointers plain pointers: the layout ctypes builds for
 * c_int32 / c_void_p / c_float.
 *
 * One struct for the three attention entry points (cpu_decode_attend, cpu_decode_attend_fp8,
 * cpu_decode_attend_latent): they take the same arguments but for the fp8 cache's scales and the
 * latent form's value width, so one struct keeps one layout to check and lets a caller fill the shared
 * fields the same way for each form; the fields a form does not read are noted (leave them 0 / NULL).
 * Likewise one struct for both writers (cpu_decode_write, cpu_decode_write_fp8). */
#define CPU_DECODE_ATTEND_FIELDS(X)                                                                          \
    X(const void *, q)              /* [B, Hq, D] in dtype (latent: [B, H, Dk]) */                           \
    X(const void *, k_cache)        /* the layer's first K tile (latent: its rows [pages, ps, Dk]) */        \
    X(const void *, v_cache)        /* the layer's first V tile, 16 · D elements on (latent: unused) */      \
    X(const float *, k_scales)      /* fp8: the layer's K scales [pages, Hkv, ps] (else unused) */           \
    X(const float *, v_scales)      /* fp8: the layer's V scales [pages, Hkv, ps] (else unused) */           \
    X(const int32_t *, block_table) /* [B, max_pages] */                                                     \
    X(const int32_t *, seq_lens)    /* [B] */                                                                \
    X(void *, out)                  /* [B, Hq, D] in dtype (latent: [B, H, Dv]) */                           \
    X(float *, workspace)           /* fp32, B · Hkv · splits · G · (D + 2) (latent: B · splits · H ·        \
                                       (Dv + 2)); read only when splits > 1 */                               \
    X(int32_t, num_seqs)            /* B */                                                                  \
    X(int32_t, num_q_heads)         /* Hq (latent: H) */                                                     \
    X(int32_t, num_kv_heads)        /* Hkv (latent: unused, one shared row) */                               \
    X(int32_t, head_dim)            /* D (latent: Dk, the row) */                                            \
    X(int32_t, v_head_dim)          /* latent: Dv, the value's leading columns of a row (else unused) */     \
    X(int32_t, page_size)           /* ps, a multiple of 16 */                                               \
    X(int32_t, max_pages)           /* the block table's row length */                                       \
    X(int32_t, splits)              /* KV splits per sequence, 1 .. MAX_SPLITS */                            \
    X(int32_t, dtype)               /* DT_*: q, out, and the cache unless fp8 */                              \
    X(int32_t, isa)                 /* ISA_*: the variant */                                                 \
    X(int32_t, fp8_convert)         /* CV_*: CV_SHIFT only with fp8 and ISA_AVX512BF16 */                    \
    X(int32_t, threads)             /* OpenMP threads (< 1: one) */                                          \
    X(int32_t, prefetch)            /* 16-key tiles ahead to prefetch into L2 (latent: unused) */            \
    X(float, scale)                 /* the softmax scale */

#define CPU_DECODE_WRITE_FIELDS(X)                                                                           \
    X(void *, k_cache)              /* as cpu_decode_attend_args' */                                         \
    X(void *, v_cache)                                                                                       \
    X(float *, k_scales)            /* fp8 writer: the layer's K scales (else unused) */                     \
    X(float *, v_scales)            /* fp8 writer: the layer's V scales (else unused) */                     \
    X(const void *, k)              /* [B, max_new, Hkv, D], right-padded */                                 \
    X(const void *, v)                                                                                       \
    X(const int32_t *, block_table) /* [B, max_pages] */                                                     \
    X(const int32_t *, positions)   /* [B]: where sequence b's first new token goes */                       \
    X(const int32_t *, num_new)     /* [B]: its new tokens (rows j < num_new[b] are real) */                 \
    X(int32_t, num_seqs)            /* B */                                                                  \
    X(int32_t, max_new)             /* the rows per sequence in k and v */                                   \
    X(int32_t, num_kv_heads)        /* Hkv */                                                                \
    X(int32_t, head_dim)            /* D */                                                                  \
    X(int32_t, page_size)           /* ps */                                                                 \
    X(int32_t, max_pages)           /* the block table's row length */                                       \
    X(int32_t, pair)                /* cpu_decode_write: P, 2 for bf16 tiles, else 1 */                      \
    X(int32_t, elem_size)           /* cpu_decode_write: bytes per element, 2 or 4 */                        \
    X(int32_t, dtype)               /* cpu_decode_write_fp8: DT_* of k and v */                              \
    X(int32_t, isa)                 /* cpu_decode_write_fp8: ISA_* (AVX-512 and up quantise 16 lanes) */

#define CPU_DECODE_FIELD_DECL(type, name) type name;
typedef struct {
    CPU_DECODE_ATTEND_FIELDS(CPU_DECODE_FIELD_DECL)
} cpu_decode_attend_args;
typedef struct {
    CPU_DECODE_WRITE_FIELDS(CPU_DECODE_FIELD_DECL)
} cpu_decode_write_args;
#undef CPU_DECODE_FIELD_DECL

/* ---- 4. scratch memory ---------------------------------------------------------------------------
 * Every buffer a kernel allocates comes from scratch() (64-byte aligned, its size rounded up to that);
 * when one is refused, the item flags it (flag_nomem) and the entry point returns ERR_NOMEM instead of
 * writing through a null pointer. cpu_decode_fail_alloc(n) makes the n-th allocation from now fail
 * once (for tests, which take that path on purpose; -1, the default: never). */
static int fail_alloc = -1;
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
/* the best variant the running CPU (and OS) supports (cpu_decode.c; the emulated AMX request asks it) */
int cpu_decode_isa(void);

/* ---- 5. scalar conversions ------------------------------------------------------------------------ */
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

/* ---- 6. what one work item sees ------------------------------------------------------------------- */
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

/* CALL(gn) with gn a constant 1-4: the heads g0 .. g0 + gn of a GQA group, up to 4 at a time (each
 * K row loaded once for them), so that each count compiles to its own unrolled code */
#define HEADS_SWITCH(left, CALL)        \
    switch ((left) < 4 ? (left) : 4) {  \
        case 4: CALL(4); break;         \
        case 3: CALL(3); break;         \
        case 2: CALL(2); break;         \
        default: CALL(1); break;        \
    }

/* rows' running state before their first key: max -inf, sum 0, the [rows, width] accumulator 0 */
static inline void reset_rows(float *m, float *l, float *acc, int rows, int width) {
    for (int r = 0; r < rows; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)rows * width);
}

/* the offset of the tile holding token t (a multiple of 16) from kc for its K, from vc for its V */
static inline size_t tile_offset(const item_t *it, int t) {
    int page = it->bt[t / it->ps], slot = t % it->ps;
    return 2 * (((size_t)page * it->Hkv + it->h) * it->ps * it->D + (size_t)slot * it->D);
}

/* fp8 e4m3 K/V (cpu_decode_fp8): bytes in the bf16 tile order (K [D/2, 16, 2], V [8, D, 2]), except
 * that within each aligned 64-byte block the two 32-value rows are interleaved byte by byte (fp8_phys:
 * row 0 in the even bytes, row 1 in the odd ones): one 64-byte load holds 32 16-bit lanes, each with
 * row 0's value in its low byte and row 1's in its high byte, so shifts within the lanes give both
 * rows as bf16 in order. A per token-head float32 scale multiplies the score (K) and the probability
 * (V), never the values. */
static inline size_t fp8_phys(size_t L) { return (L & ~(size_t)63) | ((L & 31) << 1) | ((L >> 5) & 1); }

/* the scale index of token t (its page's slot) in [pages, Hkv, ps] */
static inline size_t scale_offset(const item_t *it, int t) {
    int page = it->bt[t / it->ps], slot = t % it->ps;
    return ((size_t)page * it->Hkv + it->h) * it->ps + slot;
}

/* The plain-C items' start (paged and fp8): the item's G query heads as fp32 in scratch, followed by D
 * floats of room returned in *tmp, and the running max, sum and accumulator reset; NULL when the
 * scratch is refused (flagged: the entry point returns ERR_NOMEM). */
static float *scalar_start(const item_t *it, float **tmp) {
    const int G = it->G, D = it->D;
    float *qv = (float *)scratch(sizeof(float) * ((size_t)G + 1) * D);
    if (!qv) {
        flag_nomem(it->nomem);
        return NULL;
    }
    *tmp = qv + (size_t)G * D;
    for (int i = 0; i < G * D; i++) qv[i] = load_elem(it->q, (size_t)i, it->dt);
    reset_rows(it->m, it->l, it->acc, G, D);
    return qv;
}

#endif
