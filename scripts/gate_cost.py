"""What the correctness gate costs in a tune: its share of the tune's wall time.

Runs the quickstart's tune (``attnbench tune --model llama-3.1-8b``: the CLI's default batch and
contexts, bf16, every exact backend that runs here) into a fresh results folder, and sums per trial the
gate's wall time (the check before timing and the timed run's check after it, ``gate_s`` in each
measurement) against the trial's wall time and the tune's. Run it on a quiet machine:

    ../shared/tools/when-quiet python scripts/gate_cost.py --out results/gate/gate-cost-cpu
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from attnbench.cli.common import command_line, run_record, write_report
from attnbench.cli.tune import DEFAULT_BATCH, DEFAULT_CONTEXT
from attnbench.core.shapes import load_shape
from attnbench.core.workload import Workload, parse_int_list
from attnbench.tuning import TuneOptions, tune


def _ints(text: str) -> list[int]:
    return parse_int_list(text, field="--batch/--context")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--batch", default=DEFAULT_BATCH)
    ap.add_argument("--context", default=DEFAULT_CONTEXT)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--out", default="results/gate/gate-cost-cpu")
    args = ap.parse_args()
    shape = load_shape(args.model)
    workloads = [
        Workload.uniform(shape, batch=b, context=c, dtype=args.dtype)
        for b in _ints(args.batch)
        for c in _ints(args.context)
    ]
    trials: list[dict] = []

    def on_trial(plan, record, reused) -> None:
        if reused:
            return
        a = record.attrs or {}
        trials.append(
            {
                "key": plan.key.row,
                "candidate": record.candidate.label(),
                "ok": record.ok,
                "kind": record.kind,
                "gate_s": a.get("gate_s"),
                "step_ms": record.value * 1e3 if record.ok and record.value else None,
                "wall_s": a.get("wall_s"),
            }
        )
        print(
            f"{plan.key.row} {record.candidate.label()}: gate {a.get('gate_s')}", file=sys.stderr, flush=True
        )

    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as results:
        start = time.perf_counter()
        tune(workloads, results_dir=results, options=TuneOptions(), on_trial=on_trial, command="gate_cost")
        total = time.perf_counter() - start
    gate = sum(t["gate_s"] or 0.0 for t in trials)
    command = command_line(args, parser=ap, prog="python scripts/gate_cost.py")
    report = run_record(command=command, load_start=load_start) | {
        "equivalent": f"attnbench tune --model {args.model} --batch {args.batch} --context {args.context} --dtype {args.dtype}",
        "tune_s": round(total, 2),
        "gate_s": round(gate, 2),
        "gate_share": gate / total if total else None,
        "trials": trials,
    }
    md = [
        "# The correctness gate's share of a tune",
        "",
        f"`{report['command']}` (the quickstart's `{report['equivalent']}`) — {report['machine']}, "
        f"{report['date']}, load average {load_start[0]:.2f} → {report['load_avg_end'][0]:.2f}.",
        "",
        f"Tune wall time {total:.1f} s; the gate (before timing, and the timed run's check) {gate:.1f} s "
        f"over {len(trials)} trials: **{100 * gate / total:.1f} %** of the tune.",
        "",
        "| key | candidate | verdict | gate s | step ms |",
        "| --- | --- | --- | --- | --- |",
    ]
    for t in trials:
        verdict = "ok" if t["ok"] else t["kind"]
        gate_s = f"{t['gate_s']:.2f}" if t["gate_s"] is not None else "—"
        step = f"{t['step_ms']:.3g}" if t["step_ms"] is not None else "—"
        md.append(f"| {t['key']} | {t['candidate']} | {verdict} | {gate_s} | {step} |")
    write_report(args.out, report, "\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
