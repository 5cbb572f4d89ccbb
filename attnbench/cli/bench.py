"""``attnbench bench`` — check and time each backend's decode step; report GB/s against measured bandwidth.

For every workload (model × batch × context × dtype) and every runnable backend in its default
config: run the correctness gate against float64 attention, then time whole decode steps (all
layers) of the synthetic attention-only model. Reports the error numbers, step time (median, p90),
KV bytes read per step, achieved GB/s, the share of the device's measured memory bandwidth (% BW,
against the profile's copy bandwidth; % read, against the read bandwidth measured right before and
right after that row at the same threads), and the speedup over 'naive'. Backends that would run in an interpreter are checked but never timed.
The table shows the gate's verdict, the median step time, GB/s, % BW and the speedup; --wide shows
every column, --json every field.

example: attnbench bench --model llama-3.1-8b --batch 1,8 --context 1k,8k,32k --dtype bf16,fp32
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from attnbench.backends.matmul_probe import MatmulProbeBackend
from attnbench.cli.common import (
    add_command,
    add_model_option,
    add_wide_option,
    add_workload_options,
    cli_table,
    command_line,
    console,
    emit_json,
    ms_text,
    print_table,
    progress_bar,
    run_options,
    timing_options,
    workloads_from_args,
)
from attnbench.cli.gate_options import add_gate_options, gate_options
from attnbench.core.device import DeviceProfile, ReadMeter, load_profile
from attnbench.core.registry import load_registry
from attnbench.core.timing import TIMING_MODES, timing_mode
from attnbench.core.traffic import decode_cost, roofline
from attnbench.core.workload import Workload
from attnbench.cost.fit import CalibrationError, find_calibration
from attnbench.cost.gpuspec import measured_gpu
from attnbench.measure.bench import CheckFailed, Implausible, measure_decode

BASELINE = "naive"


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "bench", __doc__, parents=[timing_options(), run_options()])
    add_model_option(p, required=True)
    add_workload_options(p, batch="1", context="1k")
    p.add_argument("--backends", help="comma-separated backend names (default: every registered backend)")
    p.add_argument(
        "--timing",
        choices=TIMING_MODES,
        default=None,
        help="the time a step is ranked by: eager (layers launched from Python) or graph (the step "
        "replayed as one CUDA graph, as engines serve decode); default graph on CUDA, eager on the CPU "
        "(where graph is refused). On CUDA both are measured and reported",
    )
    p.add_argument(
        "--probe",
        action="store_true",
        help="add a 'matmul_probe' row: the naive math as one batched matmul over the whole contiguous "
        "cache buffer (nothing copied), the bandwidth a plain matmul reaches on this device",
    )
    p.add_argument("--remeasure", action="store_true", help="measure the device's bandwidth again")
    add_gate_options(p, lossy=False)
    add_wide_option(
        p,
        adds="the error numbers, p90, KV MB per step, % of the read bandwidth, the bound and × its floor, "
        "the calibrated model's predicted time and measured/predicted, the layers materialised",
    )
    p.add_argument(
        "--save",
        metavar="PREFIX",
        help="also write PREFIX.json and PREFIX.md (table with command, device, date, load average)",
    )
    p.set_defaults(func=run)


def _positive(value: int | None, field: str) -> None:
    if value is not None and value < 1:
        raise ValueError(f"{field} = {value} must be ≥ 1")


def run(args: argparse.Namespace) -> int:
    gate_options(args)  # a bad --tolerance-multiple: one line, before anything is measured
    _positive(args.repeats, "--repeats")
    _positive(args.layers, "--layers")
    if args.warmup < 0:
        raise ValueError(f"--warmup = {args.warmup} must be ≥ 0")
    _positive(args.threads, "--threads")
    workloads = workloads_from_args(args)
    for w in workloads:  # --timing graph off CUDA: one line, before anything is measured
        timing_mode(args.timing, w.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    reg = load_registry()
    names = [n.strip() for n in args.backends.split(",") if n.strip()] if args.backends else reg.names()
    backends = [reg.get(n) for n in names]  # an unknown name raises, listing the registered ones
    if args.probe:
        backends.append(MatmulProbeBackend())
    err = Console(stderr=True)
    device = workloads[0].device
    with err.status("measuring device bandwidth…" if args.remeasure else "loading device profile…"):
        profile = load_profile(device, remeasure=args.remeasure)
    with err.status("loading the device's matmul peak (measured once per fingerprint)…"):
        peak = measured_gpu(device).flops  # FLOP/s by dtype, for the compute side of the roofline
    try:  # this device's calibrated step-time model, for the measured-vs-model column
        calibration = find_calibration(profile.fingerprint)
    except CalibrationError as error:
        err.print(f"[yellow]calibration not used: {escape(str(error))}")
        calibration = None
    meter = ReadMeter(device, profile.buffer_bytes)  # the read bandwidth around each timed row
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    load_start = os.getloadavg()
    rows: list[dict[str, Any]] = []
    progress = progress_bar(console=err, transient=True)
    total = len(workloads) * len(backends)

    def make_report(complete: bool) -> dict[str, Any]:
        _add_speedups(rows)
        return {
            "command": command_line(args),
            "date": started,
            "complete": complete,
            "device": profile.as_dict(),
            "host": {"platform": platform.platform(terse=True), "cpu_count": os.cpu_count()},
            "load_avg_start": list(load_start),
            "load_avg_end": list(os.getloadavg()),
            "results": rows,
        }

    with progress:
        task = progress.add_task("bench", total=total)
        for workload in workloads:
            for backend in backends:
                label = f"{workload.describe()} · {backend.name}"
                progress.update(task, description=label)
                rows.append(_measure_row(backend, workload, args, profile, peak, calibration, meter))
                progress.advance(task)
                if not err.is_terminal:  # a log file: one line per measurement instead of a live bar
                    err.print(f"[{len(rows)}/{total}] {label}: {rows[-1]['status']}")
                if args.save and len(rows) < total:  # keep what is done if a long run is stopped
                    _save(Path(args.save), make_report(complete=False))
    report = make_report(complete=True)
    if args.save:
        _save(Path(args.save), report)
    if args.json:
        emit_json(report)
        return 0
    out = console()
    if args.wide and not out.is_terminal:
        out.width = 180  # a file or a pipe: keep the wide table on one line per row
    print_table(out, _table(report, wide=args.wide))
    _print_notes(out, report)
    return 0


def _measure_row(
    backend: Any,
    workload: Any,
    args: argparse.Namespace,
    profile: DeviceProfile,
    peak: dict[str, float],
    calibration: Any = None,
    meter: ReadMeter | None = None,
) -> dict[str, Any]:
    base = {
        "workload": workload.describe(),
        "dtype": workload.dtype_name,
        "batch": workload.batch,
        "context": workload.context,
        "backend": backend.name,
    }
    resolution = backend.resolve(workload)
    base["implementation"] = resolution.implementation
    if not resolution.runnable:
        return base | {"status": "unsupported", "reasons": list(resolution.reasons)}
    read_before = meter() if meter and not resolution.interpreted else None  # never timed: not needed
    try:
        m = measure_decode(
            backend,
            workload,
            resolution=resolution,
            profile=profile,
            warmup=args.warmup,
            repeats=args.repeats,
            max_seconds=args.max_seconds,
            timing=args.timing,
            num_layers=args.layers,
            error_multiple=gate_options(args).error_multiple,
            # the bound is what the device can do at all: a kernel that widens bf16 to fp32 FMAs is
            # not held to torch's bf16 matmul, which CPUs without AVX-512 BF16 run far slower
            peak_flops=max((v for v in peak.values() if v), default=None),
        )
    except CheckFailed as fail:
        return base | {
            "status": "failed-check",
            "check": fail.check.as_dict(),
            "reasons": fail.check.failures,
        }
    except Implausible as error:  # faster than the device can read: refused, never a result
        return base | {"status": "error", "reasons": [str(error)]}
    except (RuntimeError, MemoryError) as error:  # e.g. out of memory: report it, go on with the rest
        return base | {
            "status": "error",
            "reasons": [f"{type(error).__name__}: {str(error).splitlines()[0]}"],
        }
    row = base | {"status": "timed" if m.timed else "checked-only"} | m.as_dict()
    row |= _roofline(backend, workload, m, profile, peak)
    if m.timed and read_before and meter:
        row |= _read_around(m.gbps, read_before, meter())
    predicted = (
        calibration.predict(backend, workload, layers=m.num_layers, kv_bytes=m.kv_bytes)
        if calibration
        else None
    )
    if predicted is not None:
        step_s = m.step.median_s if m.step else None
        row["model"] = {
            "step_s": predicted[0],
            "fit": predicted[1].describe(),
            "measured_over_model": step_s / predicted[0] if step_s else None,
        }
    return row


def _read_around(gbps: float | None, before: float, after: float | None) -> dict[str, Any]:
    """The row's share of the read bandwidth measured right before and right after it (same threads)."""
    if not after:
        return {}
    mean = (before + after) / 2
    return {
        "read_around": {"before_bps": before, "after_bps": after, "mean_bps": mean},
        "pct_of_read": 100 * gbps * 1e9 / mean if gbps else None,
    }


