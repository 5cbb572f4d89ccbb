"""Measure the ``fp8`` backend's error over many random seeds and shapes (how its bounds were chosen).

For every (shape, context lengths, compute dtype, scale granularity, seed) the correctness gate runs
the backend and records two errors: against exact float64 attention (fp8 rounding + arithmetic) and
against float64 attention over the dequantised bytes (arithmetic only). Prints the distribution and
writes JSON; docs/fp8.md quotes the result and sets the declared bounds with a margin above the worst
case seen. Usage::

    python scripts/fp8_accuracy.py --seeds 8 --out results/cpu/accuracy/bench-cpu-fp8-accuracy.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from rich.console import Console
from rich.progress import track
from rich.table import Table

from attnbench.backends.fp8 import EXACT_TOLERANCE, STORED_TOLERANCE, FP8Backend
from attnbench.core.device import fingerprint
from attnbench.core.shapes import ModelShape
from attnbench.core.workload import Workload
from attnbench.correctness.gate import check

# (query heads, kv heads, head_dim): MHA, GQA (Llama-3 8B ratio), MQA, wide heads
GEOMETRIES = ((4, 4, 64), (8, 2, 128), (8, 1, 64), (4, 2, 256), (4, 4, 32))
CONTEXTS = ((1,), (7, 1), (64,), (300, 17), (2048,), (1000, 3, 4000))


def _shape(hq: int, hkv: int, d: int) -> ModelShape:
    return ModelShape.attention_only(
        f"acc-h{hq}-kv{hkv}-d{d}", num_heads=hq, num_kv_heads=hkv, head_dim=d, num_layers=1
    )


def _quantiles(values: list[float]) -> dict[str, float]:
    t = torch.tensor(values, dtype=torch.float64)
    return {
        "p50": float(t.quantile(0.5)),
        "p99": float(t.quantile(0.99)),
        "max": float(t.max()),
        "min": float(t.min()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--seeds", type=int, default=8, help="random draws per (shape, context, dtype, scale)"
    )
    parser.add_argument("--out", default="", help="write the measurements as JSON here")
    args = parser.parse_args()

    backend = FP8Backend()
    rows = []
    jobs = [
        (g, ctx, dtype, scale, seed)
        for g in GEOMETRIES
        for ctx in CONTEXTS
        for dtype in ("fp32", "bf16", "fp16")
        for scale in ("token_head", "tensor")
        for seed in range(args.seeds)
    ]
    start = time.time()
    for g, ctx, dtype, scale, seed in track(jobs, description="fp8 accuracy"):
        w = Workload(_shape(*g), ctx, dtype, "cpu")
        r = check(backend, w, config={"scale": scale, "page_size": 16}, seed=1000 + seed, num_layers=1)
        rows.append(
            {
                "geometry": list(g),
                "context_lens": list(ctx),
                "dtype": dtype,
                "scale": scale,
                "seed": 1000 + seed,
                "exact": r.error.as_dict(),
                "stored": r.stored_error.as_dict() if r.stored_error else None,
            }
        )
    summary: dict[str, dict] = {}
    for scale in ("token_head", "tensor"):
        for dtype in ("fp32", "bf16", "fp16"):
            sel = [r for r in rows if r["scale"] == scale and r["dtype"] == dtype]
            summary[f"{scale}/{dtype}"] = {
                kind: {m: _quantiles([r[kind][m] for r in sel]) for m in ("max_abs", "rel_l2", "cosine")}
                for kind in ("exact", "stored")
            }
    table = Table(title=f"fp8 error over {len(rows)} gate runs ({args.seeds} seeds per case)")
    for col in ("scale/dtype", "vs", "max_abs p50/p99/max", "rel_l2 p50/p99/max", "cosine min"):
        table.add_column(col)
    for key, s in summary.items():
        for kind in ("exact", "stored"):
            m, r, c = s[kind]["max_abs"], s[kind]["rel_l2"], s[kind]["cosine"]
            table.add_row(
                key,
                kind,
                f"{m['p50']:.2e} / {m['p99']:.2e} / {m['max']:.2e}",
                f"{r['p50']:.2e} / {r['p99']:.2e} / {r['max']:.2e}",
                f"{c['min']:.6f}",
            )
    Console().print(table)
    if args.out:
        doc = {
            "command": f"python scripts/fp8_accuracy.py --seeds {args.seeds} --out {args.out}",
            "machine": fingerprint("cpu"),
            "loadavg": os.getloadavg(),
            "seconds": round(time.time() - start, 1),
            "declared": {
                "exact": vars(EXACT_TOLERANCE),
                "stored": {str(k).removeprefix("torch."): vars(v) for k, v in STORED_TOLERANCE.items()},
            },
            "summary": summary,
            "runs": rows,
        }
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
