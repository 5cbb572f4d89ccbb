/* cpu_decode — decode attention for CPUs, called from backends/cpu_decode.py, cpu_decode_fp8.py and
 * cpu_decode_mla.py (and the vLLM plugin) through ctypes: one argument struct per entry point family.
 *
 * THE SOURCE TREE. This file is the one translation unit the build compiles (backends/cpu_kernel.py:
 * `cc -O3 -fPIC -shared -fopenmp -I csrc csrc/cpu_decode.c`); it holds the exported entry points, the
 * ISA detection and the dispatch, and includes the rest (a unity build: every helper stays static
 * inline, so the code each item compiles to is what one file gave):
 *   common.h         the build's capabilities, the enums, the argument structs, scratch memory, the
 *                    scalar conversions (bf16, fp16, e4m3), item_t and the cache's addressing
 *   vec_generic.h    the vector helpers the AVX2 and AVX-512 code share (e^x, the fp32/fp16 load, the
 *                    accumulator update), written once and included by both ISA headers at their width
 *   isa_avx2.h       AVX2 + FMA + F16C helpers (8 lanes)
 *   isa_avx512.h     AVX-512 helpers (16 lanes): dp_bcast, transpose16, fp8x64 and the rest
 *   isa_amx.h        AMX: the tile configuration, and the compiler's intrinsics or amx_emu.h's emulation
 *   amx_emu.h        the AMX tile operations in plain C (the amx-emulated build only)
 *   decode_paged.h   the paged form over fp32 / fp16 / bf16 caches: its items for every ISA
 *   decode_fp8.h     the paged form over fp8 e4m3 caches with per token-head scales: its items
 *   decode_latent.h  the MLA latent form: its items
 *   writers.h        the cache writers (cpu_decode_write, cpu_decode_write_fp8): scatter and quantise
 *
 * THE PAGED CACHE (one layer; element type T = fp32, fp16 or bf16; P = 2 for bf16, else 1): 16-key
 * tiles, each tile's K followed by its V, one KV head's tiles of one page after each other:
 *   [pages, Hkv, page_size / 16, { K: [D / P, 16, P],  V: [16 / P, D, P] }]
 * (K: P adjacent dims of each key side by side, the VNNI order; V: P adjacent keys of each dim side
 * by side). The kernel takes kc = the layer's first element and vc = kc + 16 · D elements, and finds
 * a tile's K at kc + tile_offset and its V at vc + tile_offset. One page of one KV head is one
 * contiguous run of 2 · page_size · D elements, read front to back: one stream per item rather than
 * separate K and V pages, which one core reads from DRAM faster. With P = 2 one 64-byte row of a K
 * tile is 16 keys × 2 dims and one of V is 16 dims × 2 keys: exactly the operands of vdpbf16ps, so
 * neither q·k nor p·v needs a shuffle or a horizontal sum.
 * The fp8 cache keeps the bf16 tile order (P = 2) with one byte per value, the two 32-value rows of each
 * 64-byte block interleaved byte by byte (fp8_phys), and a float32 scale per token and KV head
 * ([pages, Hkv, page_size], K and V apart) that multiplies the score (K) and the probability (V).
 *
 * WORK (paged and fp8): one item per (sequence, KV head, KV split). An item walks its tokens in 16-key
 * tiles: scores for every query head of the GQA group (each K row is loaded once for up to 4 heads), an
 * online-softmax update in fp32, and p·v accumulated in fp32. With one split an item writes the
 * normalised output; with more, each writes (m, l, acc) to the workspace and a merge (combine_row)
 * combines them. The latent form: one item per (sequence, KV split), all H heads, the same merge.
 *
 * THE PATHS (isa: ISA_*, ordered: a CPU that runs one variant runs those below it, for the dtypes each
 * takes; cpu_decode_isa() says the best the running CPU supports):
 *   paged fp32 / fp16 / bf16 (cpu_decode_attend; decode_paged.h):
 *     ISA_AVX512BF16  bf16: q·k and p·v with vdpbf16ps, p rounded to bf16 for p·v (as flash attention
 *                     does), two tiles (32 keys) a step where both lie in one page
 *     ISA_AVX512      fp32 and fp16: vfmadd231ps in fp32, fp16 widened with vcvtph2ps, a tile a step
 *     ISA_AVX2        any dtype on AVX2 + FMA + F16C: 8-lane vfmadd231ps in fp32; a 32-byte load of a
 *                     bf16 K row is 8 keys × 2 dims, of a V row 8 dims × 2 keys, widened by a shift and
 *                     a mask; p kept in fp32; two tiles a step where both lie in one page
 *     ISA_SCALAR      any dtype, plain C, fp32 arithmetic, p kept in fp32
 *   paged fp8 e4m3 (cpu_decode_attend_fp8; decode_fp8.h; D % 32 == 0):
 *     ISA_AMX         bf16 q, GQA groups ≤ 16: a step's tiles (up to 128 keys) converted to bf16 by byte
 *                     lookups into scratch, scores and p·v by AMX tile multiplies, softmax in AVX-512
 *     ISA_AVX512BF16  bf16 q, AVX-512 BF16 + VBMI: each 64-byte load of fp8 becomes two rows of bf16
 *                     for the vdpbf16ps dot products; fp8_convert picks the conversion: CV_LOOKUP
 *                     (exact byte lookups) or CV_SHIFT (shifts and a mask: the value × 2^-120, e4m3
 *                     subnormals read as zero, undone by exact power-of-two scalings)
 *     ISA_SCALAR      any compute dtype, plain C, fp32 arithmetic
 *   MLA latent (cpu_decode_attend_latent; decode_latent.h; rows [pages, ps, Dk], value = first Dv):
 *     ISA_AMX         bf16, Dk % 32 == 0, Dv % 16 == 0, pages ≤ 128: S^T = rows · Q^T on tiles, the
 *                     softmax 16 heads a vector with a lazy rescale, O += P · V on tiles
 *     ISA_AVX512BF16  bf16, Dk even, Dv % 16 == 0, pages ≤ 128: the same four stages with register
 *                     tiles of vdpbf16ps (6 keys × 64 heads, 6 heads × 64 dims)
 *     ISA_SCALAR      any dtype, plain C, fp32 arithmetic (16 partial sums per score)
 *   writers (writers.h): cpu_decode_write scatters fp32/fp16/bf16 rows into their tiles;
 *     cpu_decode_write_fp8 quantises each row to e4m3 with its own scale (amax / 448; AVX-512 16 lanes
 *     at a time from ISA_AVX512 up, else plain C: the same bytes) and scatters the bytes.
 *
 * THE BUILDS. The AVX-512, AVX2 and AMX code is compiled with target attributes, so the tree builds with
 * any x86-64 compiler flags. -DCPU_DECODE_AMX_EMULATE (the amx-emulated build) runs the AMX items on
 * amx_emu.h's plain-C tiles; -DCPU_DECODE_NO_AVX512 leaves out every AVX-512 and AMX item; an
 * AddressSanitizer build allocates every scratch buffer at its exact size.
 *
 * THE INTERFACE. Each entry point takes one const pointer to its argument struct (common.h:
 * cpu_decode_attend_args for the three attention forms, cpu_decode_write_args for both writers) and
 * returns 0 (the fp8 writer: its count of non-finite rows), ERR_NOMEM when a scratch allocation is
 * refused, or another negative code for arguments it refuses. cpu_decode_args_layout reports each
 * struct's size and every field's offset and size, which the Python side checks against its ctypes
 * Structures at load; cpu_decode_abi() is the interface's version.
 *
 * This file, in order:
 *   cpu_decode_abi             the interface version (8: the argument structs)
 *   cpu_decode_args_layout, cpu_decode_args_field    each struct's size, fields' offsets, sizes, names
 *   cpu_decode_fail_alloc      make the n-th scratch allocation from now fail (tests)
 *   cpu_decode_isa, cpu_decode_fp8_fast, cpu_decode_amx_emulated    the ISA detection
 *   combine_row                the merge of KV splits' partial results into one output row
 *   drive                      every form's items over the threads, normalised or merged (written once)
 *   run_item, paged_unit       the per-item dispatch of the paged and fp8 forms, and their unit
 *   attend, cpu_decode_attend, cpu_decode_attend_fp8    the paged and fp8 entry points
 *   run_latent_item, latent_unit, cpu_decode_attend_latent    the latent dispatch, unit and entry point
 * (cpu_decode_write and cpu_decode_write_fp8 are in writers.h.)
 */