def _roofline(
    backend: Any, workload: Workload, m: Any, profile: DeviceProfile, peak: dict[str, float]
) -> dict[str, Any]:
    """Which bound applies to this step: the KV bytes the backend read over the measured bandwidth, or
    the attention FLOPs (in the backend's own form: absorbed MLA does ~2·H·576 FLOPs per cached
    token) over the measured matmul peak; and how far the measured step is above that floor."""
    layers = m.num_layers or workload.shape.num_layers
    flops_per_s = peak.get(workload.dtype_name) or peak["bf16"]
    cost = decode_cost(workload, form=backend.kv_form, num_layers=layers)
    cost = replace(cost, kv_bytes=m.kv_bytes, io_bytes=0.0)  # the floor: the cache bytes the loop read
    roof = roofline(cost, bandwidth=profile.bandwidth, peak_flops=flops_per_s)
    step_s = m.step.median_s if m.step else None
    floor_s = roof.floor_s
    return {
        "roofline": {
            "bound": roof.bound,
            "memory_floor_s": roof.memory_s,
            "compute_floor_s": roof.compute_s,
            "flops": roof.flops,
            "peak_flops": flops_per_s,
            "x_floor": step_s / floor_s if step_s and floor_s > 0 else None,
        }
    }


def _add_speedups(rows: list[dict[str, Any]]) -> None:
    baseline = {
        r["workload"]: r["step"]["median_s"] for r in rows if r["backend"] == BASELINE and r.get("step")
    }
    for r in rows:
        base = baseline.get(r["workload"])
        r["speedup_vs_naive"] = base / r["step"]["median_s"] if base and r.get("step") else None


