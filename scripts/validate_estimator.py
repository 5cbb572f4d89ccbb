"""Check the latency estimator against measured decode steps on this machine.

For every point of a grid (model shape × batch × context × dtype × backend) it times one decode step of
the synthetic attention-only model (:func:`attnbench.bench.measure_decode`: correctness gate first,
then the step over ``--layers`` layers) and compares it with the estimator's roofline for the same
step, :func:`attnbench.estimate.attention_only_step` with ``--gpu this``: the model has no weights, so

    predicted = max(kv_bytes / measured_bandwidth, attention_flops / measured_matmul_flops[dtype])

``measured_bandwidth`` is the device profile's copy bandwidth (``attnbench.device.load_profile``), the
same number ``attnbench estimate --gpu this`` uses. Because the machine may be shared, the copy
bandwidth is also re-measured just before each point and a second prediction from it is recorded
("in-situ"), as a diagnostic of load, not as the criterion. A second diagnostic that the load cannot distort much:
with one torch thread (``--threads 1``) every kernel runs in the calling thread, so its *thread CPU
time* (``time.thread_time``) per step is the time the step spent running, without the time it waited
for a core; it is compared with the bytes over a copy bandwidth timed the same way. Target: measured
(wall clock, the criterion) within ±25% of the prediction for at least 80% of the points.

Writes ``<out>.json`` (every number, the machine's fingerprint, load averages) and ``<out>.md``.

    python scripts/validate_estimator.py --out results/estimator-validation-cpu
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shlex
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from rich.progress import Progress

import attnbench.bench
from attnbench.bench import measure_decode
from attnbench.device import load_profile, measure_bandwidth
from attnbench.estimate import attention_only_step, measured_gpu
from attnbench.registry import load_registry
from attnbench.shapes import load_shape
from attnbench.workload import Workload, parse_int_list

#: Backends whose cache dtype differs from the workload's compute dtype.
CACHE_DTYPE = {"fp8": "fp8"}
TOLERANCE = 0.25
TARGET_SHARE = 0.80


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="llama-3.1-8b,qwen2.5-72b,llama-3.1-405b,deepseek-v3")
    p.add_argument("--batch", default="1,4")
    p.add_argument("--context", default="1k,8k")
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--backends", default="naive,flash")
    p.add_argument("--layers", type=int, default=8, help="layers per decode step (default 8; see the docs)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--max-seconds", type=float, default=30.0, help="cap on the timed phase of one point")
    p.add_argument(
        "--max-step-gb",
        type=float,
        default=4.0,
        help="skip points whose step reads more (keeps the run short)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument(
        "--append",
        action="store_true",
        help="add the points to an existing <out>.json of the same device profile instead of starting anew",
    )
    p.add_argument("--out", default="results/estimator-validation-cpu", help="output path without extension")
    return p.parse_args(argv)


def cpu_copy_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Copy bandwidth (read + write bytes per second) over thread CPU time (see the module docstring)."""
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    samples = []
    for _ in range(repeats):
        t0 = time.thread_time()
        dst.copy_(src)
        samples.append(time.thread_time() - t0)
    return 2 * nbytes / statistics.median(samples)


