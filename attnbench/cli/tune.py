"""``attnbench tune`` — find the fastest correct backend and config per workload bucket, by measuring."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from rich.markup import escape
from rich.table import Table

from attnbench.cli.common import (
    add_model_option,
    add_wide_option,
    add_workload_options,
    cli_table,
    command_line,
    config_text,
    console,
    emit_json,
    ms_text,
    positive_int,
    print_table,
    progress_bar,
    run_options,
    timing_options,
    workloads_from_args,
)
from attnbench.cli.gate_options import add_gate_options, gate_options
from attnbench.core.registry import load_registry
from attnbench.core.timing import TIMING_MODES, timing_mode
from attnbench.tables.margin import SWITCH_MARGIN
from attnbench.tables.table_schema import validate_entries

if TYPE_CHECKING:
    from attnbench.tables.table_schema import CandidateResult, TableEntry

DEFAULT_BATCH = "1"
DEFAULT_CONTEXT = "1k,4k"
_LAYERS_HELP = (
    "layers per timed step (default: one per distinct layer cache, at most the model's, its times "
    "standing for the model's step: step × its layers / these); a number: steps of those, as timed"
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tune",
        help="tune backends and configs per workload bucket; write this device's results table",
        description=(
            "For every (batch, context, dtype) bucket of the model: build the search space from the "
            "registered backends' tunables (backends that cannot run it, or would run interpreted, are "
            "listed and left out), then check each candidate against the float64 reference and time its "
            "decode step in an isolated worker process. Small spaces are searched exhaustively, large ones "
            "with a seeded TPE sampler. The winners go to tuning-<device>.yaml in the results location (--results, else "
            "$ATTNBENCH_RESULTS_DIR, else ~/.local/share/attnbench; printed at the end), which "
            "`attnbench select` and attnbench.select() read from any directory. Interrupt with Ctrl-C at any time: what was "
            "measured is kept, and running the same command again resumes without repeating it. Defaults "
            f"(--batch {DEFAULT_BATCH} --context {DEFAULT_CONTEXT}) take a few minutes on a CPU."
        ),
        parents=[timing_options(max_seconds=10.0), run_options(layers_help=_LAYERS_HELP)],
    )
    add_model_option(p, required=True)
    add_workload_options(p, batch=DEFAULT_BATCH, context=DEFAULT_CONTEXT)
    p.add_argument("--backends", help="only these registered backends, comma-separated (default: all)")
    p.add_argument(
        "--trials",
        type=int,
        help="candidates per bucket: at least the space size searches it exhaustively, fewer uses TPE "
        "(default: exhaustive up to 64 candidates, else 40 TPE trials)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        metavar="S",
        help="seconds one candidate (check + timing) may take in its worker before it is killed (default 120)",
    )
    p.add_argument(
        "--timing",
        choices=TIMING_MODES,
        default=None,
        help="the objective: eager (layers launched from Python) or graph (a step replayed as one CUDA "
        "graph, as engines serve decode); default graph on CUDA, eager on the CPU (where graph is refused)",
    )
    p.add_argument(
        "--samples",
        type=int,
        default=15,
        help="after the search, the finalists (every candidate within two confidence intervals of the "
        "best, at least three where within 2x the best's study time, the default where its study time is "
        "within 2x the best's, the table's incumbent, with lossy caches allowed the fastest exact one, "
        "and the finalists of the keys it shares a dispatch-map cell with, gated first where this key's "
        "study did not measure them) are re-timed "
        "interleaved, one step of each in turn (a short context's on two or four model instances, one as "
        "CUDA graphs: its time the median over them of each one's median), N "
        "rounds (up to 4N while an interval is too wide or a real gap undecided; default 15; 0: no "
        "re-timing and no dispatch map)",
    )
    p.add_argument(
        "--switch-margin",
        type=float,
        default=SWITCH_MARGIN,
        metavar="F",
        help="a challenger replaces the default only when faster by this fraction beyond both "
        f"confidence intervals; otherwise a tie keeps the default (default {SWITCH_MARGIN})",
    )
    p.add_argument(
        "--no-refine",
        action="store_true",
        help="measure only the --batch × --context grid; by default grid lines are added (bisecting in "
        "log space) where neighbouring points have different winners, until each crossover is located "
        "within a quarter octave",
    )
    p.add_argument(
        "--retry-failed",
        action="store_true",
        help="run candidates whose trials failed (e.g. timed out on a busy machine) again",
    )
    p.add_argument(
        "--no-corpus",
        dest="corpus",
        action="store_false",
        help="search every key in full even where the shipped corpus has this kind of device (by default "
        "its finalists run first, gated and timed on half the --repeats; a key stops there where its winner "
        "is this machine's fastest of them within the switch margin, or holds when re-timed interleaved "
        "against one that was faster; docs/tuning.md#the-shipped-corpus; ATTNBENCH_CORPUS=off: the same)",
    )
    p.add_argument(
        "--no-prune",
        dest="prune",
        action="store_false",
        help="time every candidate's --repeats steps in full; by default Optuna's successive-halving "
        "pruner stops a candidate's timed steps where it is slower than the study's others (it was "
        "gated first; the finalists are re-timed in full either way; see docs/tuning.md)",
    )
    p.add_argument(
        "--no-transfer",
        dest="transfer",
        action="store_false",
        help="search every key as planned; by default a grid's keys run cheapest first (batch x "
        "context) and a costlier key starts from the finalists of the two nearest cheaper keys of its "
        "dispatch map, "
        "then its defaults, then TPE, stopping after --patience candidates in a row bring nothing "
        "better (see docs/tuning.md#costlier-keys-start-from-cheaper-ones)",
    )
    p.add_argument(
        "--patience",
        type=positive_int,
        default=8,
        metavar="N",
        help="with transfer: candidates in a row that must fail to beat a costlier key's best by more "
        "than the switch margin before its search stops (default 8)",
    )
    p.add_argument("--seed", type=int, default=0, help="TPE sampler seed (default 0)")
    p.add_argument(
        "--storage",
        metavar="URL",
        help="Optuna RDB URL (e.g. postgresql://user@host/db) so that many machines tune one study; "
        "default: the journal file studies.journal in the results location (--results)",
    )
    p.add_argument(
        "--host-id",
        metavar="ID",
        help="who this tuner is in a fleet, recorded on its trials (default $ATTNBENCH_HOST_ID, else the host name)",
    )
    p.add_argument(
        "--heartbeat",
        type=int,
        default=10,
        metavar="S",
        help="with --storage: record a heartbeat every S seconds while a candidate runs; a trial silent "
        "for 3*S (its tuner died) runs again (default 10)",
    )
    p.add_argument(
        "--results",
        metavar="DIR",
        help="where the table, the map and the journal live, created if missing (default "
        "$ATTNBENCH_RESULTS_DIR, else the per-user $XDG_DATA_HOME/attnbench, i.e. ~/.local/share/attnbench)",
    )
    p.add_argument(
        "--update-reference",
        action="store_true",
        help="allow writing into a folder of committed reference runs (one holding REFERENCE.md, like "
        "the repository's results/); refused without it",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="after the run, where its wall time went: the correctness gate, worker start-up, cache "
        "creation, warm-up, timed samples, the timed step's check, re-timing, map refinement and "
        "bookkeeping (Optuna, storage, tables), in total and per backend (--json always has it)",
    )
    add_wide_option(
        p,
        adds="model and dtype, the winner's 95% interval, GB/s and % of bandwidth, the runner-up, the "
        "default's time, the decision, the load average, failed candidates and trials",
    )
    add_gate_options(p)
    p.set_defaults(func=run)


def _split(text: str | None) -> list[str] | None:
    return [s.strip() for s in text.split(",") if s.strip()] if text else None


def run(args: argparse.Namespace) -> int:
    # deferred: Optuna and the tuner load only for `tune` (the other commands, select() above all, never)
    import optuna

    from attnbench.tuning import TuneOptions, tune
    from attnbench.tuning.summary import candidate_label

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if args.trials is not None and args.trials < 1:
        raise ValueError(f"--trials {args.trials} must be ≥ 1")
    if args.timeout <= 0:
        raise ValueError(f"--timeout {args.timeout} must be > 0 seconds")
    if args.repeats < 1:
        raise ValueError(f"--repeats {args.repeats} must be ≥ 1")
    if args.samples < 0 or 0 < args.samples < 3:
        raise ValueError(f"--samples {args.samples} must be 0 (no re-timing) or ≥ 3")
    if not 0 <= args.switch_margin < 1:
        raise ValueError(f"--switch-margin {args.switch_margin} must be a fraction in [0, 1), e.g. 0.05")
    if args.layers is not None and args.layers < 1:
        raise ValueError(f"--layers {args.layers} must be ≥ 1")
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads {args.threads} must be ≥ 1")

        torch.set_num_threads(args.threads)  # the fingerprint reads it; the workers take the parent's
    if args.heartbeat < 1:
        raise ValueError(f"--heartbeat {args.heartbeat} must be ≥ 1 second")
    gate = gate_options(args)
    workloads = workloads_from_args(args)
    for w in workloads:  # --timing graph off CUDA: one line, before anything is measured
        timing_mode(args.timing, w.device)
    host = args.host_id or os.environ.get("ATTNBENCH_HOST_ID")
    fleet: dict[str, Any] = {"host_id": host} if host else {}  # else TuneOptions' default: this machine
    options = TuneOptions(
        allow_lossy=gate.allow_lossy,
        accuracy_budget=gate.accuracy_budget,
        error_multiple=gate.error_multiple,
        trials=args.trials,
        timeout_s=args.timeout,
        repeats=args.repeats,
        warmup=args.warmup,
        timing=args.timing,
        seed=args.seed,
        max_seconds=args.max_seconds,
        retry_failed=args.retry_failed,
        corpus=args.corpus,
        prune=args.prune,
        transfer=args.transfer,
        patience=args.patience,
        num_layers=args.layers,
        heartbeat_s=args.heartbeat,
        **fleet,
    )
    out = console()
    command = command_line(args)
    progress = progress_bar(console=console() if not args.json else None, disable=args.json, transient=False)
    state: dict = {}

    def on_plan(plans: list) -> None:
        for plan in plans:
            for ex in plan.space.excluded:
                if not args.json:
                    out.print(f"[dim]{plan.key.row}: left out {ex.backend}: {'; '.join(ex.reasons)}[/dim]")
        state["task"] = progress.add_task("tuning", total=sum(p.target for p in plans))
        state["plans"] = plans

    def on_trial(plan, record, reused) -> None:
        verdict = f"{record.value * 1e3:.3g} ms" if record.ok else f"failed ({record.kind})"
        progress.update(
            state["task"],
            advance=1,
            description=f"{plan.workload.describe()}: {record.candidate.label()} {verdict}",
        )

    done = [0, time.monotonic()]

    def on_entry(plan, entry) -> None:
        """A line per finished study where the bar is not drawn (a log, a pipe): what it chose."""
        done[0] += 1
        if args.json or out.is_terminal:
            return
        winner = entry.get("winner") or {}
        label = candidate_label(winner) if winner else "no winner"
        step = f" {winner['step_ms']:.3g} ms" if winner.get("step_ms") else ""
        out.print(
            f"[{done[0]}/{len(state.get('plans', ()))}] {plan.workload.describe()}: {label}{step} "
            f"({entry.get('trials', 0)} trials; {time.monotonic() - done[1]:.0f} s so far)",
            markup=False,
        )

    studied = [0]

    def on_study(plan, entry) -> None:
        """A line per finished study where the bar is not drawn: the re-timing of every key's finalists
        comes after all studies, so without it a log would show nothing for the whole search."""
        studied[0] += 1
        if args.json or out.is_terminal:
            return
        pruned = sum(c.get("failed") == "pruned" for c in entry.get("candidates", ()))
        out.print(
            f"study {studied[0]}/{len(state.get('plans', ()))} done: {plan.workload.describe()}, "
            f"{entry.get('trials', 0)} trials ({pruned} pruned; {time.monotonic() - done[1]:.0f} s so far)",
            markup=False,
        )

    def on_point(point) -> None:
        progress.update(
            state["task"],
            description=f"map point b={point.batch} ctx={point.context}: {point.winner}{' (tie)' if point.tie else ''}",
        )

    registry = load_registry()
    broken = [f"{f}; its backends are not tuned (`attnbench backends` shows why)" for f in registry.failures]
    for line in broken if not args.json else ():
        out.print(f"[yellow]{line}[/yellow]")
    with progress:
        report = tune(
            workloads,
            registry=registry,
            backends=_split(args.backends),
            results_dir=args.results,
            update_reference=args.update_reference,
            storage=args.storage,
            options=options,
            command=command,
            margin=args.switch_margin,
            samples=args.samples,
            refine=not args.no_refine,
            on_plan=on_plan,
            on_trial=on_trial,
            on_point=on_point,
            on_entry=on_entry,
            on_study=on_study,
        )
    if args.json:
        emit_json(
            {
                "table": str(report.table_path),
                "results_dir": str(report.location.path) if report.location else None,
                "storage": report.storage,
                "interrupted": report.interrupted,
                "trials_run": report.trials_run,
                "messages": report.messages,
                "plugin_failures": broken,
                "entries": report.entries,
                "dispatch_map": str(report.map_path) if report.map_path else None,
                "evaluations": report.evaluations,
                "profile": report.profile,
            }
        )
    else:
        for msg in report.messages:
            out.print(f"[yellow]{msg}[/yellow]")
        print_table(out, summary_table(report.entries, wide=args.wide))
        for line in spread_advice(report.entries):
            out.print(f"[yellow]{line}[/yellow]", markup=True)
        for m in report.maps:
            r = m.refinement
            out.print(
                f"dispatch map {m.key}: batches {m.batches} × contexts {m.contexts}, {len(m.points)} points, "
                f"{r.get('rounds', 0)} refinement rounds, {r.get('evaluations', 0)} worker evaluations",
                markup=False,
            )
        if report.map_path:
            out.print(f"dispatch map: {report.map_path}", markup=False)
        out.print(
            f"table: {report.table_path}   studies: {report.storage}   trials run now: {report.trials_run}"
        )
        if report.location is not None:
            out.print(f"results: {report.location.describe()}", markup=False)
        if args.profile and report.profile:
            print_table(out, profile_table(report.profile))
    if report.interrupted:
        print(
            f"interrupted: measured trials are kept in {report.storage}; run the same command again to resume",
            file=sys.stderr,
        )
        return 130
    return 0


def profile_table(profile: Mapping[str, Any]) -> Table:
    """Where a tune's wall time went (:func:`attnbench.tuning.tuner.time_split`): each phase in total
    and its share of the wall time, then each backend's seconds in the worker."""
    wall = float(profile.get("wall_s") or 0.0)
    table = Table(title=f"where the time went: {wall:.1f} s", title_justify="left")
    for col in ("phase", "seconds", "share"):
        table.add_column(col, justify="left" if col == "phase" else "right")
    for phase, seconds in sorted(profile.get("phases", {}).items(), key=lambda kv: -kv[1]):
        table.add_row(phase, f"{seconds:.1f}", f"{100 * seconds / wall:.0f} %" if wall else "—")
    for backend, phases in sorted(profile.get("by_backend", {}).items()):
        detail = ", ".join(f"{k} {v:.1f}" for k, v in sorted(phases.items(), key=lambda kv: -kv[1]))
        table.add_row(f"  {backend}", f"{sum(phases.values()):.1f}", detail)
    return table