def _fmt(value: float | None, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return format(value, spec)


#: What a row that was not timed shows where its step time would be.
_NOT_TIMED = {"unsupported": "cannot run", "failed-check": "not timed", "error": "error"}


def _table(report: dict[str, Any], *, wide: bool = True) -> Table:
    """The report as a table: with ``wide`` (``--wide``, and what ``--save`` writes) every column;
    without, the ones that fit 80 columns — batch, context, backend, gate verdict, median step time,
    GB/s, % of the measured bandwidth and the speedup over naive, the dtype as a column only when
    the rows differ in it. Why a row was not timed is said under the table (:func:`_print_notes`)."""
    dev = report["device"]
    results = report["results"]
    model = results[0]["workload"].split(" ")[0] if results else ""
    dtypes = sorted({r["dtype"] for r in results})
    dtype_column = wide or len(dtypes) > 1
    what = " ".join([model, *([] if dtype_column else dtypes)])
    title = escape(
        f"{what}: measured decode step, all layers — {dev['fingerprint'].get('name')} (measured copy "
        f"bandwidth {dev['copy_bandwidth'] / 1e9:.1f} GB/s)"
    )
    columns = [*(["dtype"] if dtype_column else []), "batch", "context", "backend"]
    columns += ["rel_l2", "max_abs", "gate", "p50 ms", "p90 ms", "KV MB/step"] if wide else ["gate", "p50 ms"]
    columns += ["GB/s", "% BW", "% read", "× naive"] if wide else ["GB/s", "% BW", "× naive"]
    if wide:
        columns += ["bound", "× floor", "predicted ms", "meas/model", "layers mat."]
    table = cli_table(title, columns, right=[c for c in columns if c not in ("dtype", "backend", "gate")])
    for r in results:
        check = r.get("check")
        cells = {"dtype": r["dtype"], "batch": str(r["batch"]), "context": str(r["context"])}
        cells["backend"] = escape(r["backend"])
        if check:
            e = check["error"]
            cells["rel_l2"], cells["max_abs"] = f"{e['rel_l2']:.1e}", f"{e['max_abs']:.1e}"
            cells["gate"] = "pass" if check["passed"] else "[red]FAIL[/red]"
            if check.get("lossy"):  # the error shown is against exact attention
                cells["gate"] += f", lossy ({escape(check['lossy'])})" if wide else ", lossy"
        if r["status"] in _NOT_TIMED or not r["timed"]:
            cells["p50 ms"] = _NOT_TIMED.get(r["status"], "not timed")
        else:
            step, roof, predicted = r["step"], r.get("roofline") or {}, r.get("model") or {}
            cells |= {
                "p50 ms": ms_text(step["median_s"] * 1e3),
                "p90 ms": ms_text(step["p90_s"] * 1e3),
                "KV MB/step": _fmt(r["kv_bytes"] / 1e6, ".1f"),
                "GB/s": _fmt(r.get("gbps"), ".2f"),
                "% BW": _fmt(r.get("pct_of_bandwidth"), ".0f"),
                "% read": _fmt(r.get("pct_of_read"), ".0f"),
                "× naive": _fmt(r.get("speedup_vs_naive"), ".2f"),
                "bound": roof.get("bound", "—"),
                "× floor": _fmt(roof.get("x_floor"), ".1f"),
                "predicted ms": ms_text(predicted.get("step_s", 0) * 1e3 or None),
                "meas/model": _fmt(predicted.get("measured_over_model"), ".2f"),
                "layers mat.": f"{r['layers_materialised']}/{r['num_layers']}",
            }
        table.add_row(*(cells.get(c, "—" if c in ("rel_l2", "max_abs", "gate") else "") for c in columns))
    return table


def _untimed_notes(report: dict[str, Any]) -> list[str]:
    """Why each row that has no step time has none, one line per backend and reason."""
    why = {"unsupported": "cannot run", "failed-check": "failed the correctness gate", "error": "error"}
    lines: dict[str, None] = {}  # each line once, in the order of the rows
    for r in report["results"]:
        if r["status"] in why:
            lines[f"{r['backend']}: {why[r['status']]}: {'; '.join(r['reasons'])}"] = None
        elif not r.get("timed", True) and r.get("note"):
            lines[f"{r['backend']}: {r['note']}"] = None
    return list(lines)


def _print_notes(out: Console, report: dict[str, Any]) -> None:
    for line in _untimed_notes(report):
        out.print(escape(line))
    out.print(
        f"device {report['device']['id']}: {report['device']['fingerprint'].get('name')}, "
        f"{report['device']['fingerprint'].get('threads', '')} threads; load average "
        f"{report['load_avg_start'][0]:.2f} → {report['load_avg_end'][0]:.2f}"
    )
    around = [r["read_around"] for r in report["results"] if r.get("read_around")]
    if around:
        reads = [x[k] / 1e9 for x in around for k in ("before_bps", "after_bps")]
        out.print(
            "% BW: of the profile's copy bandwidth; % read (--wide): of the read bandwidth measured right before and "
            f"right after that row at the same threads (mean of the two; {min(reads):.1f}–{max(reads):.1f} "
            "GB/s in this run, per row in the JSON)."
        )
    if any(
        r.get("layers_materialised") and r["layers_materialised"] < r["num_layers"] for r in report["results"]
    ):
        out.print(
            "layers mat. (--wide) < layers: the synthetic model cycles its decode calls over that many distinct layer "
            "caches (together several times the last-level cache), so each call still reads from DRAM."
        )
    fits = sorted({r["model"]["fit"] for r in report["results"] if r.get("model")})
    if fits:
        out.print(
            "predicted ms (--wide): this device's calibrated step-time model (attnbench calibrate) at the "
            "bytes read; meas/model: the measured p50 over it:"
        )
        for fit in fits:
            out.print(f"  {escape(fit)}")
    if any(r.get("llc_flushed") for r in report["results"]):
        out.print(
            "rows with llc_flushed (JSON): the caches are smaller than 4 × the last-level cache, so it was "
            "evicted before each timed step, outside the timer (a real model's weights would evict it)."
        )
    graphed = [r for r in report["results"] if r.get("graph_step") and r.get("eager_step")]
    if graphed:
        out.print(
            "step ms by timing mode (eager: layers launched from Python; graph: one CUDA graph replay):"
        )
        for r in graphed:
            eager, graph = r["eager_step"]["median_s"] * 1e3, r["graph_step"]["median_s"] * 1e3
            out.print(
                f"  {escape(r['backend'])} b{r['batch']} c{r['context']}: eager {eager:.3f}, graph {graph:.3f} "
                f"(ranked by {r['timing']})"
            )


def _save(prefix: Path, report: dict[str, Any]) -> None:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{prefix}.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    rec = Console(record=True, width=180, file=open(os.devnull, "w"))  # noqa: SIM115
    print_table(rec, _table(report, wide=True))
    _print_notes(rec, report)
    dev = report["device"]
    header = [
        f"# attnbench bench — {report['results'][0]['workload'].split(' ')[0] if report['results'] else ''}",
        "",
        *(
            []
            if report.get("complete", True)
            else ["**Partial: the run was still going when this was written.**", ""]
        ),
        f"- command: `{report['command']}`",
        f"- date: {report['date']}",
        f"- device: {dev['fingerprint'].get('name')} (fingerprint {dev['id']}: "
        + ", ".join(f"{k}={v}" for k, v in dev["fingerprint"].items() if k != "name")
        + ")",
        f"- measured bandwidth: copy {dev['copy_bandwidth'] / 1e9:.2f} GB/s, read {dev['read_bandwidth'] / 1e9:.2f} GB/s "
        f"(buffer {dev['buffer_bytes'] >> 20} MiB, measured {dev['measured_at']})",
        f"- load average at start / end: {', '.join(f'{x:.2f}' for x in report['load_avg_start'])} / "
        f"{', '.join(f'{x:.2f}' for x in report['load_avg_end'])} (shared machine: figures are noisy)",
        "",
        "```",
        rec.export_text().rstrip(),
        "```",
        "",
    ]
    Path(f"{prefix}.md").write_text("\n".join(header))
