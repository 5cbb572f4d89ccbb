"""Regret of attnbench.select(): tune a coarse grid (with its dispatch map), then measure every
candidate interleaved at held-out points between and beyond the tuned ones.

At each held-out (model, dtype, batch, context) — batches and contexts that are not grid lines —
every backend of the space at its default config, plus every config the dispatch map holds, is
checked against float64 and timed **interleaved** in one worker (the tuner's re-timing,
:func:`attnbench.tuning.interleave.retime`). select()'s choice is compared with the fastest:
regret = median(choice) / median(best), counted as 1.0 when the best does not beat the choice
beyond both intervals (:func:`attnbench.tables.margin.beats` with no margin: the one margin
policy). Beside it, the medians alone (``median_ratio``: median(choice) / median(best), no interval rule):
what the regret counts as a tie is there in figures. Lossy caches (fp8) compete only with ``--allow-lossy``.

Printed and written (results/cpu/select/regret-<model>-<dtypes>-<device>.json and .md, with the command, machine, date
and load average): regret median, p90 and max (targets ≤ 1.01, ≤ 1.05, ≤ 1.15), the geometric-mean
speedup over always using the default backend, and the worker evaluations the tuning used against a
dense quarter-octave grid over the tuned range (target ≤ 50 %). One model and dtype per run keeps each
run short; ``--combine FILE…`` pools several runs' points into one summary.

``--exhaustive`` measures the regret against the exhaustive search: at every tuned and held-out point
an exhaustive study of its own (every candidate of the space gated and timed in full, no pruning, its finalists re-timed,
as ``tune`` does for a small space) finds the best, which is re-timed interleaved beside select()'s
choice and the other candidates; the tuned points are rows too (``where: tuned``). Targets: p90 ≤ 1.02,
max ≤ 1.05::

    python scripts/regret.py --model llama-3.1-8b --dtypes bf16
    python scripts/regret.py --model llama-3.1-8b --dtypes fp32
    python scripts/regret.py --model qwen2.5-72b --dtypes bf16
    python scripts/regret.py --model qwen2.5-72b --dtypes fp32
    python scripts/regret.py --combine results/cpu/select/regret-llama-3.1-8b-*.json results/cpu/select/regret-qwen2.5-72b-*.json
    python scripts/regret.py --quick          # a smoke test on a tiny shape (seconds of timing)
    python scripts/regret.py --model llama-3.1-8b --dtypes bf16 --exhaustive
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import shlex
import statistics
import sys
import tempfile
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import optuna

from attnbench.core.device import load_profile
from attnbench.core.workload import Workload, parse_int_list
from attnbench.selection.select import select
from attnbench.tables import Candidate, hardware_id
from attnbench.tables.dispatch import map_key
from attnbench.tables.margin import SWITCH_MARGIN, beats
from attnbench.tuning import TuneOptions, Worker, backend_refs, build_space, tune
from attnbench.tuning.interleave import Finalist, retime

TARGETS = {"median": 1.01, "p90": 1.05, "max": 1.15, "evaluations_vs_dense": 0.5}
#: against the exhaustive search (``--exhaustive``)
EXHAUSTIVE_TARGETS = {"median": 1.01, "p90": 1.02, "max": 1.05, "evaluations_vs_dense": 0.5}
QUICK = {
    "model": "tiny-gqa",
    "layers": 1,
    "batch": "1,4",
    "context": "64,256",
    "held": "2x128,3x200,8x96,2x512",
    "backends": "naive,flash",
    "samples": 5,
    "repeats": 3,
    "trials": None,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--layers", type=int, default=2, help="layers per decode step (default 2)")
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--batch", default="1,8", help="coarse grid batches (default 1,8)")
    p.add_argument("--context", default="512,4k", help="coarse grid contexts (default 512,4k)")
    p.add_argument(
        "--held",
        default="2x1500,3x700,5x3000,12x2000,16x600,2x6000,1x300",
        help="held-out points BATCHxCONTEXT, between and beyond the grid (default: 3 between, 4 beyond)",
    )
    p.add_argument(
        "--backends", default="flash,naive,vllm_cpu,cpu_decode", help="backends to tune and measure"
    )
    p.add_argument(
        "--trials",
        type=int,
        default=8,
        help="trials per coarse key (TPE after every backend's default); 0: tune's own default (every "
        "candidate of a space of up to 64, else TPE)",
    )
    p.add_argument(
        "--exhaustive",
        action="store_true",
        help="regret against an exhaustive study at every tuned and held-out point (targets p90 ≤ 1.02, max ≤ 1.05)",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed steps per study trial")
    p.add_argument("--samples", type=int, default=15, help="interleaved rounds (tuning and held-out points)")
    p.add_argument("--switch-margin", type=float, default=SWITCH_MARGIN)
    p.add_argument(
        "--resolution",
        type=float,
        default=0.25,
        help="octaves the map's refinement locates crossovers to (default 0.25)",
    )
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--allow-lossy", action="store_true", help="let lossy caches (fp8) compete")
    p.add_argument("--quick", action="store_true", help="a smoke test on a tiny shape")
    p.add_argument(
        "--out",
        type=Path,
        help="JSON output (default results/cpu/select/regret-<model>-<dtypes>-<device>.json)",
    )
    p.add_argument("--combine", nargs="+", type=Path, metavar="FILE", help="pool the points of earlier runs")
    p.add_argument(
        "--render",
        type=Path,
        metavar="FILE",
        help="write a saved run's summary and Markdown again from its measured times (no measuring)",
    )
    args = p.parse_args(argv)
    if args.trials < 0:
        p.error(f"--trials {args.trials}: expected 0 (tune's own default) or a positive number of trials")
    argv_used = list(argv if argv is not None else sys.argv[1:])
    if args.combine:
        return combine(args.combine, out=args.out, argv=argv_used)
    if args.render:
        why = _unrenderable(args.render)
        if why:
            p.error(f"--render {args.render}: {why}; expected a JSON file this script wrote")
        return render(args.render)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.simplefilter("ignore")  # version warnings are irrelevant within one run
    return run(args, argv_used)


def _held(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        b, _, c = item.strip().lower().partition("x")
        (bb,), (cc,) = parse_int_list(b, field="--held batch"), parse_int_list(c, field="--held context")
        out.append((bb, cc))
    return out


def run(args: argparse.Namespace, argv: list[str]) -> int:
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    batches = parse_int_list(args.batch, field="--batch")
    contexts = parse_int_list(args.context, field="--context")
    held = _held(args.held)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    coarse = [
        Workload.uniform(args.model, batch=b, context=c, dtype=d)
        for d in dtypes
        for b in batches
        for c in contexts
    ]
    options = TuneOptions(
        trials=args.trials or None,
        repeats=args.repeats,
        timeout_s=args.timeout,
        num_layers=args.layers,
        allow_lossy=args.allow_lossy,
        corpus=False,  # the tuner measured on this machine, no shipped answer helping
    )
    profile = load_profile()
    load_start = os.getloadavg()
    refs = backend_refs(only=backends)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        report = tune(
            coarse,
            backends=backends,
            results_dir=tmp,
            options=options,
            profile=profile,
            margin=args.switch_margin,
            samples=args.samples,
            resolution=args.resolution,
            on_trial=lambda plan, rec, reused: _log(
                f"tune {plan.workload.describe()} {rec.candidate.label()}"
            ),
            on_point=lambda pt: _log(f"map point b={pt.batch} ctx={pt.context}: {pt.winner}"),
        )
        if report.interrupted:
            return 130
        maps = {m.key: m for m in report.maps}
        task_profile = {k: v for k, v in profile.as_dict().items() if k != "id"}
        points = [(b, c, False) for b, c in held]
        if args.exhaustive:  # the tuned points too: did the faster tuner find the exhaustive best there?
            points = [(b, c, True) for b in batches for c in contexts] + points
        with Worker() as worker:
            for dtype in dtypes:
                for b, c, tuned in points:
                    w = Workload.uniform(args.model, batch=b, context=c, dtype=dtype)
                    m = maps.get(map_key(w.shape.name, w.shape.fingerprint(), w.dtype_name))
                    best = _exhaustive_best(w, backends, options, profile, args) if args.exhaustive else None
                    rows.append(_point(w, m, refs, worker, args, task_profile, tmp, batches, contexts, best))
                    r = rows[-1]
                    if tuned:
                        r["where"] = "tuned"
                    _log(
                        f"{r['where']} {r['workload']}: {r['selected']} regret {r['regret']:.3f} (best {r['best']})"
                    )
    dense = _dense(report, batches, contexts)
    used = sum(report.evaluations.values())
    result = {
        "command": "python scripts/regret.py " + " ".join(shlex.quote(a) for a in argv),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "platform": platform.platform()},
        "device": {
            "fingerprint": profile.fingerprint,
            "fingerprint_id": profile.id,
            "bandwidth_gbps": profile.bandwidth / 1e9,
        },
        "load_avg_start": [round(x, 2) for x in load_start],
        "load_avg_end": [round(x, 2) for x in os.getloadavg()],
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "evaluations": dict(report.evaluations) | {"total": used, "dense_quarter_octave": dense},
        "maps": [
            {"key": m.key, "batches": m.batches, "contexts": m.contexts, "refinement": m.refinement}
            | {"map": m.as_dict()}
            for m in report.maps
        ],
        "points": rows,
    }
    result["summary"] = summarize(
        rows, used=used, dense=dense, targets=EXHAUSTIVE_TARGETS if args.exhaustive else TARGETS
    )
    stem = f"regret-{args.model}-{'-'.join(dtypes)}-{profile.fingerprint.get('kind', 'cpu')}-{hardware_id(profile.fingerprint)}"
    if args.quick:
        stem += "-quick"
    write(
        result,
        args.out or Path("results") / profile.fingerprint.get("kind", "cpu") / "select" / f"{stem}.json",
    )
    return 0


def _exhaustive_best(w, backends, options, profile, args) -> Candidate | None:
    """The winner of an exhaustive study of ``w`` alone (every candidate gated and timed, its finalists
    re-timed interleaved), in a results folder of its own."""
    with tempfile.TemporaryDirectory() as folder:
        report = tune(
            [w],
            backends=backends,
            results_dir=folder,
            options=dataclasses.replace(options, trials=None, grid_limit=10_000, corpus=False, prune=False),
            profile=profile,
            margin=args.switch_margin,
            samples=args.samples,
            refine=False,
        )
    winners = [e["winner"] for e in report.entries.values() if e.get("winner")]
    best = Candidate(winners[0]["backend"], dict(winners[0].get("config") or {})) if winners else None
    _log(f"exhaustive {w.describe()}: {best.label() if best else 'no winner'}")
    return best


def _point(w, m, refs, worker, args, task_profile, tmp, batches, contexts, best=None) -> dict[str, Any]:
    """Measure every candidate at one held-out point interleaved (with ``best``, the exhaustive
    study's winner, among them); compare select()'s choice."""
    space = build_space(w, refs, allow_lossy=args.allow_lossy)
    fins: dict[str, Finalist] = {}
    if best is not None and best.backend in space.backends:
        ref = space.backends[best.backend]
        fins[best.label()] = Finalist(
            best.label(), best.backend, ref.ref, dict(best.config), getattr(ref.cls, "lossy", "") or ""
        )
    for name, ref in space.backends.items():  # every backend at its default config
        cand = Candidate(name, ref.cls.default_config())
        fins[cand.label()] = Finalist(
            cand.label(), name, ref.ref, dict(cand.config), getattr(ref.cls, "lossy", "") or ""
        )
    for label, mc in m.candidates.items() if m else ():
        if mc.backend in space.backends:
            fins.setdefault(
                label, Finalist(label, mc.backend, space.backends[mc.backend].ref, dict(mc.config), mc.lossy)
            )
    got = retime(
        worker,
        list(fins.values()),
        workload=w,
        samples=args.samples,
        check=True,
        num_layers=args.layers,
        profile=task_profile,
        timeout_s=args.timeout,
        accuracy_budget=None,
    )
    error = ""
    try:
        choice = select(w, results_dir=tmp, allow_lossy=args.allow_lossy)
        label = _label(choice.backend, choice.config)
        source = choice.source
    except Exception as err:  # select()'s failure is a result too
        label, source, error = None, "error", f"{type(err).__name__}: {err}"
    looked = m.lookup(w.batch, w.context).label if m else None
    times = got.times
    best = min(times, key=lambda k: times[k].median_ms) if times else None
    default = space.default_candidate().label() if space.default_backend else None
    regret = math.inf
    same = label is not None and best is not None and _same_run(space, label, best, fins)
    if label in times and best is not None:
        regret = (
            times[label].median_ms / times[best].median_ms
            if beats(times[best], times[label], margin=0.0) and not same
            else 1.0
        )
    speedup = None
    if label in times and default in times:
        d, ch = times[default], times[label]
        speedup = (
            d.median_ms / ch.median_ms if (beats(ch, d, margin=0.0) or beats(d, ch, margin=0.0)) else 1.0
        )
    between = min(batches) <= w.batch <= max(batches) and min(contexts) <= w.context <= max(contexts)
    return {
        "workload": w.describe(),
        "batch": w.batch,
        "context": w.context,
        "dtype": w.dtype_name,
        "where": "between" if between else "beyond",
        "times": {k: t.as_dict() for k, t in times.items()},
        "failed": got.failed,
        "timed_candidates": len(times),
        "best": best,
        "selected": label,
        "map_lookup": looked,
        "source": source,
        "select_error": error,
        "default": default,
        "regret": regret,
        "median_ratio": times[label].median_ms / times[best].median_ms
        if label in times and best
        else math.inf,
        "same_computation_as_best": same,  # counted 1.0: the two instances' times differ, not the choice
        "speedup_vs_default": speedup,
        "load_avg": list(got.load_avg),
    }


def _same_run(space, label: str, best: str, fins: dict[str, Finalist]) -> bool:
    """Whether select()'s choice and the best are one computation here (configs equal through the
    backend's ``canonical_config``, e.g. ``cpu_decode``'s ``kv_splits=1`` and ``auto`` where ``auto`` runs
    one split): then a difference between their times is the two model instances', not the choice's."""
    a, b = fins.get(label), fins.get(best)
    if a is None or b is None or a.backend != b.backend:
        return False
    one = space.canonical(Candidate(a.backend, a.config))
    return one.ident() == space.canonical(Candidate(b.backend, b.config)).ident()


def _dense(report, batches: list[int], contexts: list[int]) -> int:
    """Evaluations of a dense quarter-octave grid over the tuned range: its points × the space size."""

    def lines(lo: int, hi: int) -> set[int]:
        n = max(1, round(math.log2(hi / lo) / 0.25))
        return {round(lo * (hi / lo) ** (i / n)) for i in range(n + 1)}

    spaces = {(r.plan.key.model, r.plan.key.dtype): r.plan.space.size() for r in report.results}
    points = len(lines(min(batches), max(batches))) * len(lines(min(contexts), max(contexts)))
    return points * sum(spaces.values())


def _label(backend: str, config: dict) -> str:
    cfg = ",".join(f"{k}={v}" for k, v in sorted(config.items()))
    return f"{backend}[{cfg}]" if cfg else backend


def _p90(values: list[float]) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=10, method="inclusive")[-1]


def summarize(
    rows: list[dict[str, Any]], *, used: int, dense: int, targets: dict[str, float] = TARGETS
) -> dict[str, Any]:
    regrets = sorted(r["regret"] for r in rows)
    ratios = sorted(_median_ratio(r) for r in rows)
    speedups = [r["speedup_vs_default"] for r in rows if r["speedup_vs_default"]]
    s = {
        "points": len(rows),
        "points_between": sum(r["where"] == "between" for r in rows),
        "points_beyond": sum(r["where"] == "beyond" for r in rows),
        "points_tuned": sum(r["where"] == "tuned" for r in rows),
        "min_timed_candidates": min((r["timed_candidates"] for r in rows), default=0),
        "regret_median": statistics.median(regrets) if regrets else None,
        "regret_p90": _p90(regrets) if regrets else None,
        "regret_max": max(regrets) if regrets else None,
        "median_ratio_median": statistics.median(ratios) if ratios else None,
        "median_ratio_p90": _p90(ratios) if ratios else None,
        "median_ratio_max": max(ratios) if ratios else None,
        "geomean_speedup_vs_default": math.exp(statistics.fmean(math.log(x) for x in speedups))
        if speedups
        else None,
        "evaluations": used,
        "dense_quarter_octave_evaluations": dense,
        "evaluations_vs_dense": used / dense if dense else None,
        "targets": targets,
    }
    s["meets_targets"] = bool(
        regrets
        and s["regret_median"] <= targets["median"]
        and s["regret_p90"] <= targets["p90"]
        and s["regret_max"] <= targets["max"]
        and (s["evaluations_vs_dense"] or 0) <= targets["evaluations_vs_dense"]
    )
    return s


def _median_ratio(row: dict[str, Any]) -> float:
    """median(choice) / median(best) at a point, whatever the intervals say (a run saved before the
    field existed: from its times)."""
    if "median_ratio" in row:
        return row["median_ratio"]
    t, sel, best = row["times"], row["selected"], row["best"]
    return t[sel]["median_ms"] / t[best]["median_ms"] if sel in t and best in t else math.inf


def _unrenderable(path: Path) -> str:
    """Why ``path`` is not a saved run ``--render`` can write again ("" where it is one)."""
    try:
        saved = json.loads(path.read_text())
    except OSError as err:
        return f"cannot be read ({err.strerror or err})"
    except ValueError as err:
        return f"is not JSON ({err})"
    if not isinstance(saved, dict):
        return "holds no saved run"
    missing = [k for k in ("points", "summary") if k not in saved]
    if missing or not all(k in saved["summary"] for k in ("evaluations", "dense_quarter_octave_evaluations")):
        return f"holds no saved run (no {', '.join(missing) or 'evaluations in its summary'})"
    return ""


def render(path: Path) -> int:
    """A saved run's summary and Markdown again, from its points (the measured times are not touched)."""
    result = json.loads(path.read_text())
    s = result["summary"]
    result["summary"] = summarize(
        result["points"],
        used=s["evaluations"],
        dense=s["dense_quarter_octave_evaluations"],
        targets=s.get("targets") or TARGETS,
    )
    write(result, path)
    return 0


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def write(result: dict[str, Any], path: Path) -> None:
    s = result["summary"]
    t = s.get("targets") or TARGETS
    line = (
        f"regret median {_fmt(s['regret_median'])} (target ≤ {t['median']}), p90 {_fmt(s['regret_p90'])} "
        f"(≤ {t['p90']}), max {_fmt(s['regret_max'])} (≤ {t['max']}); geometric-mean speedup over "
        f"always-default {_fmt(s['geomean_speedup_vs_default'])}; worker evaluations {s['evaluations']} vs "
        f"{s['dense_quarter_octave_evaluations']} for a dense quarter-octave grid ({_fmt(s['evaluations_vs_dense'])}, "
        f"target ≤ {t['evaluations_vs_dense']}); {s['points']} points ({s['points_between']} between, "
        f"{s['points_beyond']} beyond, {s.get('points_tuned', 0)} tuned); targets {'met' if s['meets_targets'] else 'NOT met'}"
        f"; by the medians alone (no interval rule): median {_fmt(s.get('median_ratio_median'))}, p90 "
        f"{_fmt(s.get('median_ratio_p90'))}, max {_fmt(s.get('median_ratio_max'))}"
    )
    print(line)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    md = [
        f"# select() regret at held-out points\n\n`{result['command']}`\n",
        f"{result['date']}; {result['machine']['platform']}, {result['machine']['cpus']} CPUs; "
        f"device {result['device']['fingerprint'].get('name', '?') if 'device' in result else '?'}; "
        f"load average {result['load_avg_start']} at the start, {result['load_avg_end']} at the end.\n",
        line + "\n",
        "| point | where | selected (source) | map lookup | best | regret | medians | × vs default | candidates timed |",
        "| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in result["points"]:
        md.append(
            f"| {r['workload']} | {r['where']} | {r['selected']} ({r['source']}) | {r['map_lookup']} | {r['best']} | "
            f"{_fmt(r['regret'])} | {_fmt(_median_ratio(r))} | {_fmt(r['speedup_vs_default'])} | {r['timed_candidates']} |"
        )
    path.with_suffix(".md").write_text("\n".join(md) + "\n")
    print(f"wrote {path} and {path.with_suffix('.md')}")


def combine(files: list[Path], *, out: Path | None, argv: list[str]) -> int:
    runs = [json.loads(Path(f).read_text()) for f in files]
    rows = [r for run in runs for r in run["points"]]
    used = sum(run["evaluations"]["total"] for run in runs)
    dense = sum(run["evaluations"]["dense_quarter_octave"] for run in runs)
    result = {
        "command": "python scripts/regret.py " + " ".join(shlex.quote(a) for a in argv),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": runs[0]["machine"],
        "device": runs[0]["device"],
        "load_avg_start": runs[0]["load_avg_start"],
        "load_avg_end": runs[-1]["load_avg_end"],
        "combined": [str(f) for f in files],
        "points": rows,
        "summary": summarize(rows, used=used, dense=dense),
    }
    dev = runs[0]["device"]["fingerprint"]
    kind = dev.get("kind", "cpu")
    write(
        result, out or Path("results") / kind / "select" / f"regret-combined-{kind}-{hardware_id(dev)}.json"
    )
    return 0


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
