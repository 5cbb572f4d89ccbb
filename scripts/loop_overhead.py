"""The decode loop's own overhead: a whole step's time over the sum of the backend's calls in it.

For each backend, the synthetic attention-only model is filled to the context (8k by default), then
steps alternate between two kinds, ``--repeats`` of each after a warm-up:

- a plain step, timed as a whole: ``plan()``, every layer's ``decode()``, ``commit()`` — what
  ``attnbench bench`` times;
- a step whose backend calls are each timed on their own (device-synced around each): the sum of
  ``plan()`` and every ``decode()`` is the backend's own cost of the step.

``overhead = median(step) / median(sum of calls)``; the target is ≤ 1.10. Prints a table and writes
JSON and Markdown (command, device fingerprint, date, load average) next to ``--out``.

    python scripts/loop_overhead.py --model llama-3.1-8b --batch 1 --context 8k --dtype bf16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from attnbench.core.device import load_profile
from attnbench.core.registry import load_registry
from attnbench.core.shapes import parse_dtype
from attnbench.core.timing import synchronize
from attnbench.core.workload import Workload, parse_int_list, parse_tokens
from attnbench.correctness.gate import check
from attnbench.measure.bench import check_workload
from attnbench.measure.decode import SyntheticModel

TARGET = 1.10


def measure_backend(backend: Any, workload: Workload, *, warmup: int, repeats: int) -> dict[str, Any]:
    result = check(backend, check_workload(workload, form=backend.kv_form))
    if not result.passed:
        return {"backend": backend.name, "status": "failed-check", "check": result.as_dict()}
    model = SyntheticModel(backend, workload)
    model.fill(extra_tokens=2 * (warmup + repeats) + 1)
    for _ in range(warmup):
        model.decode_step()
        model.decode_step_call_times()
    steps: list[float] = []
    sums: list[float] = []
    plans: list[float] = []
    for _ in range(repeats):
        synchronize(model.device)
        t0 = time.perf_counter()
        model.decode_step()
        synchronize(model.device)
        steps.append(time.perf_counter() - t0)
        plan_s, layer_s = model.decode_step_call_times()
        sums.append(plan_s + sum(layer_s))
        plans.append(plan_s)
    row = {
        "backend": backend.name,
        "implementation": backend.implementation(workload),
        "status": "measured",
        "check": result.as_dict(),
        "num_layers": model.num_layers,
        "layers_materialised": model.layers_materialised,
        "step_median_s": statistics.median(steps),
        "calls_sum_median_s": statistics.median(sums),
        "plan_median_s": statistics.median(plans),
        "step_samples_s": steps,
        "calls_sum_samples_s": sums,
    }
    row["overhead"] = row["step_median_s"] / row["calls_sum_median_s"]
    row["within_target"] = row["overhead"] <= TARGET
    model.release()
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--batch", default="1", help="batch sizes, comma-separated (default 1)")
    p.add_argument("--context", default="8k", help="context length (default 8k)")
    p.add_argument("--dtype", default="bf16", help="bf16, fp16 or fp32 (default bf16)")
    p.add_argument("--backends", default="naive,flash", help="comma-separated (default naive,flash)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--out", default="results/cpu/bench/loop-overhead-cpu", help="writes OUT.json and OUT.md")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.repeats < 1:
        raise SystemExit(f"--repeats = {args.repeats} must be ≥ 1")
    context = parse_tokens(args.context, field="--context")
    dtype = parse_dtype(args.dtype, field="--dtype")
    reg = load_registry()
    backends = [reg.get(n.strip()) for n in args.backends.split(",") if n.strip()]
    profile = load_profile()
    load_start = os.getloadavg()
    date = datetime.now(timezone.utc).isoformat(timespec="seconds")
    rows = []
    for batch in parse_int_list(args.batch, field="--batch"):
        workload = Workload.uniform(args.model, batch=batch, context=context, dtype=dtype)
        for backend in backends:
            reasons = backend.supports(workload)
            if reasons:
                rows.append({"backend": backend.name, "status": "unsupported", "reasons": reasons})
                continue
            print(f"measuring {backend.name} on {workload.describe()} …", file=sys.stderr)
            rows.append(
                {"workload": workload.describe(), "batch": batch}
                | measure_backend(backend, workload, warmup=args.warmup, repeats=args.repeats)
            )
    command = "python scripts/loop_overhead.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None and k != "out"
    )
    report = {
        "command": command,
        "date": date,
        "device": profile.as_dict(),
        "load_avg_start": list(load_start),
        "load_avg_end": list(os.getloadavg()),
        "target": TARGET,
        "results": rows,
    }
    table = Table(
        title=escape(f"decode-loop overhead at {args.context} context ({args.dtype}), target ≤ {TARGET}")
    )
    for col in (
        "workload",
        "backend",
        "layers",
        "step p50 ms",
        "Σ calls p50 ms",
        "plan p50 ms",
        "step / Σ calls",
    ):
        table.add_column(col, justify="left" if col in ("workload", "backend") else "right")
    for r in rows:
        if r["status"] != "measured":
            table.add_row(escape(r.get("workload", "")), r["backend"], r["status"], "", "", "", "")
            continue
        ok = "[green]" if r["within_target"] else "[red]"
        table.add_row(
            escape(r["workload"]),
            escape(f"{r['backend']} [{r['implementation']}]"),
            f"{r['num_layers']} ({r['layers_materialised']} mat.)",
            f"{r['step_median_s'] * 1e3:.2f}",
            f"{r['calls_sum_median_s'] * 1e3:.2f}",
            f"{r['plan_median_s'] * 1e3:.3f}",
            f"{ok}{r['overhead']:.3f}[/]",
        )
    out = Console(width=160)
    out.print(table)
    note = (
        f"device {profile.id}: {profile.name}, {profile.fingerprint.get('threads')} threads; load average "
        f"{load_start[0]:.2f} → {report['load_avg_end'][0]:.2f} (shared machine: noisy)"
    )
    out.print(note)
    if args.out:
        prefix = Path(args.out)
        prefix.parent.mkdir(parents=True, exist_ok=True)
        Path(f"{prefix}.json").write_text(json.dumps(report, indent=2) + "\n")
        rec = Console(record=True, width=160, file=open(os.devnull, "w"))  # noqa: SIM115
        rec.print(table)
        Path(f"{prefix}.md").write_text(
            "# decode-loop overhead\n\n"
            f"- command: `{command}`\n- date: {date}\n"
            f"- device: {profile.name} (fingerprint {profile.id}: "
            + ", ".join(f"{k}={v}" for k, v in profile.fingerprint.items() if k != "name")
            + f")\n- load average at start / end: {', '.join(f'{x:.2f}' for x in load_start)} / "
            f"{', '.join(f'{x:.2f}' for x in report['load_avg_end'])} (shared machine: figures are noisy)\n"
            "- step = one whole decode step (plan, every layer's decode, commit); Σ calls = plan + every "
            "decode, each timed on its own in an alternate step\n\n```\n"
            + rec.export_text().rstrip()
            + "\n```\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