class ThreadTimes:
    """Wraps :func:`attnbench.timing.measure` as ``measure_decode`` calls it, to also record the thread
    CPU time of every call of the timed function (warm-up calls included; the caller drops them)."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._measure = attnbench.bench.measure

    def __enter__(self) -> ThreadTimes:
        def measure(fn, **kw):  # type: ignore[no-untyped-def]
            def timed(i: int) -> object:
                t0 = time.thread_time()
                out = fn(i)
                self.samples.append(time.thread_time() - t0)
                return out

            return self._measure(timed, **kw)

        attnbench.bench.measure = measure  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        attnbench.bench.measure = self._measure  # type: ignore[assignment]


def grid(args: argparse.Namespace) -> list[dict[str, Any]]:
    points = []
    for model in args.models.split(","):
        shape = load_shape(model)
        for dtype in args.dtypes.split(","):
            for batch in parse_int_list(args.batch, field="--batch"):
                for context in parse_int_list(args.context, field="--context"):
                    for backend in args.backends.split(","):
                        points.append(
                            {
                                "model": shape.name,
                                "dtype": dtype,
                                "batch": batch,
                                "context": context,
                                "backend": backend,
                            }
                        )
    return points


def run_point(
    point: dict[str, Any], *, args: argparse.Namespace, reg: Any, profile: Any, gpu: Any
) -> dict[str, Any]:
    backend = reg.get(point["backend"])
    workload = Workload.uniform(
        point["model"], batch=point["batch"], context=point["context"], dtype=point["dtype"]
    )
    row = dict(point)
    reasons = backend.supports(workload)
    if reasons:
        return row | {"status": "unsupported", "reason": "; ".join(reasons)}
    plan_cost = attention_only_step(
        workload.shape,
        gpu=gpu,
        batch=point["batch"],
        context=point["context"],
        dtype=point["dtype"],
        kv_dtype=CACHE_DTYPE.get(backend.name),
        form=backend.kv_form,
        num_layers=args.layers,
    )
    if plan_cost.kv_bytes > args.max_step_gb * 1e9:
        return row | {
            "status": "skipped",
            "reason": f"step reads {plan_cost.kv_bytes / 1e9:.1f} GB > --max-step-gb",
        }
    load_before = os.getloadavg()
    insitu_copy, insitu_read, _ = measure_bandwidth("cpu")
    cpu_bw = cpu_copy_bandwidth() if torch.get_num_threads() == 1 else float("nan")
    gc.collect()
    with ThreadTimes() as thread_times:
        m = measure_decode(
            backend,
            workload,
            profile=profile,
            warmup=args.warmup,
            repeats=args.repeats,
            max_seconds=args.max_seconds,
            num_layers=args.layers,
        )
    assert m.step is not None, m.note
    step_cpu = statistics.median(thread_times.samples[m.step.warmup :])
    # the timed steps' mean context: the cache grows by one token per step during warm-up and timing
    ctx = point["context"] + m.step.warmup + (m.step.repeats - 1) / 2
    pred = attention_only_step(
        workload.shape,
        gpu=gpu,
        batch=point["batch"],
        context=ctx,
        dtype=point["dtype"],  # type: ignore[arg-type]
        kv_dtype=CACHE_DTYPE.get(backend.name),
        form=backend.kv_form,
        num_layers=args.layers,
    )
    insitu = pred.kv_bytes / insitu_copy
    measured = m.step.median_s
    return row | {
        "status": "measured",
        "implementation": m.implementation,
        "layers": args.layers,
        "mean_context_timed": ctx,
        "kv_bytes_estimator": pred.kv_bytes,
        "kv_bytes_loop": m.kv_bytes,
        "flops": pred.flops,
        "predicted_s": pred.time_s,
        "predicted_bound": pred.bound,
        "predicted_kv_s": pred.kv_s,
        "predicted_flop_s": pred.flop_s,
        "measured_s": measured,
        "measured_p10_s": m.step.p10_s,
        "measured_p90_s": m.step.p90_s,
        "repeats": m.step.repeats,
        "ratio": measured / pred.time_s,
        "within": abs(measured / pred.time_s - 1) <= TOLERANCE,
        "achieved_gbps": m.gbps,
        "insitu_copy_gbps": insitu_copy / 1e9,
        "insitu_read_gbps": insitu_read / 1e9,
        "predicted_insitu_s": max(insitu, pred.flop_s),
        "ratio_insitu": measured / max(insitu, pred.flop_s),
        "cpu_copy_gbps": cpu_bw / 1e9,
        "measured_cpu_s": step_cpu,
        "predicted_cpu_s": max(pred.kv_bytes / cpu_bw, pred.flop_s),
        "ratio_cpu": step_cpu / max(pred.kv_bytes / cpu_bw, pred.flop_s),
        "check_rel_l2": m.check.error.rel_l2 if m.check else None,
        "load_avg_before": list(load_before),
        "load_avg_after": list(os.getloadavg()),
    }


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    done = [r for r in rows if r["status"] == "measured"]
    out: dict[str, Any] = {"points_measured": len(done), "tolerance": TOLERANCE, "target_share": TARGET_SHARE}
    if not done:
        return out
    for name in sorted({r["backend"] for r in done}):
        sel = [r for r in done if r["backend"] == name]
        out[f"{name}"] = {
            "points": len(sel),
            "within": sum(r["within"] for r in sel),
            "share_within": sum(r["within"] for r in sel) / len(sel),
            "median_ratio": statistics.median(r["ratio"] for r in sel),
            "median_ratio_insitu": statistics.median(r["ratio_insitu"] for r in sel),
            "median_ratio_cpu": statistics.median(r["ratio_cpu"] for r in sel),
            "within_cpu": sum(abs(r["ratio_cpu"] - 1) <= TOLERANCE for r in sel),
            "min_ratio": min(r["ratio"] for r in sel),
            "max_ratio": max(r["ratio"] for r in sel),
        }
    # the best backend per workload: what an autotuner would pick
    best: dict[tuple, dict[str, Any]] = {}
    for r in done:
        key = (r["model"], r["dtype"], r["batch"], r["context"])
        if key not in best or r["measured_s"] < best[key]["measured_s"]:
            best[key] = r
    sel = list(best.values())
    out["best_backend"] = {
        "points": len(sel),
        "within": sum(r["within"] for r in sel),
        "share_within": sum(r["within"] for r in sel) / len(sel),
        "median_ratio": statistics.median(r["ratio"] for r in sel),
    }
    out["all"] = {
        "points": len(done),
        "within": sum(r["within"] for r in done),
        "share_within": sum(r["within"] for r in done) / len(done),
        "median_ratio": statistics.median(r["ratio"] for r in done),
        "median_ratio_insitu": statistics.median(r["ratio_insitu"] for r in done),
        "median_ratio_cpu": statistics.median(r["ratio_cpu"] for r in done),
        "within_cpu": sum(abs(r["ratio_cpu"] - 1) <= TOLERANCE for r in done),
    }
    out["target_met"] = out["all"]["share_within"] >= TARGET_SHARE
    return out


def markdown(doc: dict[str, Any]) -> str:
    s = doc["summary"]
    lines = [
        "# Estimator validation on CPU: predicted vs measured ITL of the attention-only decode loop",
        "",
        "Command(s): " + "; then ".join(f"`{c}`" for c in doc.get("commands", [doc["command"]])) + "  ",
        f"Machine: {doc['device']['name']} ({doc['device']['threads']} threads, fingerprint `{doc['profile_id']}`), "
        f"measured at {doc['started']} – {doc['finished']}.  ",
        f"Roofline (`--gpu this`): copy bandwidth {doc['bandwidth_gbps']:.2f} GB/s (device profile), "
        f"matmul {doc['matmul_gflops']['bf16']:.0f} GFLOP/s bf16, {doc['matmul_gflops']['fp32']:.0f} GFLOP/s fp32.  ",
        f"Load average at start {doc['load_avg_start']}, at end {doc['load_avg_end']}: this machine is shared "
        "and noisy; the in-situ column re-measures the copy bandwidth just before each point.",
        "",
        f"Each step runs {doc['args']['layers']} attention layers; predicted = max(KV bytes / bandwidth, attention "
        "FLOPs / matmul FLOP/s), measured = median step time of `measure_decode` (checked against the float64 "
        "reference first). Ratio = measured / predicted; target: within ±25% for ≥ 80% of points. The `fp8` "
        "backend keeps an fp8 cache for a bf16/fp32 workload: its prediction counts 1 byte per cached value "
        "(its per-token-head scales, 3% more, are not counted).",
        "",
    ]
    if s.get("points_measured"):
        lines += [
            "| set | points | within ±25% | share | median ratio |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for key in [k for k in s if isinstance(s[k], dict)]:
            v = s[key]
            lines.append(
                f"| {key} | {v['points']} | {v['within']} | {100 * v['share_within']:.0f}% | {v['median_ratio']:.2f} |"
            )
        lines += ["", f"**Target met: {'yes' if s['target_met'] else 'no'}.**", ""]
    lines += [
        "| model | dtype | batch | context | backend | KV MB/step | predicted ms | measured ms (p10–p90) | ratio "
        "| in-situ GB/s | ratio in-situ | CPU-time GB/s | CPU-time predicted / measured ms | ratio CPU-time | load |",
        "| --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in doc["rows"]:
        head = f"| {r['model']} | {r['dtype']} | {r['batch']} | {r['context']} | {r['backend']} "
        if r["status"] != "measured":
            lines.append(head + f"| {r['status']}: {r.get('reason', '')} |" + " |" * 9)
            continue
        mark = "" if r["within"] else " ✗"
        lines.append(
            head
            + f"| {r['kv_bytes_estimator'] / 1e6:.0f} | {1e3 * r['predicted_s']:.1f} | {1e3 * r['measured_s']:.1f} "
            f"({1e3 * r['measured_p10_s']:.0f}–{1e3 * r['measured_p90_s']:.0f}) | {r['ratio']:.2f}{mark} "
            f"| {r['insitu_copy_gbps']:.2f} | {r['ratio_insitu']:.2f} | {r['cpu_copy_gbps']:.2f} "
            f"| {1e3 * r['predicted_cpu_s']:.1f} / {1e3 * r['measured_cpu_s']:.1f} | {r['ratio_cpu']:.2f} "
            f"| {r['load_avg_before'][0]:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)  # before the profile: the fingerprint records the threads
    reg = load_registry()
    profile = load_profile()
    gpu = measured_gpu("cpu")
    points = grid(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {
        "command": "python scripts/validate_estimator.py "
        + shlex.join(sys.argv[1:] if argv is None else argv),
        "device": profile.fingerprint,
        "profile_id": profile.id,
        "profile_measured_at": profile.measured_at,
        "bandwidth_gbps": profile.bandwidth / 1e9,
        "read_bandwidth_gbps": profile.read_bandwidth / 1e9,
        "matmul_gflops": {k: v / 1e9 for k, v in gpu.flops.items()},
        "python": platform.python_version(),
        "args": vars(args),
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "load_avg_start": [round(x, 2) for x in os.getloadavg()],
        "note": "shared 2-core machine: other processes ran during the measurement (see load averages)",
        "rows": [],
    }
    doc["commands"] = [doc["command"]]
    if args.append and out.with_suffix(".json").exists():
        previous = json.loads(out.with_suffix(".json").read_text())
        if previous.get("profile_id") != profile.id:
            raise SystemExit(
                f"--append: {out.with_suffix('.json')} was measured with device profile "
                f"{previous.get('profile_id')}, this run has {profile.id} (another machine or thread count)"
            )
        previous["commands"] = [*previous.get("commands", [previous["command"]]), doc["command"]]
        previous.setdefault("runs", []).append(
            {k: doc[k] for k in ("command", "started", "load_avg_start", "args")}
        )
        doc = previous
    with Progress() as progress:
        task = progress.add_task("validating", total=len(points))
        for point in points:
            progress.update(
                task,
                description=f"{point['model']} {point['dtype']} b={point['batch']} "
                f"ctx={point['context']} {point['backend']}",
            )
            t0 = time.perf_counter()
            try:
                row = run_point(point, args=args, reg=reg, profile=profile, gpu=gpu)
            except Exception as err:  # a failed point is recorded with its error, the run goes on
                row = dict(point) | {"status": "error", "reason": f"{type(err).__name__}: {err}"}
            row["wall_s"] = time.perf_counter() - t0
            doc["rows"].append(row)
            if row["status"] == "measured":
                progress.console.print(
                    f"{point} predicted {1e3 * row['predicted_s']:.1f} ms measured {1e3 * row['measured_s']:.1f} ms "
                    f"ratio {row['ratio']:.2f} (in-situ {row['ratio_insitu']:.2f}, CPU-time {row['ratio_cpu']:.2f}) "
                    f"load {row['load_avg_before'][0]:.1f}"
                )
            else:
                progress.console.print(f"{point} {row['status']}: {row.get('reason', '')}")
            doc["summary"] = summarise(doc["rows"])
            out.with_suffix(".json").write_text(json.dumps(doc, indent=2, default=str))
            progress.advance(task)
    doc["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    doc["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    doc["summary"] = summarise(doc["rows"])
    out.with_suffix(".json").write_text(json.dumps(doc, indent=2, default=str))
    out.with_suffix(".md").write_text(markdown(doc))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
