"""Check the calibrated cost model against measured decode steps on this machine, on held-out points.

For each model geometry × dtype × backend that runs timed here, the synthetic attention-only decode
step (:func:`attnbench.measure.bench.measure_decode`, over ``--layers`` layers) is measured on two grids of
batch × context in ONE run, in one seeded random order (interleaved, so load drifts hit both alike):

- the **fit grid** (``--fit-batch`` × ``--fit-context``, what a tune grid measures) — the calibration
  (:class:`attnbench.cost.fit.Calibration`, ``t = layers · (t0 + t_seq · batch) + kv_bytes / bw_eff``,
  with a knee past the caches where it fits better,
  per backend, dtype and geometry) is fitted on these points only;
- the **held-out grid** (``--holdout-batch`` × ``--holdout-context``, between and beside the fit
  points) — predicted by that calibration, never part of the fit, and compared with the measurement.

Target (issue 16): ≥ 80 % of held-out points within ±15 % of the measured step, median |error| ≤ 8 %.
The bare roofline (KV bytes over the measured copy bandwidth, or FLOPs over the matmul peak:
:func:`attnbench.core.traffic.decode_roofline`) is recorded beside it, for comparison. The correctness gate
runs at the first point of every (model, backend, dtype); weights are not part of this model, so the
figures are for the attention part of a step.

Writes ``<out>.json`` (every number, the machine, load averages), ``<out>.md``, ``<out>.png`` (the
plot, with the ``plot`` extra; ``python scripts/plot_latency_model.py --validation <out>.json``
redraws it) and ``<out>-calibration.yaml`` (the fit).

    python scripts/validate_estimator.py --out results/cpu/costmodel/costmodel-validation-cpu \
        --doc-plot docs/img/costmodel-validation-cpu.png
    python scripts/validate_estimator.py --quick --out results/validation-smoke   # a tiny smoke run (do not commit it)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import shlex
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from attnbench.core.device import load_profile
from attnbench.core.registry import load_registry
from attnbench.core.shapes import load_shape
from attnbench.core.traffic import decode_roofline
from attnbench.core.workload import Workload, parse_int_list
from attnbench.cost.fit import Calibration, CalibrationPoint, device_entry, geometry_key
from attnbench.cost.gpuspec import device_memory_bytes, measured_flops
from attnbench.measure.bench import CheckFailed, measure_decode

TOLERANCE = 0.15
TARGET_SHARE = 0.80
TARGET_MEDIAN = 0.08
QUICK = {
    "models": "tiny-gqa,tiny-mla",
    "fit_batch": "1,4",
    "fit_context": "64,256,1k",
    "holdout_batch": "2",
    "holdout_context": "128",
    "repeats": 3,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="llama-3.1-8b,qwen2.5-72b,deepseek-v3")
    p.add_argument("--backends", default="naive,flash,fp8,mla")
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--fit-batch", default="1,4", help="batch sizes of the fit grid")
    p.add_argument("--fit-context", default="128,512,2k", help="contexts of the fit grid")
    p.add_argument("--holdout-batch", default="2,3", help="batch sizes of the held-out grid")
    p.add_argument("--holdout-context", default="256,1k", help="contexts of the held-out grid")
    p.add_argument("--layers", type=int, default=2, help="attention layers per step (default 2)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument(
        "--passes",
        type=int,
        default=1,
        help="measure the whole grid this many times, each in its own random order, and keep each "
        "point's median pass (odd counts; 3 averages out a VM's bandwidth drifting by a third in minutes)",
    )
    p.add_argument("--max-seconds", type=float, default=4.0, help="timing budget per point")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the interleaved order")
    p.add_argument("--quick", action="store_true", help="a tiny smoke run (tiny shapes, few points)")
    p.add_argument(
        "--out",
        default="results/cpu/costmodel/costmodel-validation-cpu",
        help="output path without extension",
    )
    p.add_argument(
        "--doc-plot",
        default=None,
        help="also write the plot here (e.g. docs/img/costmodel-validation-cpu.png)",
    )
    args = p.parse_args(argv)
    if args.passes < 1:
        p.error(f"--passes {args.passes}: accepted: a whole number ≥ 1 (odd keeps a true median: 1, 3, 5)")
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    return args


def grid(args: argparse.Namespace, reg: Any) -> list[dict[str, Any]]:
    """Every (model, dtype, backend, batch, context, role) to measure; MLA shapes only in the latent
    form (their expanded cache is ~70× the latent one), GQA shapes only in the expanded form."""
    points = []
    sets = {
        "fit": (parse_int_list(args.fit_batch, field="--fit-batch"), parse_int_list(args.fit_context, field="--fit-context")),
        "holdout": (
            parse_int_list(args.holdout_batch, field="--holdout-batch"),
            parse_int_list(args.holdout_context, field="--holdout-context"),
        ),
    }  # fmt: skip
    for model in args.models.split(","):
        shape = load_shape(model)
        for name in args.backends.split(","):
            backend = reg.get(name)
            if (backend.kv_form == "latent") != shape.is_mla:
                continue
            for dtype in args.dtypes.split(","):
                probe = Workload.uniform(shape, batch=1, context=16, dtype=dtype)
                if backend.supports(probe) or backend.interpreted(probe):
                    continue  # cannot run here, or would run interpreted (never timed)
                for role, (batches, contexts) in sets.items():
                    for b in batches:
                        for c in contexts:
                            points.append(
                                {"model": shape.name, "dtype": dtype, "backend": name, "batch": b, "context": c, "role": role}
                            )  # fmt: skip
    return points


def measure_point(point: dict[str, Any], *, args: argparse.Namespace, reg: Any, profile: Any, check: bool) -> dict[str, Any]:  # fmt: skip
    backend = reg.get(point["backend"])
    workload = Workload.uniform(
        point["model"], batch=point["batch"], context=point["context"], dtype=point["dtype"]
    )
    load_before = os.getloadavg()
    gc.collect()
    m = measure_decode(
        backend,
        workload,
        profile=profile,
        warmup=args.warmup,
        repeats=args.repeats,
        max_seconds=args.max_seconds,
        num_layers=args.layers,
        check=check,
    )
    if m.step is None:
        return point | {"status": "untimed", "reason": m.note}
    return point | {
        "status": "measured",
        "geometry": geometry_key(backend, workload),
        "implementation": m.implementation,
        "layers": args.layers,
        "kv_bytes": m.kv_bytes,
        "measured_s": m.step.median_s,
        "measured_p10_s": m.step.p10_s,
        "measured_p90_s": m.step.p90_s,
        "repeats": m.step.repeats,
        "warmup": m.step.warmup,
        "checked": check,
        "load_avg_before": list(load_before),
    }


def median_pass(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One point's row over its passes: the pass with the median step time (the lower one of an even
    count), with every pass's time in ``passes_s``; the last row when no pass was measured."""
    measured = sorted((r for r in rows if r["status"] == "measured"), key=lambda r: r["measured_s"])
    if not measured:
        return rows[-1]
    row = dict(measured[(len(measured) - 1) // 2])
    row["passes_s"] = [r["measured_s"] for r in rows if r["status"] == "measured"]
    row["wall_s"] = sum(r["wall_s"] for r in rows)
    return row


def _point(r: dict[str, Any]) -> CalibrationPoint:
    return CalibrationPoint(
        backend=r["backend"], dtype=r["dtype"], geometry=r["geometry"], batch=r["batch"], context=r["context"],
        layers=r["layers"], kv_bytes=r["kv_bytes"], step_s=r["measured_s"], source="validation fit grid",
    )  # fmt: skip


def predict(rows: list[dict[str, Any]], *, device: dict[str, Any], reg: Any, command: str) -> Calibration:
    """Fit on the fit grid only; predict every measured row (held-out ones out of sample)."""
    fit_points = [_point(r) for r in rows if r["status"] == "measured" and r["role"] == "fit"]
    cal = Calibration.fit(fit_points, device=device, command=command)
    flops = device["flops"]
    for r in rows:
        if r["status"] != "measured":
            continue
        fit = cal.lookup(r["backend"], r["dtype"], r["geometry"])
        workload = Workload.uniform(r["model"], batch=r["batch"], context=r["context"], dtype=r["dtype"])
        roof = decode_roofline(
            workload,
            bandwidth=device["bandwidth"],
            peak_flops=flops.get(r["dtype"], flops["bf16"]),
            form=reg.get(r["backend"]).kv_form,
            kv_bytes_per_token=r["kv_bytes"] / (r["batch"] * (r["context"] + 1)) * workload.shape.num_layers / r["layers"],
            num_layers=r["layers"],
        )  # fmt: skip
        r["roofline_s"] = roof.floor_s
        r["roofline_ratio"] = r["measured_s"] / roof.floor_s
        if fit is None:
            r["predicted_s"] = None
            continue
        r["fit"] = fit.describe()
        r["predicted_s"] = fit.predict_s(batch=r["batch"], kv_bytes=r["kv_bytes"], layers=r["layers"])
        r["error"] = r["predicted_s"] / r["measured_s"] - 1
        r["within"] = abs(r["error"]) <= TOLERANCE
    return cal


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "tolerance": TOLERANCE,
        "target_share": TARGET_SHARE,
        "target_median_abs_error": TARGET_MEDIAN,
    }
    for role in ("holdout", "fit"):
        sel = [r for r in rows if r["role"] == role and r.get("predicted_s") is not None]
        if not sel:
            continue
        errs = [abs(r["error"]) for r in sel]
        out[role] = {
            "points": len(sel),
            "within": sum(r["within"] for r in sel),
            "share_within": sum(r["within"] for r in sel) / len(sel),
            "median_abs_error": statistics.median(errs),
            "max_abs_error": max(errs),
            "median_roofline_ratio": statistics.median(r["roofline_ratio"] for r in sel),
            "by_backend": {
                b: {
                    "points": len(s),
                    "within": sum(r["within"] for r in s),
                    "median_abs_error": statistics.median(abs(r["error"]) for r in s),
                }
                for b in sorted({r["backend"] for r in sel})
                for s in [[r for r in sel if r["backend"] == b]]
            },
        }
    h = out.get("holdout")
    out["target_met"] = (
        bool(h) and h["share_within"] >= TARGET_SHARE and h["median_abs_error"] <= TARGET_MEDIAN
    )
    out["not_predicted"] = [f"{r['model']}/{r['backend']}/{r['dtype']}" for r in rows if r.get("status") == "measured" and r.get("predicted_s") is None]  # fmt: skip
    return out


def markdown(doc: dict[str, Any]) -> str:
    s = doc["summary"]
    lines = [
        "# Cost-model validation on CPU: calibrated prediction vs measured decode step, held-out points",
        "",
        f"Command: `{doc['command']}`  ",
        f"Machine: {doc['device']['name']} ({doc['device']['fingerprint'].get('threads')} threads, profile "
        f"`{doc['profile_id']}`, copy bandwidth {doc['device']['bandwidth'] / 1e9:.2f} GB/s), "
        f"{doc['started']} – {doc.get('finished', '?')}; load average at start {doc['load_avg_start']}, "
        f"at end {doc.get('load_avg_end')}.  ",
        f"Model: `{doc['model']}`, fitted per backend, dtype and geometry on the fit grid only; each step runs "
        f"{doc['args']['layers']} attention layers (the attention part of a step; no weights). Fit and "
        f"held-out points were measured interleaved in seeded random orders, {doc['args'].get('passes', 1)} "
        "pass(es) over the grid; a point's figure is its median pass.",
        "",
    ]
    if s.get("holdout"):
        lines += ["| points | n | within ±15 % | share | median \\|error\\| | max \\|error\\| | median measured / bare roofline |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
        for role in ("holdout", "fit"):
            v = s.get(role)
            if v:
                lines.append(
                    f"| {'held-out (predicted)' if role == 'holdout' else 'fit grid (in sample)'} | {v['points']} | "
                    f"{v['within']} | {100 * v['share_within']:.0f} % | {100 * v['median_abs_error']:.1f} % | "
                    f"{100 * v['max_abs_error']:.0f} % | {v['median_roofline_ratio']:.2f} |"
                )
        met = "yes" if s["target_met"] else "no"
        lines += [
            "",
            f"**Target (≥ 80 % of held-out points within ±15 %, median |error| ≤ 8 %) met: {met}.**",
            "",
        ]
        lines += [
            "| backend | held-out points | within ±15 % | median \\|error\\| |",
            "| --- | ---: | ---: | ---: |",
        ]
        for b, v in s["holdout"]["by_backend"].items():
            lines.append(f"| {b} | {v['points']} | {v['within']} | {100 * v['median_abs_error']:.1f} % |")
        lines.append("")
    lines += [
        "| role | model | dtype | backend | batch | context | KV MB/step | measured ms (p10–p90) | predicted ms | error | bare roofline ms | load |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]  # fmt: skip
    for r in sorted(
        doc["rows"], key=lambda r: (r["role"], r["model"], r["dtype"], r["backend"], r["batch"], r["context"])
    ):
        head = (
            f"| {r['role']} | {r['model']} | {r['dtype']} | {r['backend']} | {r['batch']} | {r['context']} "
        )
        if r["status"] != "measured":
            lines.append(head + f"| {r['status']}: {r.get('reason', '')} |" + " |" * 5)
            continue
        pred = r.get("predicted_s")
        err = "—" if pred is None else f"{100 * r['error']:+.1f} %{'' if r['within'] else ' ✗'}"
        lines.append(
            head
            + f"| {r['kv_bytes'] / 1e6:.2f} | {1e3 * r['measured_s']:.2f} ({1e3 * r['measured_p10_s']:.2f}–"
            f"{1e3 * r['measured_p90_s']:.2f}) | {'—' if pred is None else f'{1e3 * pred:.2f}'} | {err} "
            f"| {1e3 * r['roofline_s']:.3f} | {r['load_avg_before'][0]:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)  # before the profile: the fingerprint records the threads
    reg = load_registry()
    profile = load_profile(remeasure=True)  # the bandwidths of now: a VM's move by half within hours
    cpu = torch.device("cpu")
    device = device_entry(
        profile, flops=measured_flops(cpu, profile_id=profile.id), memory_bytes=device_memory_bytes(cpu)
    )
    points = grid(args, reg)
    schedule = []  # each pass in its own order: fit and held-out points interleaved
    for k in range(args.passes):
        order = list(points)
        random.Random(args.seed + k).shuffle(order)
        schedule += order
    passes: dict[str, list[dict[str, Any]]] = {}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "python scripts/validate_estimator.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    doc: dict[str, Any] = {
        "command": command,
        "device": device,
        "profile_id": profile.id,
        "python": platform.python_version(),
        "args": vars(args),
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "load_avg_start": [round(x, 2) for x in os.getloadavg()],
        "rows": [],
    }
    checked: set[tuple[str, str, str]] = set()
    failed: dict[tuple[str, str, str], str] = {}
    t_start = time.perf_counter()
    for i, point in enumerate(schedule, 1):
        combo = (point["model"], point["backend"], point["dtype"])
        t0 = time.perf_counter()
        try:
            if combo in failed:
                row = dict(point) | {
                    "status": "skipped",
                    "reason": f"failed the correctness gate: {failed[combo]}",
                }
            else:
                row = measure_point(point, args=args, reg=reg, profile=profile, check=combo not in checked)
                checked.add(combo)
        except CheckFailed as err:  # never timed; the other points of this backend and dtype are skipped
            failed[combo] = str(err)
            row = dict(point) | {"status": "failed-check", "reason": str(err)}
        except Exception as err:  # a failed point is recorded with its error, the run goes on
            row = dict(point) | {"status": "error", "reason": f"{type(err).__name__}: {err}"}
        row["wall_s"] = time.perf_counter() - t0
        passes.setdefault(json.dumps(point, sort_keys=True), []).append(row)
        what = (
            f"{1e3 * row['measured_s']:.2f} ms"
            if row["status"] == "measured"
            else f"{row['status']}: {row.get('reason')}"
        )
        print(f"[{i}/{len(schedule)} {time.perf_counter() - t_start:.0f}s] {point['role']} {point['model']} {point['dtype']} "
              f"{point['backend']} b={point['batch']} ctx={point['context']}: {what}", flush=True)  # fmt: skip
    doc["rows"] = [median_pass(rows) for rows in passes.values()]
    cal = predict(doc["rows"], device=device, reg=reg, command=command)
    doc["model"] = cal.as_dict()["model"]
    doc["fits"] = [f.describe() for f in cal.fits]
    doc["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    doc["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    doc["summary"] = summarise(doc["rows"])
    cal.save(out.with_name(out.name + "-calibration.yaml"))
    out.with_suffix(".json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    out.with_suffix(".md").write_text(markdown(doc))
    try:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from plot_latency_model import plot_validation

        plot_validation(doc, out.with_suffix(".png"))
        if args.doc_plot:
            plot_validation(doc, args.doc_plot)
    except ImportError as err:  # matplotlib is the `plot` extra
        print(f"no plot ({err}); install the plot extra: pip install 'attnbench[plot]'", file=sys.stderr)
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
