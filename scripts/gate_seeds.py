"""One backend's correctness gate over many seeds on the conformance suite's cases: how close it comes.

The conformance suite (:mod:`attnbench.testing`) runs the gate once per case with a fresh seed, so a
backend whose error sits near its bound fails one CI run in a few hundred. This script runs the
same gate (``check`` in the backend's default config, every case of ``CASES`` and ``LONG_CASES``)
``--seeds`` times per case and dtype and reports, per cell, the failures, the worst error as a share
of the bound (≤ 1 passes; a declared multiple should keep it ≤ 0.8, as ``docs/correctness.md``
asks), and the multiple that the worst seed needs to pass and to stay under 0.8 of its bound.

    python scripts/gate_seeds.py --backend flex --seeds 2000 --out results/gate/gate-seeds-flex-cpu

Plugins are found through their entry points (the backend must be installed). Accuracy only, no
timing: the load average does not change a number, but it is recorded with the command and machine.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any

from attnbench.cli.common import command_line, positive_int, run_record, write_report
from attnbench.core.registry import load_registry
from attnbench.core.shapes import parse_dtype
from attnbench.core.workload import Workload
from attnbench.correctness import CheckResult, angle, check
from attnbench.testing import CASES, LONG_CASES, ConformanceCase


def needed_multiple(r: CheckResult, share: float) -> float:
    """The smallest multiple under which this result's worst metric is ``share`` of its bound.

    Each bound is ``multiple × calibration + floor`` (the floor does not depend on the multiple)."""
    if r.calibration is None or r.lossy:
        return math.nan
    err, cal, tol, m = r.error, r.calibration, r.tolerance, r.multiple
    worst = 0.0
    for e, c, t in (
        (err.max_abs, cal.max_abs, tol.max_abs),
        (err.rel_l2, cal.rel_l2, tol.rel_l2),
        (angle(err.cosine), angle(cal.cosine), angle(tol.min_cosine)),
    ):
        floor = t - m * c
        if c > 0:
            worst = max(worst, (e / share - floor) / c)
        elif e / share > floor:
            return math.inf
    return worst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", required=True, help="a registered backend's name (plugins included)")
    ap.add_argument(
        "--seeds", type=positive_int, default=200, help="fresh seeds per case and dtype (default 200)"
    )
    ap.add_argument("--dtypes", default="fp32,bf16", help="comma-separated (default fp32,bf16)")
    ap.add_argument(
        "--long-seeds",
        type=int,
        default=30,
        help="seeds for the long cases, 0 to leave them out (default 30)",
    )
    ap.add_argument("--cases", default="", help="comma-separated case ids (default: every one)")
    ap.add_argument(
        "--single",
        action="store_true",
        help="one decode step on one layer per run, as the suite's fresh-inputs test (default: the "
        "case's steps on the gate's layers, as the suite's gate test)",
    )
    ap.add_argument("--out", default=None, help="write <out>.json and <out>.md")
    args = ap.parse_args(argv)
    if args.long_seeds < 0:
        ap.error(f"--long-seeds {args.long_seeds}: a whole number ≥ 0")
    ids = [c.id for c in CASES + LONG_CASES]
    only = {c.strip() for c in args.cases.split(",") if c.strip()}
    if only - set(ids):
        ap.error(f"--cases {args.cases!r}: {', '.join(sorted(only - set(ids)))} not one of {', '.join(ids)}")
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not dtypes:
        ap.error(f"--dtypes {args.dtypes!r}: a comma-separated list of fp32, bf16, fp16")
    for d in dtypes:
        try:
            parse_dtype(d)
        except ValueError as err:
            ap.error(f"--dtypes {args.dtypes!r}: {err}")
    registry = load_registry()
    if args.backend not in registry.names():
        ap.error(f"--backend {args.backend!r} is not registered; one of {', '.join(registry.names())}")
    backend = registry.get(args.backend)

    def steps(case: ConformanceCase) -> dict[str, int]:
        return {"decode_steps": 1, "num_layers": 1} if args.single else {"decode_steps": case.decode_steps}

    start, load_start = time.time(), os.getloadavg()
    cells: list[dict[str, Any]] = []
    for dtype in dtypes:
        for case, seeds in [(c, args.seeds) for c in CASES] + [(c, args.long_seeds) for c in LONG_CASES]:
            workload = Workload(case.shape, case.gate_lens, parse_dtype(dtype), "cpu")
            if seeds == 0 or (only and case.id not in only):
                continue
            reasons = backend.resolve(workload).reasons
            if reasons:
                print(f"{dtype} {case.id:9s} not run: {'; '.join(reasons)}", flush=True)
                continue
            worst: CheckResult | None = None
            fails = 0
            for _ in range(seeds):
                r = check(backend, workload, **steps(case))
                fails += not r.passed
                if worst is None or r.bound_share() > worst.bound_share():
                    worst = r
            assert worst is not None
            cell = {
                "dtype": dtype,
                "case": case.id,
                "lens": list(case.gate_lens),
                "seeds": seeds,
                "single": args.single,
                "fails": fails,
                "multiple": worst.multiple,
                "worst_share": worst.bound_share(),
                "worst_seed": worst.seed,
                "needed_multiple": needed_multiple(worst, 1.0),
                "multiple_for_0.8": needed_multiple(worst, 0.8),
            }
            cells.append(cell)
            print(
                f"{dtype} {case.id:9s} {fails}/{seeds} failed, worst {cell['worst_share']:.3f} of the ×"
                f"{cell['multiple']:g} bound (seed {worst.seed}); needs ×{cell['needed_multiple']:.2f} "
                f"to pass, ×{cell['multiple_for_0.8']:.2f} for 0.8",
                flush=True,
            )
    if args.out:
        cmd = command_line(args, parser=ap, prog="python scripts/gate_seeds.py")
        report = {**run_record(command=cmd, load_start=load_start, started=start), "cells": cells}
        write_report(args.out, report, _markdown(report, args.backend))
    return 0


def _markdown(report: dict[str, Any], name: str) -> str:
    lines = [
        f"# The gate over many seeds: `{name}` on the conformance cases",
        "",
        f"`{report['command']}` — {report['machine']} ({report['cpu']}), torch {report['torch']}, "
        f"{report['date']}, load average {report['load_avg_start'][0]:.2f} → {report['load_avg_end'][0]:.2f} "
        "(accuracy only: no timing).",
        "",
        "`worst share` = the worst seed's worst error over the metrics as a share of its bound (≤ 1 "
        "passes); `needs` = the multiple under which that seed passes, `for 0.8` = under which it "
        "stays at 0.8 of the bound (what a declared multiple must reach).",
        "",
        "| dtype | case | lens | steps | fails / seeds | multiple | worst share | worst seed | needs | for 0.8 |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for c in report["cells"]:
        lines.append(
            f"| {c['dtype']} | {c['case']} | {','.join(map(str, c['lens']))} "
            f"| {'1 step, 1 layer' if c['single'] else 'the case’s'} | {c['fails']} / {c['seeds']} "
            f"| {c['multiple']:g} | {c['worst_share']:.3f} | {c['worst_seed']} | {c['needed_multiple']:.2f} "
            f"| {c['multiple_for_0.8']:.2f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
