/* amx_emu.h — the AMX tile operations the kernel's AMX items use (decode_fp8.h, decode_latent.h), in
 * plain C, so that they run (and are tested) on CPUs without AMX. Included by isa_amx.h only when built
 * with -DCPU_DECODE_AMX_EMULATE (backends/cpu_kernel.py's "amx-emulated" build, which the tests load
 * beside the native one); the native build never sees this file.
 *
 * Contents: the tile state (8 tiles of up to 16 rows × 64 bytes, one set per thread, as the hardware
 * keeps one per logical CPU) · the configuration (palette 1, _tile_loadconfig / _tile_release) · loads,
 * stores and zeroing · tdpbf16ps · the checks.
 *
 * Semantics follow the Intel SDM's pseudocode for palette 1: a load fills rows [0, rows) with colsb
 * bytes from base + row · stride and zeroes the rest of the tile; a store writes rows [0, rows) ×
 * colsb bytes; tdpbf16ps(c, a, b) adds to c[m][n] (fp32, n < c.colsb / 4) the products
 * a[m].bf16[2k + i] · b[k].bf16[2n + i] over k < a.colsb / 4 and i = 0, 1, bf16 inputs that are
 * denormal read as zero and denormal results flushed to zero. Every operand check the hardware makes
 * (#UD: no configuration, a tile index above 7, c.rows != a.rows, a.colsb / 4 != b.rows,
 * c.colsb != b.colsb, the same tile twice, rows or colsb past the palette's 16 and 64) stops the
 * process with a message naming the operation and the tiles, as #UD would stop it with SIGILL: an
 * indexing error in an AMX item is loud here too. The memory a load or store touches is read and
 * written with memcpy, so AddressSanitizer sees every byte of it (it cannot see a real tile load). */
#ifndef CPU_DECODE_AMX_EMU_H
#define CPU_DECODE_AMX_EMU_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int configured;
    uint8_t rows[8];
    uint16_t colsb[8];
    uint8_t data[8][16][64];
} amx_emu_state_t;

static __thread amx_emu_state_t amx_emu;

static void amx_emu_fault(const char *op, const char *why, int t0, int t1, int t2) {
    fprintf(stderr, "amx_emu: %s(%d, %d, %d): %s (the hardware raises #UD)\n", op, t0, t1, t2, why);
    abort();
}

static void amx_emu_check(const char *op, int t) {
    if (!amx_emu.configured) amx_emu_fault(op, "no tile configuration loaded", t, -1, -1);
    if (t < 0 || t > 7) amx_emu_fault(op, "tile index outside 0..7", t, -1, -1);
    if (amx_emu.rows[t] == 0 || amx_emu.colsb[t] == 0) amx_emu_fault(op, "tile not configured (0 rows or bytes)", t, -1, -1);
}

/* the layout of the 64-byte configuration (palette 1) that _tile_loadconfig reads */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) amx_emu_cfg_t;

static inline void amx_emu_loadconfig(const void *p) {
    amx_emu_cfg_t c;
    memcpy(&c, p, sizeof c);
    if (c.palette == 0) { /* palette 0: the init state */
        memset(&amx_emu, 0, sizeof amx_emu);
        return;
    }
    if (c.palette != 1) amx_emu_fault("_tile_loadconfig", "palette other than 0 or 1", c.palette, -1, -1);
    if (c.start_row) amx_emu_fault("_tile_loadconfig", "start_row not 0", c.start_row, -1, -1);
    for (int i = 0; i < 14; i++)
        if (c.reserved[i]) amx_emu_fault("_tile_loadconfig", "reserved byte not 0", i, -1, -1);
    for (int t = 0; t < 16; t++) {
        if (t >= 8 && (c.rows[t] || c.colsb[t])) amx_emu_fault("_tile_loadconfig", "tile 8..15 configured", t, -1, -1);
        if (t < 8 && (c.rows[t] > 16 || c.colsb[t] > 64)) amx_emu_fault("_tile_loadconfig", "rows > 16 or colsb > 64", t, -1, -1);
        if (t < 8 && (c.rows[t] == 0) != (c.colsb[t] == 0)) amx_emu_fault("_tile_loadconfig", "rows or colsb 0 alone", t, -1, -1);
    }
    memset(&amx_emu, 0, sizeof amx_emu);
    amx_emu.configured = 1;
    for (int t = 0; t < 8; t++) {
        amx_emu.rows[t] = c.rows[t];
        amx_emu.colsb[t] = c.colsb[t];
    }
}

