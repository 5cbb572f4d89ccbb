"""How long ``cpu_decode``'s arithmetic takes per token when the cache costs nothing to read (one thread).

``bench``'s ``% read`` holds a step to the time the read bandwidth needs for its bytes. For the fp8 cache
the bytes halve but the arithmetic does not: the same bf16 dot products as the bf16 kernel (after a
conversion of every byte). This script times each kernel on caches small enough to stay in its caches
(llama-3.1-8b's attention, batch 1, one layer called again and again, so every read after the first
hits the cache): the slope between two contexts (``--contexts``, default 256 and 768 tokens: 0.5 and
1.5 MiB of fp8, 1 and 3 MiB of bf16, about the size of one core's L2 and far under the last-level
cache) is the kernel's time per token with the reads nearly free. Beside it, the same run's read bar (:class:`attnbench.core.device.ReadMeter`, 512 MiB in 2 MiB
pages) and the bf16 matmul peak (:func:`attnbench.cost.gpuspec.matmul_peak`) give the time per token a
step at 100 % and at 70 % of the read bar would take, and the arithmetic's floor at the matmul peak.
Rounds interleave the kernels; a round's slope is the difference of its two blocks' median calls; the
table gives the median slope over rounds and the best (the VM's other tenants slow some rounds by up
to half).

    python scripts/fp8_arithmetic_ceiling.py --rounds 5 --out results/cpu/kernels/fp8-arithmetic-ceiling
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from attnbench.backends.cpu_decode import CpuDecodeBackend
from attnbench.backends.cpu_decode_fp8 import CpuDecodeFp8Backend
from attnbench.cli.common import positive_int, run_line
from attnbench.core.backend import Backend
from attnbench.core.device import ReadMeter
from attnbench.core.workload import Workload, parse_tokens
from attnbench.cost.gpuspec import matmul_peak

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from microbench import kernel_or_refuse, median_call_s, print_and_save_report, script_run_record  # noqa: E402

MODEL = "llama-3.1-8b"


def _ready(backend: Backend, context: int) -> tuple[Any, Any, torch.Tensor, torch.Tensor]:
    """A one-layer cache of ``context`` tokens (random K/V), its one-token plan, q and the new K/V."""
    w = Workload.uniform(MODEL, batch=1, context=context, dtype="bf16")
    g = w.geometry("expanded")
    cache = backend.create_cache(w, config={}, num_layers=1, max_seq_len=context + 1)
    gen = torch.Generator().manual_seed(context)
    kv = torch.randn(1, context - 1, g.num_kv_heads, g.qk_head_dim, generator=gen).bfloat16()
    backend.append(cache, backend.plan(cache, num_new=[context - 1]), layer=0, k=kv, v=kv)
    cache.commit(backend.plan(cache, num_new=[0]))
    cache.seq_lens = (context - 1,)
    q = torch.randn(1, g.num_q_heads, g.qk_head_dim, generator=gen).bfloat16()
    new = torch.randn(1, g.num_kv_heads, g.qk_head_dim, generator=gen).bfloat16()
    return cache, backend.plan(cache, num_new=[1]), q, new


def _block(backend: Backend, cache: Any, plan: Any, q: torch.Tensor, new: torch.Tensor, calls: int) -> float:
    """The median seconds of ``calls`` calls of the layer (the first two, which warm the cache, dropped)."""
    return median_call_s(lambda: backend.decode(cache, plan, layer=0, q=q, k=new, v=new), calls)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--contexts", default="256,768", help="the two context lengths of the slope (k suffix allowed)"
    )
    ap.add_argument("--calls", type=positive_int, default=200, help="calls per kernel, context and round")
    ap.add_argument(
        "--rounds", type=positive_int, default=5, help="interleaved rounds; each figure is their median"
    )
    ap.add_argument("--out", default="results/cpu/kernels/fp8-arithmetic-ceiling")
    args = ap.parse_args()
    try:
        lo, hi = (parse_tokens(x, field="--contexts") for x in args.contexts.split(","))
    except ValueError as exc:
        ap.error(f"--contexts {args.contexts!r}: two lengths, such as 256,768 ({exc})")
    if not 16 <= lo < hi:
        ap.error(f"--contexts {args.contexts!r}: the first must be ≥ 16 and below the second")
    kernel_or_refuse(ap)  # before anything is measured
    torch.set_num_threads(1)
    start, load_start = time.time(), os.getloadavg()
    backends = {"cpu_decode (bf16)": CpuDecodeBackend(), "cpu_decode_fp8": CpuDecodeFp8Backend()}
    for label, b in backends.items():
        reasons = b.resolve(Workload.uniform(MODEL, batch=1, context=lo, dtype="bf16")).reasons
        if reasons:
            ap.error(f"{label} cannot run here: {'; '.join(reasons)}")
    setups = {(label, c): _ready(b, c) for label, b in backends.items() for c in (lo, hi)}
    meter = ReadMeter("cpu", 512 * 2**20)
    bars: list[float] = []
    got: dict[tuple[str, int], list[float]] = {key: [] for key in setups}
    for r in range(args.rounds):
        bars.append((meter() or 0.0) / 1e9)
        for (label, c), (cache, plan, q, new) in setups.items():
            got[label, c].append(_block(backends[label], cache, plan, q, new, args.calls))
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    bars.append((meter() or 0.0) / 1e9)
    peak = matmul_peak(torch.device("cpu"), torch.bfloat16)
    bar = statistics.median(bars) * 1e9
    w = Workload.uniform(MODEL, batch=1, context=lo, dtype="bf16")
    g = w.geometry("expanded")
    flops_per_token = 2 * 2 * g.num_q_heads * g.qk_head_dim  # q·k and p·v, one layer
    rows = []
    for label, b in backends.items():
        per_token_bytes = b.kv_bytes_per_token(w, config=b.default_config()) / w.shape.num_layers
        # per round: the two contexts' blocks ran back to back, so their difference is that round's slope
        slopes = [(h - low) / (hi - lo) for low, h in zip(got[label, lo], got[label, hi], strict=True)]
        rows.append(
            {
                "kernel": label,
                "bytes_per_token": per_token_bytes,
                "warm_ns_per_token": statistics.median(slopes) * 1e9,
                "warm_best_ns_per_token": min(slopes) * 1e9,
                "slopes_ns_per_token": [x * 1e9 for x in slopes],
                "read_floor_ns": per_token_bytes / bar * 1e9,
                "at_70pct_ns": per_token_bytes / (0.7 * bar) * 1e9,
                "matmul_floor_ns": flops_per_token / peak * 1e9,
                "block_medians_s": {str(c): got[label, c] for c in (lo, hi)},
            }
        )
    report = script_run_record(
        args, parser=ap, prog="python scripts/fp8_arithmetic_ceiling.py", load_start=load_start, started=start
    ) | {
        "threads": 1,
        "model": MODEL,
        "read_bar_gbps": bars,
        "matmul_peak_bf16_flops": peak,
        "rows": rows,
    }
    lines = [
        "# cpu_decode's arithmetic per token with the cache nearly free to read (one thread)",
        "",
        run_line(report)
        + f"; {MODEL}'s attention, batch 1, one layer; the slope between {lo} and {hi} tokens of caches that "
        f"stay in the caches; {args.rounds} interleaved rounds of {args.calls} calls.",
        "",
        f"The read bar (`ReadMeter`, before each round and after the last): median {bar / 1e9:.1f} GB/s "
        f"({', '.join(f'{x:.1f}' for x in bars)}). The bf16 matmul peak (best of 1024² and 2048²): "
        f"{peak / 1e9:.0f} GFLOP/s, {flops_per_token} FLOPs a token.",
        "",
        "| kernel | bytes / token | warm cache: ns / token, median (best round) | read at the bar: ns / token "
        "| at 70 % of the bar | FLOPs at the matmul peak |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        lines.append(
            f"| {row['kernel']} | {row['bytes_per_token']:.0f} | {row['warm_ns_per_token']:.1f} "
            f"({row['warm_best_ns_per_token']:.1f}) | "
            f"{row['read_floor_ns']:.1f} | {row['at_70pct_ns']:.1f} | {row['matmul_floor_ns']:.1f} |"
        )
    return print_and_save_report(args.out, report, lines)


if __name__ == "__main__":
    raise SystemExit(main())
