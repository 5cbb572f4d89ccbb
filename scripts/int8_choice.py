"""Why the CPU kernel's compact K/V cache is fp8 feeding bf16 dot products and not int8 with VNNI.

An int8 cache (per token-head scales) could feed AVX-512 VNNI's ``vpdpbusd``, 64 multiply-adds per
512-bit instruction where ``vdpbf16ps`` does 32, but only with q and the softmax weights P as 8-bit
integers too. This script measures the two facts that decide it, on the machine it runs on:

1. **Accuracy**, against the correctness gate's stored-K/V reference (float64 attention over the
   cache's dequantised K/V; the gate allows 2 × the error of a careful float32 computation whose output
   is rounded to bf16, plus small floors): the error of each arithmetic, as a multiple of that
   calibration error, over fresh random inputs (Llama-3.1-8B's heads: 32 query heads over 8 KV heads
   of 128, int8 K/V with per-token-head absmax scales).
2. **Throughput** of one 512-bit ``vpdpbusd`` and one ``vdpbf16ps`` (12 independent accumulators,
   timed in a loop of inline assembly compiled with the kernel's compiler), where the CPU has both.

    python scripts/int8_choice.py --context 1k,4k --seeds 5 --out results/cpu/kernels/int8-choice
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from attnbench.cli.common import positive_int, positive_int_list, run_line
from attnbench.correctness.reference import compare, reference_pair

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from microbench import compile_c, print_and_save_report, script_run_record  # noqa: E402

HKV, G, D = 8, 4, 128

#: name → (q as the kernel would hold it, P as the kernel would hold it)
ARITHMETIC = {
    "bf16 q, bf16 P (cpu_decode_fp8's arithmetic)": ("bf16", "bf16"),
    "int8 q (one vpdpbusd pass), bf16 P": ("int8", "bf16"),
    "q in two int8 passes (hi, lo), bf16 P": ("int8x2", "bf16"),
    "bf16 q, P as u8 per 16-key tile": ("bf16", "u8"),
    "int8 q, P as u8 per 16-key tile (all-VNNI)": ("int8", "u8"),
}

ASM = r"""
#include <stdio.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
#define TWELVE(op) op " %%zmm1,%%zmm0,%%zmm2\n" op " %%zmm1,%%zmm0,%%zmm3\n" op " %%zmm1,%%zmm0,%%zmm4\n" \
    op " %%zmm1,%%zmm0,%%zmm5\n" op " %%zmm1,%%zmm0,%%zmm6\n" op " %%zmm1,%%zmm0,%%zmm7\n" op " %%zmm1,%%zmm0,%%zmm8\n" \
    op " %%zmm1,%%zmm0,%%zmm9\n" op " %%zmm1,%%zmm0,%%zmm10\n" op " %%zmm1,%%zmm0,%%zmm11\n" op " %%zmm1,%%zmm0,%%zmm12\n" \
    op " %%zmm1,%%zmm0,%%zmm13\n"
