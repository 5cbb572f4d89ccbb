"""The ``cpu_decode`` kernel's share of the read bandwidth, beside vLLM's CPU kernel and the matmul probe.

At one thread (``--threads``), llama-3.1-8b's attention geometry, bf16, batches 1 and 8, contexts 8k
and 32k: every kernel goes through :func:`attnbench.measure.bench.measure_decode` — the correctness gate
first, then whole decode steps of ``--layers`` layers through the synthetic model, which cycles its
calls over distinct layer caches worth at least 4 × the last-level cache (``layers mat.``), so every
call reads from DRAM; the timed run is spot-checked against float64 afterwards. The read bandwidth
(a large ``sum``, :class:`attnbench.core.device.ReadMeter`, as ``bench``'s ``% read``) is measured in the same run, at the
same thread count, right before and right after each kernel's measurement: its share is against the
mean of the two (the single-thread read bandwidth of this VM moves by up to 20 % within minutes, so a
figure taken at another moment is not a fair denominator), and both are recorded.
Writes ``<out>.json`` and ``<out>.md`` with the command, the machine, the date and the load average.

    python scripts/cpu_kernel_bandwidth.py                 # the full run (quiet machine)
    python scripts/cpu_kernel_bandwidth.py --quick         # smoke: 1k context, batch 1, 2 layers

Kernels: ``cpu_decode`` at each ``--page-sizes`` × ``--prefetch`` value (by default its default
prefetch), ``vllm_cpu`` (vLLM's default config) where the attnbench-vllm plugin is installed, and
``matmul_probe`` (``--no-probe`` leaves it out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from attnbench.backends.cpu_decode import PAGE_SIZES, CpuDecodeBackend
from attnbench.backends.cpu_decode_fp8 import CpuDecodeFp8Backend
from attnbench.backends.matmul_probe import MatmulProbeBackend
from attnbench.cli.common import positive_int
from attnbench.core.device import (
    DeviceProfile,
    ReadMeter,
    fingerprint,
    last_level_cache_bytes,
    measure_bandwidth,
)
from attnbench.core.registry import load_registry
from attnbench.core.workload import Workload, parse_int_list, parse_tokens
from attnbench.measure.bench import measure_decode


def _kernels(
    page_sizes: list[int], prefetches: list[int], *, probe: bool, fp8: bool = False
) -> list[tuple[str, Any, dict[str, Any]]]:
    default_pf = CpuDecodeBackend.default_config()["prefetch"]
    out: list[tuple[str, Any, dict[str, Any]]] = [
        (
            f"cpu_decode page_size={ps}" + (f" prefetch={pf}" if pf != default_pf else ""),
            CpuDecodeBackend(),
            {"page_size": ps, "prefetch": pf},
        )
        for ps in page_sizes
        for pf in prefetches
    ]
    if fp8:  # the fp8 sibling at the same page sizes (its bytes: 1 per value + 8 per token and KV head),
        # with each conversion where its variant is c-avx512bf16 (the tunable `convert`)
        converts = next(t.choices for t in CpuDecodeFp8Backend.tunables if t.name == "convert")
        out += [
            (
                f"cpu_decode_fp8 page_size={ps} convert={cv}",
                CpuDecodeFp8Backend(),
                {"page_size": ps, "convert": cv},
            )
            for ps in page_sizes
            for cv in converts
        ]
    registry = load_registry()
    if "vllm_cpu" in registry.names():
        out.append(("vllm_cpu (vLLM's default config)", registry.get("vllm_cpu"), {}))
    if fp8 and "vllm_cpu_fp8" in registry.names():
        out.append(("vllm_cpu_fp8 (vLLM's default config)", registry.get("vllm_cpu_fp8"), {}))
        # on an AMX CPU vLLM's default for fp8 is its amx path, which fails the gate (docs/engines.md):
        # its vec path is the vLLM fp8 kernel that passes, and the one to compare with
        out.append(("vllm_cpu_fp8 isa=vec", registry.get("vllm_cpu_fp8"), {"isa": "vec"}))
    if probe:
        out.append(("matmul_probe", MatmulProbeBackend(), {}))
    return out


def _profile(load: tuple[float, float, float]) -> DeviceProfile:
    """The device profile with copy and read bandwidth measured now (at the current thread count)."""
    copy_bw, read_bw, nbytes = measure_bandwidth("cpu")
    return DeviceProfile(
        fingerprint=fingerprint("cpu"),
        copy_bandwidth=copy_bw,
        read_bandwidth=read_bw,
        buffer_bytes=nbytes,
        measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        load_avg=load,
    )


def _row(label: str, m: Any, read_before: float, read_after: float) -> dict[str, Any]:
    read_bw = (read_before + read_after) / 2
    share = m.gbps * 1e9 / read_bw
    return {
        "kernel": label,
        "backend": m.backend,
        "config": m.config,
        "implementation": m.implementation,
        "batch": m.batch,
        "context": m.context,
        "ms_per_layer": m.per_layer_s * 1e3,
        "p90_step_ms": m.step.p90_s * 1e3 if m.step else None,
        "gbps": m.gbps,
        "share_of_read": share,
        "read_gbps": read_bw / 1e9,
        "read_gbps_before": read_before / 1e9,
        "read_gbps_after": read_after / 1e9,
        "layers": m.num_layers,
        "layers_materialised": m.layers_materialised,
        "llc_flushed": m.llc_flushed,
        "rel_l2": m.check.error.rel_l2 if m.check else None,
        "gate_passed": m.check.passed if m.check else None,
        "load_avg": list(m.load_avg),
    }


def _markdown(record: dict[str, Any]) -> str:
    lines = [
        "# cpu_decode: share of the measured read bandwidth",
        "",
        f"- command: `{record['command']}`",
        f"- date: {record['date']}",
        f"- machine: {record['machine']} ({record['cpu']}, {record['threads']} thread(s), "
        f"last-level cache {record['llc_mib']:.0f} MiB)",
        "- read bandwidth (same run, same threads): measured right before and right after each "
        "kernel; its share is against the mean of the two (`read GB/s`, with before → after)",
        f"- load average at start / end: {record['load_start']} / {record['load_end']}",
        f"- wall time: {record['wall_s']:.0f} s",
        "",
        "| batch | context | kernel | implementation | ms / layer | GB/s | read GB/s | share of read bw | layers mat. | rel_l2 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in record["rows"]:
        if "error" in r:
            lines.append(f"| {r['batch']} | {r['context']} | {r['kernel']} | — | {r['error']} | | | | | |")
            continue
        lines.append(
            f"| {r['batch']} | {r['context']} | {r['kernel']} | {r['implementation']} | "
            f"{r['ms_per_layer']:.3f} | {r['gbps']:.1f} | {r['read_gbps']:.1f} "
            f"({r['read_gbps_before']:.1f} → {r['read_gbps_after']:.1f}) | {100 * r['share_of_read']:.0f} % | "
            f"{r['layers_materialised']}/{r['layers']} | {r['rel_l2']:.1e} |"
        )
    return "\n".join(lines) + "\n"


def _choices(ap: argparse.ArgumentParser, option: str, value: str, tunable: str) -> list[int]:
    """``value``, a comma-separated list of ``cpu_decode``'s ``tunable`` values, as ints; else an argparse
    error naming the option, the value and what the tunable accepts."""
    accepted = next(t.choices for t in CpuDecodeBackend.tunables if t.name == tunable)
    items = [x.strip() for x in value.split(",") if x.strip()]
    if not items or any(not x.isdigit() or int(x) not in accepted for x in items):
        ap.error(f"{option} {value!r}: a comma-separated list of {', '.join(map(str, accepted))}")
    return [int(x) for x in items]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--context", default="8k,32k")
    ap.add_argument("--threads", type=positive_int, default=1)
    ap.add_argument("--layers", type=positive_int, default=8, help="layers per timed step (default 8)")
    ap.add_argument("--repeats", type=positive_int, default=8)
    ap.add_argument("--max-seconds", type=float, default=20.0, help="cap on timing per kernel and point")
    ap.add_argument(
        "--page-sizes",
        default="32,128",
        help="cpu_decode page sizes to run, comma-separated, of its page_size choices "
        f"({', '.join(map(str, PAGE_SIZES))}; default 32,128)",
    )
    ap.add_argument(
        "--prefetch",
        default=str(CpuDecodeBackend.default_config()["prefetch"]),
        help="cpu_decode prefetch distances in tiles to run (default: its default, 2)",
    )
    ap.add_argument("--no-probe", action="store_true", help="leave out the matmul_probe row")
    ap.add_argument(
        "--fp8",
        action="store_true",
        help="add cpu_decode_fp8 at each page size and vllm_cpu_fp8 where installed (lossy: checked "
        "against the stored K/V; GB/s and the share count the fp8 bytes and scales they read)",
    )
    ap.add_argument(
        "--quick", action="store_true", help="smoke run: 1k context, batch 1, 2 layers, 3 repeats"
    )
    ap.add_argument("--out", default="results/cpu/kernels/cpu-kernel-bandwidth")
    args = ap.parse_args(argv)
    if args.quick:
        args.batch, args.context, args.layers, args.repeats, args.max_seconds = "1", "1k", 2, 3, 5.0
    try:
        batches = parse_int_list(args.batch, field="--batch")
        contexts = [parse_tokens(c, field="--context") for c in args.context.split(",")]
    except ValueError as exc:
        ap.error(str(exc))
    page_sizes = _choices(ap, "--page-sizes", args.page_sizes, "page_size")
    prefetches = _choices(ap, "--prefetch", args.prefetch, "prefetch")
    torch.set_num_threads(args.threads)

    started = time.perf_counter()
    load_start = os.getloadavg()
    rows: list[dict[str, Any]] = []
    read_points: list[float] = []
    base = _profile(load_start)  # the copy bandwidth, once; the read bandwidth again around each kernel
    meter = ReadMeter("cpu", base.buffer_bytes)
    if not meter.available:
        sys.exit(f"the bandwidth buffer ({base.buffer_bytes >> 20} MiB) would fit the last-level cache")
    for batch in batches:
        for context in contexts:
            workload = Workload.uniform(args.model, batch=batch, context=context, dtype=args.dtype)
            for label, backend, config in _kernels(
                page_sizes, prefetches, probe=not args.no_probe, fp8=args.fp8
            ):
                # the read bandwidth right before; bench's plausibility check uses it too
                profile = replace(base, read_bandwidth=meter(), load_avg=os.getloadavg())
                read_points.append(profile.read_bandwidth / 1e9)
                try:
                    m = measure_decode(
                        backend,
                        workload,
                        config=config,
                        profile=profile,
                        repeats=args.repeats,
                        max_seconds=args.max_seconds,
                        num_layers=args.layers,
                    )
                except Exception as exc:  # unavailable, failed gate, implausible: recorded, the run goes on
                    rows.append(
                        {"kernel": label, "batch": batch, "context": context, "error": str(exc)[:200]}
                    )
                    print(f"b={batch} ctx={context} {label}: {exc}", file=sys.stderr)
                    continue
                read_after = meter()
                read_points.append(read_after / 1e9)
                rows.append(_row(label, m, profile.read_bandwidth, read_after))
                r = rows[-1]
                print(
                    f"b={batch} ctx={context} {label}: {r['ms_per_layer']:.3f} ms/layer, "
                    f"{r['gbps']:.1f} GB/s, {100 * r['share_of_read']:.0f} % of read"
                )
    fp = fingerprint("cpu")
    record = {
        "command": "python scripts/cpu_kernel_bandwidth.py "
        + shlex.join(sys.argv[1:] if argv is None else argv),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.platform(),
        "cpu": fp.get("name", "unknown"),
        "threads": args.threads,
        "llc_mib": last_level_cache_bytes("cpu") / 2**20,
        "read_gbps_samples": read_points,
        "load_start": [round(x, 2) for x in load_start],
        "load_end": [round(x, 2) for x in os.getloadavg()],
        "wall_s": time.perf_counter() - started,
        "quick": args.quick,
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    out.with_suffix(".md").write_text(_markdown(record))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
