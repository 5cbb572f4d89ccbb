/* isa_amx.h — AMX: the tile configuration, and which tile operations the AMX items run: the compiler's
 * intrinsics (the native build, where the compiler has them) or amx_emu.h's plain-C emulation (the
 * amx-emulated build, -DCPU_DECODE_AMX_EMULATE, which runs the AMX items on any CPU with AVX-512 BF16 +
 * VBMI and checks every operand the hardware would refuse). The AMX items are in decode_fp8.h and
 * decode_latent.h.
 *
 * Contents, in order:
 *   tilecfg_t                  the 64-byte tile configuration (palette 1) _tile_loadconfig takes
 *   TGT_AMX                    the target attribute of the AMX items (without the amx-* features when
 *                              emulated: the emulation is plain C)
 *   amx_request                whether the AMX items may run: AMX-TILE + AMX-BF16 and the OS's grant of
 *                              the tile data (once per process); emulated, AVX-512 BF16 + VBMI
 *   CPU_DECODE_AMX_EMULATED    1 in the emulated build (cpu_decode_amx_emulated() returns it), else 0
 * Without CPU_DECODE_AMX (no AVX-512, or a compiler without the AMX intrinsics) only amx_request (0)
 * and CPU_DECODE_AMX_EMULATED (0).
 */
#ifndef CPU_DECODE_ISA_AMX_H
#define CPU_DECODE_ISA_AMX_H

#ifdef CPU_DECODE_AMX
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tilecfg_t;

#ifdef CPU_DECODE_AMX_EMULATE
/* the tile operations in plain C (amx_emu.h): the AMX items run wherever their AVX-512 parts do */
#include "amx_emu.h"
#define TGT_AMX __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx512vbmi")))
#define CPU_DECODE_AMX_EMULATED 1

static int amx_request(void) {
    __builtin_cpu_init();
    return cpu_decode_isa() == ISA_AVX512BF16 && __builtin_cpu_supports("avx512vbmi");
}
#else
#include <sys/syscall.h>
#include <unistd.h>
#define TGT_AMX __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx512vbmi,amx-tile,amx-bf16")))
#define CPU_DECODE_AMX_EMULATED 0

static int amx_granted = 0;

/* AMX-TILE and AMX-BF16 in CPUID, and the kernel's permission to use the tile data (once per process) */
static int amx_request(void) {
    unsigned a, b, c, d;
    if (amx_granted) return 1;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 22) & 1u) || !((d >> 24) & 1u)) return 0;
    amx_granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return amx_granted;
}
#endif
#else
static int amx_request(void) { return 0; }
#define CPU_DECODE_AMX_EMULATED 0
#endif

#endif
