"""Which bound applies to MLA decode: the roofline of each measured ``attnbench bench`` row, and of the
full model on the GPU presets.

Reads the JSON that ``attnbench bench --save PREFIX`` wrote, and for every timed row computes
:func:`attnbench.core.traffic.decode_roofline` on this machine (measured copy bandwidth and bf16/fp32 matmul
FLOP/s, see :func:`attnbench.cost.estimate.measured_gpu`) for the layers the bench ran; then the same
workloads over all of the model's layers on each GPU preset (datasheet peaks). Writes
``PREFIX-roofline.json`` and ``PREFIX-roofline.md``::

    python scripts/mla_roofline.py results/cpu/bench/bench-cpu-deepseek-v3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

from attnbench.core.shapes import dtype_name, load_shape, parse_dtype
from attnbench.core.traffic import decode_roofline
from attnbench.core.workload import Workload
from attnbench.cost.estimate import list_gpus, load_gpu, measured_gpu

FORMS = {"naive": "expanded", "flash": "expanded", "mla": "latent"}


def _fmt_s(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.3g} µs"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prefix", help="the --save PREFIX of an attnbench bench run (reads PREFIX.json)")
    parser.add_argument(
        "--model", default="deepseek-v3", help="model preset of the run (default deepseek-v3)"
    )
    parser.add_argument("--gpus", default="a100-80gb,h100-sxm,h200,b200", help="GPU presets, comma-separated")
    args = parser.parse_args(argv)
    data = json.loads(Path(f"{args.prefix}.json").read_text())
    rows = data["results"] if isinstance(data, dict) and "results" in data else data
    shape = load_shape(args.model)
    threads = data.get("device", {}).get("fingerprint", {}).get("threads") if isinstance(data, dict) else None
    if threads:  # the same thread count, hence the same device profile (bandwidth) as the bench run
        torch.set_num_threads(int(threads))
    this = measured_gpu("cpu")
    gpus = [g.strip() for g in args.gpus.split(",") if g.strip()]
    unknown = [g for g in gpus if g not in list_gpus()]
    if unknown:
        raise SystemExit(f"unknown GPU preset(s) {unknown}; presets: {', '.join(list_gpus())}")

    measured = []
    for r in rows:
        if not r.get("timed") or r["backend"] not in FORMS:
            continue
        dtype = parse_dtype(r["dtype"])
        shape_l = dataclasses.replace(shape, num_layers=r["num_layers"])
        w = Workload(shape_l, (r["context"],) * r["batch"], dtype)
        peak, _ = this.peak_flops(dtype_name(dtype))
        roof = decode_roofline(w, bandwidth=this.memory_bandwidth, peak_flops=peak, form=FORMS[r["backend"]])
        measured.append(
            {
                "backend": r["backend"],
                "batch": r["batch"],
                "context": r["context"],
                "dtype": r["dtype"],
                "num_layers": r["num_layers"],
                "measured_s": r["step"]["median_s"],
                "roofline": roof.as_dict(),
                "measured_over_floor": r["step"]["median_s"] / roof.floor_s,
            }
        )
    full = []
    for r in measured:
        if r["backend"] not in ("naive", "mla"):
            continue
        w = Workload(shape, (r["context"],) * r["batch"], parse_dtype(r["dtype"]))
        for g in gpus:
            spec = load_gpu(g)
            peak, _ = spec.peak_flops(r["dtype"])
            roof = decode_roofline(
                w, bandwidth=spec.memory_bandwidth, peak_flops=peak, form=FORMS[r["backend"]]
            )
            full.append(
                {"gpu": g, "backend": r["backend"], "batch": r["batch"], "context": r["context"]}
                | roof.as_dict()
            )

    out = {
        "command": "python scripts/mla_roofline.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "source": f"{args.prefix}.json",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "this_machine": {"label": this.label, "bandwidth": this.memory_bandwidth, "flops": this.flops},
        "load_avg": list(os.getloadavg()),
        "measured": measured,
        "full_model_on_gpus": full,
    }
    Path(f"{args.prefix}-roofline.json").write_text(json.dumps(out, indent=2) + "\n")

    lines = [
        f"# Roofline of `{args.prefix}.json` ({args.model})",
        "",
        f"Command: `{out['command']}` — {out['date']}; load average {', '.join(f'{x:.1f}' for x in out['load_avg'])}.",
        f"This machine: {this.label}; copy bandwidth {this.memory_bandwidth / 1e9:.2f} GB/s, "
        + ", ".join(f"{k} matmul {v / 1e9:.1f} GFLOP/s" for k, v in this.flops.items())
        + " (measured; the machine is shared and noisy).",
        "",
        "## Measured rows against this machine's roofline (the layers the bench ran)",
        "",
        "| backend | batch | context | FLOP/B | ridge | bound | floor | measured | measured / floor |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in measured:
        f = r["roofline"]
        lines.append(
            f"| {r['backend']} | {r['batch']} | {r['context']} | {f['intensity']:.1f} | {f['ridge']:.1f} | "
            f"{f['bound']} | {_fmt_s(f['floor_s'])} | {_fmt_s(r['measured_s'])} | {r['measured_over_floor']:.1f}× |"
        )
    lines += [
        "",
        f"## All {shape.num_layers} layers on GPU presets (datasheet peaks, dense {rows[0]['dtype'] if rows else ''})",
        "",
        "| GPU | backend | batch | context | FLOP/B | ridge | bound | floor |",
        "|---|---|---:|---:|---:|---:|---|---:|",
    ]
    for r in full:
        lines.append(
            f"| {r['gpu']} | {r['backend']} | {r['batch']} | {r['context']} | {r['intensity']:.1f} | "
            f"{r['ridge']:.1f} | {r['bound']} | {_fmt_s(r['floor_s'])} |"
        )
    Path(f"{args.prefix}-roofline.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