static inline void amx_emu_release(void) { memset(&amx_emu, 0, sizeof amx_emu); }

static inline void amx_emu_zero(int t) {
    amx_emu_check("_tile_zero", t);
    memset(amx_emu.data[t], 0, sizeof amx_emu.data[t]);
}

static inline void amx_emu_loadd(int t, const void *base, long stride) {
    amx_emu_check("_tile_loadd", t);
    memset(amx_emu.data[t], 0, sizeof amx_emu.data[t]);
    for (int r = 0; r < amx_emu.rows[t]; r++)
        memcpy(amx_emu.data[t][r], (const char *)base + (long)r * stride, amx_emu.colsb[t]);
}

static inline void amx_emu_stored(int t, void *base, long stride) {
    amx_emu_check("_tile_stored", t);
    for (int r = 0; r < amx_emu.rows[t]; r++) memcpy((char *)base + (long)r * stride, amx_emu.data[t][r], amx_emu.colsb[t]);
}

/* a bf16 value as fp32, denormals as zero (the instruction's DAZ on its inputs) */
static inline float amx_emu_bf16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    if ((h & 0x7f80u) == 0) h &= 0x8000u;
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline void amx_emu_dpbf16ps(int c, int a, int b) {
    amx_emu_check("_tile_dpbf16ps", c);
    amx_emu_check("_tile_dpbf16ps", a);
    amx_emu_check("_tile_dpbf16ps", b);
    const char *op = "_tile_dpbf16ps";
    if (c == a || c == b || a == b) amx_emu_fault(op, "the same tile twice", c, a, b);
    if (amx_emu.colsb[c] % 4 || amx_emu.colsb[a] % 4 || amx_emu.colsb[b] % 4) amx_emu_fault(op, "colsb not a multiple of 4", c, a, b);
    if (amx_emu.rows[c] != amx_emu.rows[a]) amx_emu_fault(op, "c.rows != a.rows", c, a, b);
    if (amx_emu.colsb[a] / 4 != amx_emu.rows[b]) amx_emu_fault(op, "a.colsb / 4 != b.rows", c, a, b);
    if (amx_emu.colsb[c] != amx_emu.colsb[b]) amx_emu_fault(op, "c.colsb != b.colsb", c, a, b);
    const int M = amx_emu.rows[c], K = amx_emu.colsb[a] / 4, N = amx_emu.colsb[c] / 4;
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            float acc;
            memcpy(&acc, amx_emu.data[c][m] + 4 * n, 4);
            for (int k = 0; k < K; k++) {
                acc += amx_emu_bf16(amx_emu.data[a][m] + 4 * k) * amx_emu_bf16(amx_emu.data[b][k] + 4 * n);
                acc += amx_emu_bf16(amx_emu.data[a][m] + 4 * k + 2) * amx_emu_bf16(amx_emu.data[b][k] + 4 * n + 2);
            }
            uint32_t u;
            memcpy(&u, &acc, 4);
            if ((u & 0x7f800000u) == 0) u &= 0x80000000u; /* FTZ */
            memcpy(amx_emu.data[c][m] + 4 * n, &u, 4);
        }
}

/* the intrinsics' names, for the AMX items as they are written (immintrin.h defines some as macros) */
#undef _tile_loadconfig
#undef _tile_release
#undef _tile_zero
#undef _tile_loadd
#undef _tile_stored
#undef _tile_dpbf16ps
#define _tile_loadconfig(p) amx_emu_loadconfig(p)
#define _tile_release() amx_emu_release()
#define _tile_zero(t) amx_emu_zero(t)
#define _tile_loadd(t, base, stride) amx_emu_loadd((t), (base), (long)(stride))
#define _tile_stored(t, base, stride) amx_emu_stored((t), (base), (long)(stride))
#define _tile_dpbf16ps(c, a, b) amx_emu_dpbf16ps((c), (a), (b))

#endif
