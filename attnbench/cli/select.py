"""``attnbench select`` — the backend and config to use for a workload (tuned table, else roofline heuristic).

Answer from this device's dispatch map (interpolated between tuned points) or tuned results table (the
nearest batch/context bucket of the same model and dtype), found in the results location `attnbench
tune` printed; beyond the tuned region from the calibrated step-time models (`attnbench calibrate`),
and when nothing is tuned from a roofline heuristic: the candidate that reads the fewest KV-cache
bytes, ties going to the default backend (flash, else naive). A candidate that failed the correctness
gate is never chosen, a lossy KV cache (fp8) only with --allow-lossy; a table from another device is
refused.
"""

from __future__ import annotations

import argparse
import warnings

from attnbench.cli.common import (
    add_query_command,
    cli_table,
    console,
    emit_json,
    print_table,
    workloads_from_args,
)
from attnbench.selection.choice import Choice
from attnbench.selection.select import select


def register(sub: argparse._SubParsersAction) -> None:
    p = add_query_command(sub, "select", __doc__, model_required=True)
    p.add_argument(
        "--results",
        metavar="DIR",
        help="where the tuned tables live, an existing folder (default $ATTNBENCH_RESULTS_DIR, else the "
        "per-user $XDG_DATA_HOME/attnbench, i.e. ~/.local/share/attnbench: where `attnbench tune` writes)",
    )
    p.add_argument(
        "--table",
        metavar="PATH",
        help="use this table file, which must exist (refused if tuned on another device)",
    )
    p.add_argument("--explain", action="store_true", help="say what was chosen, what was rejected and why")
    p.add_argument(
        "--allow-lossy",
        action="store_true",
        help="a lossy KV cache (fp8 e4m3 K/V) may be chosen when it was measured fastest (default: exact only)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def step_cell(c: Choice) -> str:
    """The chosen candidate's step time, saying what it is (see :attr:`Choice.step_basis`)."""
    if c.step_ms is not None:
        basis = c.step_basis
        return f"{c.step_ms:.4g} ({'predicted, extrapolated' if basis == 'extrapolated' else basis})"
    if c.estimate_ms is not None:
        if c.source == "calibrated":
            return f"{c.estimate_ms:.4g} (predicted, calibrated model)"
        return f"≥{c.estimate_ms:.3g} (predicted, roofline floor)"
    return "-"


def run(args: argparse.Namespace) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the warnings are printed with the choice below
        choices = [
            select(w, results_dir=args.results, table=args.table, allow_lossy=args.allow_lossy)
            for w in workloads_from_args(args)
        ]
    if args.json:
        emit_json([c.as_dict() for c in choices])
        return 0
    out = console()
    if args.explain:
        for c in choices:
            out.print(c.explain(), markup=False)
        return 0
    table = cli_table(
        "selected backends", ["workload", "backend", "config", "source", "from bucket", "step ms"]
    )
    for c in choices:
        table.add_row(
            c.workload.describe(),
            c.backend,
            ",".join(f"{k}={v}" for k, v in c.config.items()) or "-",
            c.source,
            c.tuned_key or "-",
            step_cell(c),
        )
    table.caption = "step ms: measured at a tuned point, interpolated between tuned points, or predicted"
    print_table(out, table)
    for note in dict.fromkeys(note for c in choices for note in c.warnings):
        out.print(f"[yellow]warning:[/yellow] {note}")
    return 0