def summary_table(entries: Mapping[str, Mapping[str, Any]], *, wide: bool = False) -> Table:
    """The tuned winners, one row per (model, dtype, batch, context) in that order.

    By default the columns that fit 80 columns: batch, context, the winner's backend and config, its
    measured step time and how it compares with the default; the model and dtype are in the title
    when every row has the same. ``wide`` adds the winner's interval, GB/s and share of bandwidth, the
    runner-up, the default's time, the decision, the load average, the failed candidates and the
    trial count (``--json`` has every field). ``entries`` are read through the table's schema."""

    rows = sorted(
        validate_entries(entries).values(),
        key=lambda e: (e.model, e.dtype, e.batch_bucket, e.context_bucket),
    )
    same = {k: {getattr(e, k) for e in rows} for k in ("model", "dtype")}
    lead = [k for k in ("model", "dtype") if wide or len(same[k]) > 1]
    what = " ".join(next(iter(same[k])) for k in ("model", "dtype") if k not in lead and same[k])
    title = escape(
        f"tuned winners{' for ' + what if what else ''}: decode step, all layers (median of interleaved "
        "samples; unless --layers, timed over one layer per distinct layer cache)"
    )
    columns = [*lead, "batch", "context", "winner", "config", "step ms", "vs default"]
    if wide:
        columns += ["95% interval ms", "GB/s", "% BW", "runner-up", "default ms", "decision"]
        columns += ["load", "failed", "trials"]
    left = ("model", "dtype", "winner", "config", "runner-up", "decision", "failed")
    table = cli_table(title, columns, right=[c for c in columns if c not in left])
    for entry in rows:
        w, r, d = entry.winner, entry.runner_up, entry.default
        cells = [escape(str(getattr(entry, k))) for k in lead]
        cells += [str(entry.batch_bucket), str(entry.context_bucket)]
        if w:
            cells += [escape(w.backend), escape(config_text(w.config)), ms_text(w.step_ms)]
        else:
            cells += ["[red]none passed[/red]", "-", "-"]
        cells.append(_versus_default(entry))
        if wide:
            failed = [c for c in entry.candidates if c.failed]
            cells += [
                _interval(w) or "-",
                f"{w.gbps or 0:.3g}" if w else "-",
                f"{w.pct_of_bandwidth or 0:.3g}" if w else "-",
                escape(f"{_candidate_text(r)} ({entry.margin or 0:+.1%})") if r else "-",
                f"{ms_text(d.step_ms)} {_interval(d)}" if d and d.step_ms is not None else "-",
                "tie: default kept"
                if entry.tie
                else ("switched" if w and d and w.backend != d.backend else "-"),
                f"{entry.load_avg[0]:.2g}" if entry.load_avg else "-",
                escape(", ".join(f"{c.backend}:{c.failed}" for c in failed)) or "-",
                f"{entry.trials}" + ("" if entry.complete else " (partial)"),
            ]
        table.add_row(*cells)
    return table


