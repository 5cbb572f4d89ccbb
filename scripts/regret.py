"""Regret of attnbench.select(): tune on a coarse grid, then measure every candidate at held-out points.

At each held-out point (contexts between the tuned buckets, other batch sizes, both dtypes) every
candidate of the search space is checked and timed in the tuner's worker, and select()'s choice is
compared with the fastest: regret = time(choice) / time(best) (targets: median ≤ 1.03, p90 ≤ 1.10).
Also reported: the geometric-mean speedup of select() over always using ``flash``, and the trials the
coarse tuning used against measuring the full grid at every point.

The default run is modest for a CPU: llama-3.1-8b's attention geometry with 4 layers per step (the
ranking of backends does not depend on the layer count; the time scales with it), batch 1 and 8,
contexts 512/2k/8k for tuning. Usage::

    python scripts/regret.py                       # prints a table, writes results/regret-<device>.json
    python scripts/regret.py --layers 32 --held-batch 2,4,16 --held-context 768,3000,6000,12000
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import sys
import tempfile
import warnings
from datetime import datetime, timezone
from pathlib import Path

import optuna
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from attnbench.device import load_profile
from attnbench.select import select
from attnbench.tuning import TuneOptions, Worker, WorkerTask, backend_refs, build_space, hardware_id, tune
from attnbench.tuning.worker import workload_to_dict
from attnbench.workload import Workload, parse_int_list


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--layers", type=int, default=4, help="layers per decode step (default 4; the model's: 0)")
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--batch", default="1,8", help="coarse tuning batches")
    p.add_argument("--context", default="512,2k,8k", help="coarse tuning contexts")
    p.add_argument("--held-batch", default="2,4", help="held-out batches")
    p.add_argument("--held-context", default="768,3000,6000", help="held-out contexts (between the buckets)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--out", type=Path, help="JSON output (default results/regret-<device>.json)")
    args = p.parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.simplefilter("ignore")  # version warnings are irrelevant within one run

    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    coarse = [
        Workload.uniform(args.model, batch=b, context=c, dtype=d)
        for d in dtypes
        for b in parse_int_list(args.batch, field="--batch")
        for c in parse_int_list(args.context, field="--context")
    ]
    held = [
        Workload.uniform(args.model, batch=b, context=c, dtype=d)
        for d in dtypes
        for b in parse_int_list(args.held_batch, field="--held-batch")
        for c in parse_int_list(args.held_context, field="--held-context")
    ]
    options = TuneOptions(repeats=args.repeats, timeout_s=args.timeout, num_layers=args.layers or None)
    profile = load_profile()
    load_start = os.getloadavg()
    out = Console()
    refs = backend_refs()
    with tempfile.TemporaryDirectory() as tmp, Progress(console=out) as progress:
        task = progress.add_task("coarse tuning", total=None)
        report = tune(
            coarse,
            results_dir=tmp,
            options=options,
            profile=profile,
            on_trial=lambda plan, rec, reused: _note(
                progress, task, f"tune {plan.workload.describe()} {rec.candidate.label()}"
            ),
        )
        if report.interrupted:
            return 130
        trials_used = sum(len(r.records) for r in report.results)
        rows = []
        grid_trials = 0
        task2 = progress.add_task("held-out points", total=len(held))
        with Worker() as worker:
            for w in held:
                space = build_space(w, refs)
                times: dict[str, float | None] = {}
                for cand in space.candidates():
                    grid_trials += 1
                    outcome = worker.run(
                        WorkerTask(
                            backend_ref=space.backends[cand.backend].ref,
                            config=dict(cand.config),
                            workload=workload_to_dict(w),
                            warmup=options.warmup,
                            repeats=options.repeats,
                            num_layers=options.num_layers,
                        ),
                        timeout=options.timeout_s,
                    )
                    times[cand.label()] = outcome.value if outcome.ok else None
                choice = select(w, results_dir=tmp)
                label = _label(choice.backend, choice.config)
                ok = {k: v for k, v in times.items() if v is not None}
                best = min(ok, key=ok.__getitem__)
                flash = next((v for k, v in ok.items() if k.startswith("flash")), None)
                t_choice = ok.get(label)
                rows.append(
                    {
                        "workload": w.describe(),
                        "batch": w.batch,
                        "context": w.context,
                        "dtype": w.dtype_name,
                        "times_ms": {k: (None if v is None else v * 1e3) for k, v in times.items()},
                        "best": best,
                        "selected": label,
                        "source": choice.source,
                        "from_bucket": choice.tuned_key,
                        "regret": (t_choice / ok[best]) if t_choice else math.inf,
                        "speedup_vs_flash": (flash / t_choice) if flash and t_choice else None,
                    }
                )
                _note(progress, task2, f"held-out {w.describe()}: {label} regret {rows[-1]['regret']:.3f}")
    regrets = sorted(r["regret"] for r in rows)
    speedups = [r["speedup_vs_flash"] for r in rows if r["speedup_vs_flash"]]
    summary = {
        "points": len(rows),
        "regret_median": statistics.median(regrets),
        "regret_p90": _p90(regrets),
        "regret_max": max(regrets),
        "targets": {"median": 1.03, "p90": 1.10},
        "geomean_speedup_vs_flash": math.exp(statistics.fmean(math.log(s) for s in speedups))
        if speedups
        else None,
        "trials_used": trials_used,
        "coarse_keys": len(report.results),
        "full_grid_trials_at_held_points": grid_trials,
        "full_grid_trials_all_points": grid_trials + trials_used,
    }
    summary["meets_targets"] = summary["regret_median"] <= 1.03 and summary["regret_p90"] <= 1.10
    table = Table(title=f"select() regret at held-out points ({args.model}, {args.layers or 'all'} layers)")
    for col in ("workload", "selected", "source", "best", "regret", "× vs flash", "times (ms)"):
        table.add_column(col)
    for r in rows:
        times = ", ".join(f"{k}={v:.3g}" if v is not None else f"{k}=FAIL" for k, v in r["times_ms"].items())
        sp = f"{r['speedup_vs_flash']:.3f}" if r["speedup_vs_flash"] else "-"
        table.add_row(r["workload"], r["selected"], r["source"], r["best"], f"{r['regret']:.3f}", sp, times)
    out.print(table)
    out.print(
        f"regret median {summary['regret_median']:.3f} (target ≤ 1.03), p90 {summary['regret_p90']:.3f} (≤ 1.10); "
        f"geomean speedup over always-flash {summary['geomean_speedup_vs_flash'] or float('nan'):.3f}; "
        f"trials used {trials_used} on {summary['coarse_keys']} coarse keys vs {grid_trials} for the full grid at "
        f"the {len(rows)} held-out points alone"
    )
    result = {
        "command": "python scripts/regret.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": {
            "fingerprint": profile.fingerprint,
            "fingerprint_id": profile.id,
            "bandwidth_gbps": profile.bandwidth / 1e9,
        },
        "load_avg_start": list(load_start),
        "load_avg_end": list(os.getloadavg()),
        "note": "shared, noisy machine: timings move with the load average; regret compares candidates measured back to back",
        "settings": vars(args) | {"out": str(args.out) if args.out else None},
        "coarse_entries": report.entries,
        "points": rows,
        "summary": summary,
    }
    path = (
        args.out
        or Path("results")
        / f"regret-{profile.fingerprint.get('kind', 'cpu')}-{hardware_id(profile.fingerprint)}.json"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    out.print(f"wrote {path}")
    return 0


def _note(progress: Progress, task: int, text: str) -> None:
    progress.update(task, advance=1, description=text[:70])
    if not sys.stderr.isatty():
        print(text, file=sys.stderr, flush=True)  # a log line when not on a terminal


def _label(backend: str, config: dict) -> str:
    cfg = ",".join(f"{k}={v}" for k, v in sorted(config.items()))
    return f"{backend}[{cfg}]" if cfg else backend


def _p90(values: list[float]) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=10, method="inclusive")[-1]


if __name__ == "__main__":
    sys.exit(main())