#define CLOBBER "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13"
int main(void) {
    const long n = 50000000;
    for (int rep = 0; rep < 3; rep++) {
        double t0 = now();
        for (long i = 0; i < n / 12; i++) __asm__ volatile(TWELVE("vpdpbusd") ::: CLOBBER);
        double t1 = now();
        for (long i = 0; i < n / 12; i++) __asm__ volatile(TWELVE("vdpbf16ps") ::: CLOBBER);
        double t2 = now();
        printf("%.6f %.6f\n", (t1 - t0) / n * 1e9, (t2 - t1) / n * 1e9);
    }
    return 0;
}
"""


def _quantize(x: torch.Tensor, levels: int) -> torch.Tensor:
    """Round ``x`` to ``levels`` steps either side of zero per row (absmax scale), as float64."""
    s = x.double().abs().amax(-1, keepdim=True) / levels
    return (x.double() / s).round().clamp(-levels, levels) * s


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p_form: str) -> torch.Tensor:
    """Decode attention in float64 with P held as ``p_form``; the output rounded to bf16."""
    b, t = k.shape[:2]
    s = torch.einsum("bhgd,bthd->bhgt", q.view(b, HKV, G, D), k) / math.sqrt(D)
    p = torch.exp(s - s.amax(-1, keepdim=True))  # unnormalised, as a kernel holds it
    if p_form == "bf16":
        p = p.float().bfloat16().double()
    else:  # u8 against each 16-key tile's largest weight
        tiles = p.view(b, HKV, G, t // 16, 16)
        top = tiles.amax(-1, keepdim=True)
        p = ((tiles / top * 255).round() / 255 * top).view_as(p)
    o = torch.einsum("bhgt,bthd->bhgd", p, v) / p.sum(-1, keepdim=True)
    return o.reshape(b, HKV * G, D).bfloat16()


def accuracy(context: int, seeds: int) -> dict[str, list[float]]:
    """Each arithmetic's rel_l2 error over the calibration's, per seed (fresh inputs each)."""
    out: dict[str, list[float]] = {name: [] for name in ARITHMETIC}
    for _ in range(seeds):
        gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
        q = torch.randn(1, HKV * G, D, generator=gen).bfloat16()
        k = _quantize(torch.randn(1, context, HKV, D, generator=gen), 127)  # the stored (dequantised) K/V
        v = _quantize(torch.randn(1, context, HKV, D, generator=gen), 127)
        ref, cals = reference_pair(q, k, v, [context], scale=1 / math.sqrt(D))
        calibration = max(compare(c, ref).rel_l2 for c in cals)
        for name, (q_form, p_form) in ARITHMETIC.items():
            qf = {"bf16": q.double(), "int8": _quantize(q, 127), "int8x2": _quantize(q, 127 * 128)}[q_form]
            out[name].append(compare(_attend(qf, k, v, p_form), ref).rel_l2 / calibration)
    return out


def throughput() -> dict[str, float] | str:
    """ns per 512-bit instruction (best of 3), or why it was not measured."""
    info = Path("/proc/cpuinfo")
    flags = set(info.read_text().split()) if info.exists() else set()
    if not {"avx512_vnni", "avx512_bf16"} <= flags:
        return "the CPU lacks AVX-512 VNNI or AVX-512 BF16"
    with tempfile.TemporaryDirectory() as tmp:
        exe = compile_c(ASM, Path(tmp) / "dot", ["-O2"])
        if exe is None:
            return "no C compiler"
        lines = subprocess.run(
            [str(exe)], check=True, capture_output=True, text=True, timeout=300
        ).stdout.split("\n")
    pairs = [tuple(map(float, line.split())) for line in lines if line.strip()]
    return {"vpdpbusd": min(p[0] for p in pairs), "vdpbf16ps": min(p[1] for p in pairs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--context",
        type=positive_int_list,
        default="1k,4k",
        help="contexts (multiples of 16), comma-separated",
    )
    ap.add_argument("--seeds", type=positive_int, default=5, help="fresh random inputs per context")
    ap.add_argument("--out", default="results/cpu/kernels/int8-choice")
    args = ap.parse_args()
    contexts = args.context
    bad = [c for c in contexts if c < 16 or c % 16]
    if bad:
        ap.error(
            f"--context {','.join(map(str, contexts))}: {bad} are not positive multiples of 16 (the 16-key tiles P is held in)"
        )
    start, load_start = time.time(), os.getloadavg()
    errors = {c: accuracy(c, args.seeds) for c in contexts}
    tp = throughput()
    report = script_run_record(
        args, parser=ap, prog="python scripts/int8_choice.py", load_start=load_start, started=start
    ) | {"error_over_calibration": errors, "ns_per_instruction": tp}
    lines = [
        "# int8 with VNNI or fp8 into bf16 dot products: the two facts",
        "",
        run_line(report) + ".",
        "",
        f"**Accuracy** against the gate's stored-K/V reference (int8 K/V, Llama-3.1-8B heads, {args.seeds} fresh "
        "seeds per context): worst rel_l2 error as a multiple of the calibration error. The gate allows 2 "
        "(plus floors far below one bf16 step).",
        "",
        "| arithmetic | " + " | ".join(f"{c} tokens" for c in contexts) + " |",
        "| --- | " + " | ".join("---" for _ in contexts) + " |",
    ]
    for name in ARITHMETIC:
        lines.append(f"| {name} | " + " | ".join(f"{max(errors[c][name]):.2f}" for c in contexts) + " |")
    lines += ["", "**Throughput**, ns per 512-bit instruction (12 independent accumulators, best of 3):", ""]
    if isinstance(tp, str):
        lines.append(f"not measured: {tp}.")
    else:
        lines += [
            "| instruction | multiply-adds | ns | multiply-adds per ns |",
            "| --- | --- | --- | --- |",
            f"| vpdpbusd (u8 × s8 → s32) | 64 | {tp['vpdpbusd']:.3f} | {64 / tp['vpdpbusd']:.0f} |",
            f"| vdpbf16ps (bf16 × bf16 → fp32) | 32 | {tp['vdpbf16ps']:.3f} | {32 / tp['vdpbf16ps']:.0f} |",
        ]
    return print_and_save_report(args.out, report, lines)


if __name__ == "__main__":
    raise SystemExit(main())
