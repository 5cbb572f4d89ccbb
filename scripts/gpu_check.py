"""One short GPU check: correctness of every runnable backend, then decode-step time against the roofline.

On a CUDA machine, in this order:

1. the device profile (fingerprint and measured copy bandwidth; cached after the first run);
2. correctness: every registered backend that supports the model on this GPU is checked against the
   float64 reference on a ragged batch (lengths that are not multiples of any page size), for its
   default config and each other choice of each tunable (one at a time);
3. timing: the default config of every correct backend at batch 1/8/32 × context 1k/8k/32k (bf16,
   Llama-3.1-8B's attention, all 32 layers per step) through :func:`attnbench.measure.bench.measure_decode`
   (which checks each workload again before timing it). The 32 layer calls cycle over distinct layer
   caches of ``--materialise-gib`` (4 GiB) in all, far more than any L2, so every call reads from
   HBM. Each step is timed both ways engines can run it: eagerly (every layer launched from Python)
   and as one replayed CUDA graph holding all layers (capturable backends: ``triton_paged``, ``fp8``,
   ``mla``; the others show "—"). Reported: both step times, GB/s of KV cache read and the share of
   the measured copy bandwidth (at the graph time where there is one: the tuning objective on CUDA).

It prints one table and writes JSON (the command, the device fingerprint, the load average, every
number). A time budget (``--budget-s``, default 420 s for steps 2-3; non-default configs stop being
checked at 40 % of it) keeps the whole run under 8 minutes on one GPU: what does not fit is listed as
skipped, never guessed. The points where the bandwidth target applies run first.

Without CUDA it exits with status 2 and says so (``--device cpu`` exists only to test the script
itself on tiny shapes; CPU numbers from it mean nothing for GPUs). Usage::

    python scripts/gpu_check.py                      # writes results/gpu/gpu-check-<device>-<id>.json
    python scripts/gpu_check.py --backends triton_paged,flash --batches 1,32 --contexts 32k
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

NO_CUDA_STATUS = 2
TARGET_BACKEND = "triton_paged"
TARGET_TOKENS = 256 * 1024  # batch · context at or above which the bandwidth target applies
TARGET_PCT = 80.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model", default="llama-3.1-8b", help="model shape preset or config file (default: %(default)s)"
    )
    p.add_argument("--batches", default="1,8,32", help="batch sizes to time (default: %(default)s)")
    p.add_argument("--contexts", default="1k,8k,32k", help="context lengths to time (default: %(default)s)")
    p.add_argument("--dtype", default="bf16", help="compute/KV dtype (default: %(default)s)")
    p.add_argument(
        "--backends", default="", help="comma-separated backend names (default: every registered one)"
    )
    p.add_argument("--layers", type=int, default=0, help="layers per decode step (default: the model's)")
    p.add_argument(
        "--repeats", type=int, default=10, help="timed decode steps per point (default: %(default)s)"
    )
    p.add_argument(
        "--materialise-gib",
        type=float,
        default=4.0,
        help="distinct layer caches per point, in GiB; the step's layers cycle over them. Far above the L2, "
        "and it bounds the (untimed) fill (default: %(default)s)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="seconds for checks and timing together (default: %(default)s)",
    )
    p.add_argument(
        "--default-configs-only",
        action="store_true",
        help="check only each backend's default config (default: also every other choice of each tunable)",
    )
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (only to test this script)")
    p.add_argument("--out", type=Path, help="JSON output (default: results/gpu/gpu-check-<device>-<id>.json)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            f"gpu_check: no CUDA device (torch {torch.__version__} sees none); this check measures an NVIDIA GPU. "
            "Nothing was measured. Run it on a machine with a GPU.",
            file=sys.stderr,
        )
        return NO_CUDA_STATUS
    if device.type not in ("cuda", "cpu"):
        print(f"gpu_check: --device {args.device!r} not in (cuda, cpu)", file=sys.stderr)
        return 1

    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from attnbench.core.device import load_profile
    from attnbench.core.registry import load_registry
    from attnbench.core.shapes import load_shape, parse_dtype
    from attnbench.core.workload import Workload, parse_int_list
    from attnbench.correctness.gate import check
    from attnbench.measure.bench import CheckFailed, measure_decode
    from attnbench.testing import conformance_configs

    console = Console(width=None if sys.stdout.isatty() else 160)
    started = time.monotonic()
    deadline = started + args.budget_s
    check_deadline = started + 0.4 * args.budget_s  # the rest is kept for timing
    shape = load_shape(args.model)
    dtype = parse_dtype(args.dtype)
    batches = parse_int_list(args.batches, field="--batches")
    contexts = parse_int_list(args.contexts, field="--contexts")
    registry = load_registry()
    names = [n.strip() for n in args.backends.split(",") if n.strip()] or registry.names()
    for n in names:
        registry.entry(n)  # unknown names: a clear error listing the registered ones
    if device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes"):
        console.print(
            "[yellow]TRITON_INTERPRET is set: Triton backends run interpreted and are not timed.[/]"
        )

    profile = load_profile(device)
    console.print(
        f"device: {profile.name} ({profile.id}); measured copy bandwidth {profile.bandwidth / 1e9:.0f} GB/s; "
        f"load average {os.getloadavg()[0]:.2f}"
    )

    report: dict[str, Any] = {
        "command": "python scripts/gpu_check.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": profile.as_dict(),
        "model": shape.name,
        "dtype": args.dtype,
        "note": "load_avg is recorded per measurement; a shared machine is noisy",
        "correctness": [],
        "measurements": [],
        "skipped": [],
    }

    # -- 2. correctness: every runnable backend, each tunable choice once --------------------------
    ragged = Workload(shape, (1, 37, 1000, 4099), dtype, str(device))
    if device.type == "cpu":
        ragged = Workload(shape, (1, 37, 70), dtype, "cpu")
    correct: dict[str, dict[str, Any]] = {}
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("correctness", total=len(names))
        for name in names:
            backend = registry.get(name)
            reasons = backend.supports(ragged)
            if reasons:
                report["correctness"].append({"backend": name, "runnable": False, "reasons": reasons})
                progress.advance(task)
                continue
            configs = (
                [backend.default_config()]
                if args.default_configs_only
                else conformance_configs(type(backend))
            )
            for cfg in configs:
                if time.monotonic() > check_deadline and cfg != backend.default_config():
                    why = "time budget (correctness, non-default config)"
                    report["skipped"].append({"backend": name, "config": cfg, "why": why})
                    continue
                try:
                    r = check(backend, ragged, config=cfg)
                    entry = r.as_dict() | {"runnable": True}
                except Exception as err:  # a crash is a failure to report, not a reason to stop the check
                    entry = {"backend": name, "config": cfg, "runnable": True, "passed": False,
                             "failures": [f"{type(err).__name__}: {err}"], "traceback": traceback.format_exc()}  # fmt: skip
                entry["interpreted"] = backend.interpreted(ragged)
                report["correctness"].append(entry)
                if cfg == backend.default_config():
                    correct[name] = entry
            progress.advance(task)

    # -- 3. timing: default configs of the correct backends ----------------------------------------
    # the points where the bandwidth target applies first, so that a tight budget keeps them
    points = sorted(
        ((b, c) for b in batches for c in contexts), key=lambda p: (p[0] * p[1] < TARGET_TOKENS, p)
    )
    runnable = [n for n in names if correct.get(n, {}).get("passed")]
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("timing", total=len(points) * len(runnable))
        for b, c in points:
            workload = Workload.uniform(shape, batch=b, context=c, dtype=dtype, device=str(device))
            for name in runnable:
                progress.advance(task)
                if time.monotonic() > deadline:
                    report["skipped"].append(
                        {"backend": name, "batch": b, "context": c, "why": "time budget"}
                    )
                    continue
                backend = registry.get(name)
                reasons = backend.supports(workload)
                if reasons:
                    report["skipped"].append(
                        {"backend": name, "batch": b, "context": c, "why": "; ".join(reasons)}
                    )
                    continue
                remaining = max(5.0, deadline - time.monotonic())
                try:
                    m = measure_decode(
                        backend,
                        workload,
                        profile=profile,
                        num_layers=args.layers or None,
                        repeats=args.repeats,
                        max_seconds=min(30.0, remaining / 2),
                        materialise_bytes=int(args.materialise_gib * 2**30),
                    )
                    report["measurements"].append(m.as_dict())
                except CheckFailed as err:
                    report["measurements"].append(
                        {"backend": name, "batch": b, "context": c, "timed": False, "note": str(err),
                         "check": err.check.as_dict()}
                    )  # fmt: skip
                except Exception as err:  # OOM, a kernel that does not compile...: recorded per point
                    report["measurements"].append(
                        {"backend": name, "batch": b, "context": c, "timed": False,
                         "note": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
                    )  # fmt: skip
                if device.type == "cuda":
                    torch.cuda.empty_cache()

    report["elapsed_s"] = round(time.monotonic() - started, 1)
    report["load_avg_end"] = list(os.getloadavg())
    report["target"] = target_summary(report["measurements"])

    console.print(build_table(report, Table))
    for line in correctness_lines(report["correctness"]):
        console.print(line)
    console.print(report["target"]["text"])
    if report["skipped"]:
        console.print(f"[yellow]{len(report['skipped'])} item(s) skipped[/] (see the JSON: 'skipped')")

    out = args.out or Path("results") / "gpu" / f"gpu-check-{slug(profile.name)}-{profile.id}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    console.print(f"wrote {out} in {report['elapsed_s']} s")
    return 0


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "device"


def fmt_tokens(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 and n >= 1024 else str(n)


def build_table(report: dict[str, Any], table_cls: Any) -> Any:
    """One row per (batch, context, backend): eager and graph step times, per-layer time (of the ranked
    one), GB/s, % of copy bandwidth."""
    dev = report["device"]
    table = table_cls(
        title=f"decode step, {report['model']} {report['dtype']} on {dev['fingerprint'].get('name', '?')} "
        f"(copy bandwidth {dev['copy_bandwidth'] / 1e9:.0f} GB/s)"
    )
    for col in (
        "batch",
        "context",
        "backend",
        "implementation",
        "eager ms",
        "graph ms",
        "layer µs",
        "GB/s",
        "% copy BW",
        "rel_l2",
    ):
        table.add_column(col, justify="left" if col in ("backend", "implementation") else "right")
    rows = sorted(report["measurements"], key=lambda m: (m["batch"], m["context"], m["backend"]))
    for m in rows:
        if not m.get("timed") or not m.get("step"):
            note = m.get("note") or "not timed"
            note = "interpreted: not timed" if note.startswith("interpreted") else note[:60]
            cells = (
                str(m["batch"]),
                fmt_tokens(m["context"]),
                m["backend"],
                note,
                "—",
                "—",
                "—",
                "—",
                "—",
                "—",
            )
            table.add_row(*cells, style="dim")
            continue
        step = m["step"]["median_s"]
        eager = (m.get("eager_step") or m["step"])["median_s"]
        graph = (m.get("graph_step") or {}).get("median_s")
        rel = (m.get("check") or {}).get("error", {}).get("rel_l2")
        table.add_row(
            str(m["batch"]),
            fmt_tokens(m["context"]),
            m["backend"],
            m.get("implementation", ""),
            f"{eager * 1e3:.3f}",
            f"{graph * 1e3:.3f}" if graph is not None else "—",
            f"{step / max(m['num_layers'], 1) * 1e6:.1f}",
            f"{m['gbps']:.0f}",
            f"{m['pct_of_bandwidth']:.0f}%" if m.get("pct_of_bandwidth") is not None else "—",
            f"{rel:.1e}" if rel is not None else "—",
        )
    return table


def correctness_lines(entries: list[dict[str, Any]]) -> list[str]:
    lines = []
    by_backend: dict[str, list[dict[str, Any]]] = {}
    for e in entries:
        by_backend.setdefault(e["backend"], []).append(e)
    for name, es in by_backend.items():
        if not es[0].get("runnable", True):
            lines.append(f"  {name}: not runnable here: {'; '.join(es[0]['reasons'])}")
            continue
        failed = [e for e in es if not e.get("passed")]
        worst = max((e["error"]["rel_l2"] for e in es if e.get("error")), default=math.nan)
        mode = " (interpreted: checked, not timed)" if es[0].get("interpreted") else ""
        verdict = (
            "all passed"
            if not failed
            else f"[red]{len(failed)} FAILED[/]: "
            + "; ".join(f"{e['config']}: {', '.join(e['failures'])[:120]}" for e in failed[:3])
        )
        lines.append(f"  {name}: {len(es)} config(s) checked, {verdict}; worst rel_l2 {worst:.1e}{mode}")
    return ["correctness (ragged batch vs float64 reference):", *lines]


def target_summary(measurements: list[dict[str, Any]]) -> dict[str, Any]:
    """Whether the target backend reaches TARGET_PCT of copy bandwidth where batch · context ≥ TARGET_TOKENS."""
    pts = [
        m for m in measurements
        if m["backend"] == TARGET_BACKEND and m.get("timed") and m["batch"] * m["context"] >= TARGET_TOKENS
        and m.get("pct_of_bandwidth") is not None
    ]  # fmt: skip
    if not pts:
        return {
            "met": None,
            "points": [],
            "text": f"target ({TARGET_BACKEND} ≥ {TARGET_PCT:.0f}%): no timed point",
        }
    vals = [(m["batch"], m["context"], round(m["pct_of_bandwidth"], 1)) for m in pts]
    met = all(v[2] >= TARGET_PCT for v in vals)
    listed = ", ".join(f"b{b}×{fmt_tokens(c)}: {p}%" for b, c, p in vals)
    text = (
        f"target {TARGET_BACKEND} ≥ {TARGET_PCT:.0f}% of copy bandwidth at batch·context ≥ "
        f"{TARGET_TOKENS // 1024}k tokens: {'met' if met else 'NOT met'} ({listed})"
    )
    return {"met": met, "points": vals, "text": text}


if __name__ == "__main__":
    sys.exit(main())
