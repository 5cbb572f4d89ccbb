"""What ``cpu_decode``'s and ``cpu_decode_fp8``'s writers cost per new token and layer (one thread).

Every decode step writes each sequence's new K/V into every layer's pages before attending
(``decode()`` calls the writer, then the kernel): for the fp8 cache the writer also takes each row's
amax and rounds it to e4m3. At short context or a large batch this is a visible share of a step. This
script times the writer alone, as ``decode()`` calls it (the Python call included), for batches of
one new token per sequence; the slope between the smallest and the largest batch is its cost per
token, the smallest batch's time its cost per call. Rounds interleave the caches; each figure is the
median over rounds of a block's median call.

    python scripts/cpu_writer_cost.py --out results/cpu/kernels/cpu-writer-cost
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
from attnbench.core.workload import Workload, parse_int_list

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from microbench import kernel_or_refuse, median_call_s, print_and_save_report, script_run_record  # noqa: E402

MODEL = "llama-3.1-8b"


def _ready(backend: CpuDecodeBackend, batch: int) -> tuple[Any, Any, torch.Tensor]:
    """A one-layer cache with room for 4096 tokens per sequence, a one-token plan and the new K/V."""
    w = Workload.uniform(MODEL, batch=batch, context=1024, dtype="bf16")
    g = w.geometry("expanded")
    cache = backend.create_cache(w, config={}, num_layers=1, max_seq_len=4096)
    new = torch.randn(batch, 1, g.num_kv_heads, g.qk_head_dim, generator=torch.Generator().manual_seed(batch))
    return cache, backend.plan(cache, num_new=[1] * batch), new.bfloat16()


def _block(backend: CpuDecodeBackend, cache: Any, plan: Any, new: torch.Tensor, calls: int) -> float:
    """The median seconds of ``calls`` writes of ``new`` as decode() writes into this cache."""
    return median_call_s(lambda: backend.append(cache, plan, layer=0, k=new, v=new), calls)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", default="1,8,64", help="batches (new tokens per call), comma-separated")
    ap.add_argument("--calls", type=positive_int, default=200, help="calls per cache, batch and round")
    ap.add_argument(
        "--rounds", type=positive_int, default=5, help="interleaved rounds; each figure is their median"
    )
    ap.add_argument("--out", default="results/cpu/kernels/cpu-writer-cost")
    args = ap.parse_args(argv)
    try:
        batches = parse_int_list(args.batch, field="--batch")
    except ValueError as exc:
        ap.error(str(exc))
    if len(set(batches)) < 2:
        ap.error(f"--batch {args.batch!r}: at least two different batches (the slope needs two)")
    kernel = kernel_or_refuse(ap)
    torch.set_num_threads(1)
    start, load_start = time.time(), os.getloadavg()
    backends: dict[str, CpuDecodeBackend] = {"cpu_decode (bf16)": CpuDecodeBackend()}
    if (
        not CpuDecodeFp8Backend()
        .resolve(Workload.uniform(MODEL, batch=1, context=1024, dtype="bf16"))
        .reasons
    ):
        backends["cpu_decode_fp8"] = CpuDecodeFp8Backend()
    setups = {(label, b): _ready(backend, b) for label, backend in backends.items() for b in batches}
    got: dict[tuple[str, int], list[float]] = {key: [] for key in setups}
    for r in range(args.rounds):
        for (label, b), (cache, plan, new) in setups.items():
            got[label, b].append(_block(backends[label], cache, plan, new, args.calls))
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    lo, hi = min(batches), max(batches)
    rows = []
    for label in backends:
        med = {b: statistics.median(got[label, b]) for b in batches}
        rows.append(
            {
                "cache": label,
                "us_per_call": {str(b): med[b] * 1e6 for b in batches},
                "us_per_token": (med[hi] - med[lo]) / (hi - lo) * 1e6,
                "block_medians_s": {str(b): got[label, b] for b in batches},
            }
        )
    report = script_run_record(
        args, parser=ap, prog="python scripts/cpu_writer_cost.py", load_start=load_start, started=start
    ) | {
        "threads": 1,
        "model": MODEL,
        "kernel": str(kernel.path.name),
        "rows": rows,
    }
    lines = [
        "# The cpu_decode writers' cost per call and per new token (one layer, one thread)",
        "",
        run_line(report)
        + f"; {MODEL}'s K/V (8 KV heads × 128), one new token per sequence, the write as decode() calls it; "
        f"{args.rounds} interleaved rounds of {args.calls} calls.",
        "",
        "| cache | "
        + " | ".join(f"µs / call, batch {b}" for b in batches)
        + f" | µs / token ({lo} → {hi}) |",
        "| --- | " + " | ".join("---" for _ in batches) + " | --- |",
    ]
    for row in rows:
        per_call = " | ".join(f"{row['us_per_call'][str(b)]:.1f}" for b in batches)
        lines.append(f"| {row['cache']} | {per_call} | {row['us_per_token']:.2f} |")
    return print_and_save_report(args.out, report, lines)


if __name__ == "__main__":
    raise SystemExit(main())