#include "common.h"
#include "isa_avx2.h"
#include "isa_avx512.h"
#include "isa_amx.h"
#include "decode_paged.h"
#include "decode_fp8.h"
#include "decode_latent.h"
#include "writers.h"

int cpu_decode_abi(void) { return 8; }

/* ---- the argument structs' layout ---------------------------------------------------------------- */
typedef struct {
    const char *name;
    int64_t offset, size;
} field_layout_t;
#define ATTEND_FIELD(type, name)                                                                             \
    {#name, (int64_t)offsetof(cpu_decode_attend_args, name), (int64_t)sizeof(((cpu_decode_attend_args *)0)->name)},
#define WRITE_FIELD(type, name)                                                                              \
    {#name, (int64_t)offsetof(cpu_decode_write_args, name), (int64_t)sizeof(((cpu_decode_write_args *)0)->name)},
static const field_layout_t ATTEND_LAYOUT[] = {CPU_DECODE_ATTEND_FIELDS(ATTEND_FIELD)};
static const field_layout_t WRITE_LAYOUT[] = {CPU_DECODE_WRITE_FIELDS(WRITE_FIELD)};
#undef ATTEND_FIELD
#undef WRITE_FIELD

/* the fields of the struct called name ("cpu_decode_attend_args" or "cpu_decode_write_args"), their
 * count in *n and the struct's size in *size; NULL for another name */
static const field_layout_t *layout_of(const char *name, int *n, int64_t *size) {
    if (name && strcmp(name, "cpu_decode_attend_args") == 0) {
        *n = (int)(sizeof ATTEND_LAYOUT / sizeof ATTEND_LAYOUT[0]);
        *size = (int64_t)sizeof(cpu_decode_attend_args);
        return ATTEND_LAYOUT;
    }
    if (name && strcmp(name, "cpu_decode_write_args") == 0) {
        *n = (int)(sizeof WRITE_LAYOUT / sizeof WRITE_LAYOUT[0]);
        *size = (int64_t)sizeof(cpu_decode_write_args);
        return WRITE_LAYOUT;
    }
    return NULL;
}

/* The layout of the struct called name: sizes_and_offsets[0] = sizeof, then for field i (in declaration
 * order) [1 + 2i] its offsetof and [2 + 2i] its sizeof, as many of those as n allows. Returns the
 * struct's field count, or -1 for a name it does not know. */
int cpu_decode_args_layout(const char *name, int64_t *sizes_and_offsets, int n) {
    int fields = 0;
    int64_t size = 0;
    const field_layout_t *f = layout_of(name, &fields, &size);
    if (!f) return -1;
    if (sizes_and_offsets && n > 0) sizes_and_offsets[0] = size;
    for (int i = 0; i < fields; i++) {
        if (sizes_and_offsets && 1 + 2 * i < n) sizes_and_offsets[1 + 2 * i] = f[i].offset;
        if (sizes_and_offsets && 2 + 2 * i < n) sizes_and_offsets[2 + 2 * i] = f[i].size;
    }
    return fields;
}

/* the name of field i of the struct called name; NULL past its last field or for an unknown struct */
const char *cpu_decode_args_field(const char *name, int i) {
    int fields = 0;
    int64_t size = 0;
    const field_layout_t *f = layout_of(name, &fields, &size);
    return f && i >= 0 && i < fields ? f[i].name : NULL;
}

/* ---- scratch failures (tests) --------------------------------------------------------------------- */
int cpu_decode_fail_alloc(int n) {
    __atomic_store_n(&fail_alloc, n, __ATOMIC_SEQ_CST);
    return 0;
}

/* ---- ISA detection -------------------------------------------------------------------------------- */
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

/* 1 in the amx-emulated build (its AMX items run on amx_emu.h's plain-C tiles), else 0 */
int cpu_decode_amx_emulated(void) { return CPU_DECODE_AMX_EMULATED; }

/* ---- the split driver, shared by every form -------------------------------------------------------- */
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

/* A form's unit of work: paged and fp8, one (sequence, KV head) and its G query heads; latent, one
 * sequence and its H heads. run(ctx, unit, t0, t1, m, l, acc, nomem) fills the unit's rows — running
 * max m[rows], sum l[rows], unnormalised p·v acc[rows, width] — over its keys [t0, t1). */
typedef void (*unit_fn)(const void *ctx, long unit, int t0, int t1, float *m, float *l, float *acc, int *nomem);

typedef struct {
    long units;                /* units in the call */
    int per_seq;               /* units per sequence: unit u reads seq_lens[u / per_seq] */
    int rows, width;           /* output rows per unit (query heads), values per row */
    int splits, threads, dt;   /* KV splits per unit, OpenMP threads, the output's dtype */
    const int32_t *seq_lens;   /* [B] */
    float *ws;                 /* splits > 1: units · splits · rows · (width + 2) floats */
    void *out;                 /* [units · rows, width] in dt */
    unit_fn run;
    const void *ctx;
} drive_t;

/* Every (unit, KV split) item over the threads: split s of a unit takes its share of the sequence's
 * 16-key tiles; with one split an item normalises its rows into out, with more each leaves (m, l, acc)
 * in the workspace and every output row is merged from its splits (combine_row, one row at a time: all
 * threads take part at batch 1). Returns 0, or ERR_NOMEM when a scratch allocation was refused. */
static int drive(const drive_t *d) {
    const int R = d->rows, W = d->width, splits = d->splits;
    const long items = d->units * splits;
    const size_t part = (size_t)R * (W + 2);
    const int threads = d->threads < 1 ? 1 : d->threads;
    int nomem = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && items > 1)
    {
        float *own = splits == 1 ? (float *)scratch(sizeof(float) * part) : NULL;
        if (splits == 1 && !own) flag_nomem(&nomem);
#pragma omp for schedule(dynamic, 1)
        for (long w = 0; w < items; w++) {
            const long u = w / splits;
            const int s = (int)(w % splits), len = d->seq_lens[u / d->per_seq];
            const int ntiles = (len + TILE - 1) / TILE, per = (ntiles + splits - 1) / splits;
            const int t0 = s * per * TILE, t1 = (s + 1) * per * TILE < len ? (s + 1) * per * TILE : len;
            float *buf = splits == 1 ? own : d->ws + (size_t)w * part;
            if (!buf) continue;
            float *m = buf, *l = buf + R, *acc = buf + 2 * R;
            if (t0 < t1) {
                d->run(d->ctx, u, t0, t1, m, l, acc, &nomem);
            } else {
                reset_rows(m, l, acc, R, W); /* a split with no keys: merged with weight 0 */
            }
            if (splits == 1) {
                const size_t o = (size_t)u * R * W;
                for (int r = 0; r < R; r++) {
                    float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
                    for (int x = 0; x < W; x++) store_elem(d->out, o + (size_t)r * W + x, d->dt, acc[(size_t)r * W + x] * inv);
                }
            }
        }
        free(own);
        if (splits > 1) {
#pragma omp for schedule(static)
            for (long row = 0; row < d->units * R; row++) {
                const long u = row / R;
                const int r = (int)(row % R);
                const float *p0 = d->ws + (size_t)u * splits * part;
                combine_row(p0 + r, p0 + R + r, p0 + 2 * R + (size_t)r * W, part, splits, W, d->out, (size_t)row * W, d->dt);
            }
        }
    }
    return nomem ? ERR_NOMEM : 0;
}

/* ---- the paged and fp8 forms ---------------------------------------------------------------------- */
/* the item of the variant isa for its cache form: fp8 (it->ks set; cv: the conversion of the
 * c-avx512bf16 item) or fp32 / fp16 / bf16 */
static void run_item(const item_t *it, int isa, int cv) {
    (void)cv; /* read by the AVX-512 fp8 item only */
    if (it->ks) { /* an fp8 cache: AMX, the AVX-512 BF16 variant (bf16 q) with its conversion, else plain C */
#ifdef CPU_DECODE_AMX
        if (isa == ISA_AMX) {
            item_fp8_amx(it);
            return;
        }
#endif
#ifdef CPU_DECODE_AVX512
        if (isa == ISA_AVX512BF16) {
            (cv == CV_SHIFT ? item_fp8_shift : item_fp8_lookup)(it);
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

/* what every unit of a paged or fp8 call shares: the item's fields but its own, and where those come from */
typedef struct {
    item_t it;
    const void *q;
    const int32_t *block_table;
    int Hq, maxp, isa, cv;
    size_t qsize; /* bytes per query element */
} paged_t;

/* unit u = (sequence b, KV head h): the item of its G query heads over keys [t0, t1) */
static void paged_unit(const void *ctx, long u, int t0, int t1, float *m, float *l, float *acc, int *nomem) {
    const paged_t *p = (const paged_t *)ctx;
    item_t it = p->it;
    const int b = (int)(u / it.Hkv), h = (int)(u % it.Hkv);
    it.q = (const char *)p->q + ((size_t)b * p->Hq + (size_t)h * it.G) * it.D * p->qsize;
    it.bt = p->block_table + (size_t)b * p->maxp;
    it.t0 = t0;
    it.t1 = t1;
    it.h = h;
    it.m = m;
    it.l = l;
    it.acc = acc;
    it.nomem = nomem;
    run_item(&it, p->isa, p->cv);
}

/* the attention of one layer over a bf16/fp16/fp32 cache (fp8 = 0: the scales are not read) or an fp8 one */
static int attend(const cpu_decode_attend_args *a, int fp8) {
    const void *q = a->q, *kc = a->k_cache, *vc = a->v_cache;
    const float *ks = fp8 ? a->k_scales : NULL, *vs = fp8 ? a->v_scales : NULL;
    const int32_t *block_table = a->block_table, *seq_lens = a->seq_lens;
    void *out = a->out;
    float *ws = a->workspace;
    const int B = a->num_seqs, Hq = a->num_q_heads, Hkv = a->num_kv_heads, D = a->head_dim, ps = a->page_size;
    const int maxp = a->max_pages, splits = a->splits, dt = a->dtype, isa = a->isa, cv = a->fp8_convert;
    const int prefetch = a->prefetch;
    const float scale = a->scale;
    const int threads = a->threads;
    if (Hkv <= 0 || Hq % Hkv || Hq / Hkv > MAX_G || D % 16 || ps % TILE || splits < 1 || splits > MAX_SPLITS) return -1;
    if ((cv != CV_LOOKUP && cv != CV_SHIFT) || (cv == CV_SHIFT && (!ks || isa != ISA_AVX512BF16))) return -1;
    if (ks && (D % 32 || (isa != ISA_SCALAR && isa != ISA_AVX512BF16 && isa != ISA_AMX))) return -1;
    if (isa == ISA_AMX && (!ks || !amx_request() || Hq / Hkv > 16 || dt != DT_BF16)) return -3;
    if (isa == ISA_AVX512BF16 && dt != DT_BF16) return -2;
    if (isa == ISA_AVX512 && dt == DT_BF16) return -2;
    const int G = Hq / Hkv, P = dt == DT_BF16 ? 2 : 1;
    const paged_t p = {
        .it = {.kc = kc, .vc = vc, .G = G, .D = D, .ps = ps, .P = P, .Hkv = Hkv, .dt = dt, .prefetch = prefetch,
               .scale = scale, .ks = ks, .vs = vs},
        .q = q, .block_table = block_table, .Hq = Hq, .maxp = maxp, .qsize = dt == DT_F32 ? 4 : 2, .isa = isa, .cv = cv,
    };
    const drive_t d = {.units = (long)B * Hkv, .per_seq = Hkv, .rows = G, .width = D, .splits = splits,
                       .threads = threads, .dt = dt, .seq_lens = seq_lens, .ws = ws, .out = out, .run = paged_unit, .ctx = &p};
    return drive(&d);
}

/* Decode attention of one layer over an fp32 / fp16 / bf16 cache (a's k_scales, v_scales and
 * v_head_dim are not read; fp8_convert must be CV_LOOKUP). q [B, Hq, D] and out [B, Hq, D] in dtype;
 * block_table [B, max_pages] int32; seq_lens [B] int32; workspace: fp32, B · Hkv · splits · G · (D + 2)
 * floats (used only when splits > 1). Returns 0, ERR_NOMEM when a scratch allocation is refused, or
 * another negative code for arguments it refuses. */
int cpu_decode_attend(const cpu_decode_attend_args *a) { return a ? attend(a, 0) : -1; }

/* The same over an fp8 cache: k_cache, v_cache its bytes (fp8_phys order), k_scales, v_scales the
 * layer's float32 scales [pages, Hkv, ps]; q and out in dtype (bf16 for the AVX-512 and AMX variants);
 * D a multiple of 32; fp8_convert: CV_SHIFT or CV_LOOKUP with ISA_AVX512BF16, else CV_LOOKUP. */
int cpu_decode_attend_fp8(const cpu_decode_attend_args *a) {
    if (!a || !a->k_scales || !a->v_scales) return -1;
    return attend(a, 1);
}

/* ---- the latent form ------------------------------------------------------------------------------ */
/* the latent item of the variant isa (the entry point has checked that it runs here) */
static void run_latent_item(int isa, const char *qb, const void *kc, const int32_t *bt, int t0, int t1, int H, int Dk,
                            int Dv, int ps, int dt, float scale, float *m, float *l, float *acc, int *nomem) {
    (void)isa; /* a build without AVX-512 has one latent item */
#ifdef CPU_DECODE_AMX
    if (isa == ISA_AMX) {
        latent_item_amx((const uint16_t *)qb, (const uint16_t *)kc, bt, t0, t1, H, Dk, Dv, ps, scale, m, l, acc, nomem);
        return;
    }
#endif
#ifdef CPU_DECODE_AVX512
    if (isa == ISA_AVX512BF16) {
        latent_item_bf16((const uint16_t *)qb, (const uint16_t *)kc, bt, t0, t1, H, Dk, Dv, ps, scale, m, l, acc, nomem);
        return;
    }
#endif
    latent_item_scalar(qb, kc, bt, t0, t1, H, Dk, Dv, ps, dt, scale, m, l, acc, nomem);
}

/* what every unit of a latent call shares */
typedef struct {
    const void *q, *kc;
    const int32_t *block_table;
    int maxp, H, Dk, Dv, ps, dt, isa;
    float scale;
} latent_t;

/* unit b = sequence b: the latent item of its H heads over keys [t0, t1) */
static void latent_unit(const void *ctx, long b, int t0, int t1, float *m, float *l, float *acc, int *nomem) {
    const latent_t *c = (const latent_t *)ctx;
    const char *qb = (const char *)c->q + (size_t)b * c->H * c->Dk * (c->dt == DT_F32 ? 4 : 2);
    run_latent_item(c->isa, qb, c->kc, c->block_table + (size_t)b * c->maxp, t0, t1, c->H, c->Dk, c->Dv, c->ps, c->dt,
                    c->scale, m, l, acc, nomem);
}

/* Decode attention of one layer in the MLA latent form: q [B, H, Dk] and out [B, H, Dv] in dtype
 * (H = num_q_heads, Dk = head_dim, Dv = v_head_dim); k_cache: the layer's rows [pages, ps, Dk];
 * block_table [B, max_pages] int32; seq_lens [B] int32; workspace: fp32, B · splits · H · (Dv + 2)
 * floats (used only when splits > 1). v_cache, the scales, num_kv_heads and prefetch are not read;
 * fp8_convert must be CV_LOOKUP. isa: ISA_AMX or ISA_AVX512BF16 (bf16, Dk % 32 == 0 for AMX, even for
 * AVX-512 BF16, Dv % 16 == 0; pages of ≤ 128 keys) or ISA_SCALAR. Returns 0, ERR_NOMEM when a scratch
 * allocation is refused, or another negative code for arguments it refuses. */
int cpu_decode_attend_latent(const cpu_decode_attend_args *a) {
    if (!a) return -1;
    const void *q = a->q, *kc = a->k_cache;
    const int32_t *block_table = a->block_table, *seq_lens = a->seq_lens;
    void *out = a->out;
    float *ws = a->workspace;
    const int B = a->num_seqs, H = a->num_q_heads, Dk = a->head_dim, Dv = a->v_head_dim, ps = a->page_size;
    const int maxp = a->max_pages, splits = a->splits, dt = a->dtype, isa = a->isa;
    const float scale = a->scale;
    const int threads = a->threads;
    if (a->fp8_convert != CV_LOOKUP) return -1;
    if (H < 1 || Dv > Dk || ps % TILE || splits < 1 || splits > MAX_SPLITS) return -1;
    if (isa != ISA_SCALAR && isa != ISA_AVX512BF16 && isa != ISA_AMX) return -1;
    if (isa != ISA_SCALAR && (dt != DT_BF16 || Dk % (isa == ISA_AMX ? 32 : 2) || Dv % 16 || ps > 128)) return -3;
    if ((isa == ISA_AMX && !amx_request()) || (isa == ISA_AVX512BF16 && cpu_decode_isa() < ISA_AVX512BF16)) return -3;
    const latent_t c = {.q = q, .kc = kc, .block_table = block_table, .maxp = maxp, .H = H, .Dk = Dk, .Dv = Dv,
                        .ps = ps, .dt = dt, .isa = isa, .scale = scale};
    const drive_t d = {.units = B, .per_seq = 1, .rows = H, .width = Dv, .splits = splits, .threads = threads,
                       .dt = dt, .seq_lens = seq_lens, .ws = ws, .out = out, .run = latent_unit, .ctx = &c};
    return drive(&d);
}