def _versus_default(entry: TableEntry) -> str:
    """How the winner compares with the backend's default candidate, in a few words."""
    w, d = entry.winner, entry.default
    if not w or w.step_ms is None:
        return "-"
    if entry.tie:
        return "default kept (tie)"
    if not d:
        return "no default"
    if d.failed == "pruned" and d.study_ms:  # stopped early by the pruner: its running median then
        return f"{d.study_ms / w.step_ms:.2f}× faster (default pruned)"
    if d.failed:
        return "default failed"
    if d.step_ms is None:
        return "default not timed"
    if _candidate_text(w) == _candidate_text(d):
        return "is the default"
    # a default far behind keeps its study time (not re-timed beside the finalists): said so
    return f"{d.step_ms / w.step_ms:.2f}× faster" + (" (study)" if w.retimed and not d.retimed else "")


def _candidate_text(c: CandidateResult) -> str:
    """``backend page_size=128 kv_splits=auto``: a candidate in words that a column can wrap."""
    return f"{c.backend} {config_text(c.config)}" if c.config else c.backend


def _interval(c: CandidateResult | None) -> str:
    iv = c.interval if c else None
    return escape(f"[{ms_text(iv['lo_ms'])}, {ms_text(iv['hi_ms'])}] n={iv['samples']}") if iv else ""


def spread_advice(entries: dict) -> list[str]:
    """One line per entry whose spread was too wide to decide, with what to do about it."""
    return [
        f"{row}: the spread of {', '.join(entry['spread']['too_wide'])} is too wide to decide "
        f"(load average {entry['load_avg'][0]:.2g}); rerun on a quieter machine with more "
        "--samples (e.g. --samples 45), or fewer --threads than the machine has cores"
        for row, entry in entries.items()
        if entry.get("spread")
    ]
