"""``attnbench calibrate`` — fit per-backend step-time models from tuned tables and bench runs.

Fit, per backend and dtype (and per attention geometry with enough points), the step-time model t =
layers · (t0 + t_seq · batch) + kv_bytes / bw_eff to the decode steps this device's tuned table and
the given bench JSON files measured (≥ 5 points spanning ≥ 16× in batch × context per fit), and
write calibration-<device>.yaml beside the tuned table. `attnbench estimate --gpu this` and select()
beyond the tuned region then use it; docs/latency-model.md explains the model.

example: attnbench calibrate --bench results/bench-cpu-llama-3.1-8b-1k-8k.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.table import Table

from attnbench.cli.common import add_command, add_device_option, console, emit_json


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "calibrate", __doc__)
    p.add_argument(
        "--results",
        "--results-dir",
        dest="results_dir",
        default=None,
        metavar="DIR",
        help="the results location: where the tuned tables live and the calibration goes (default "
        "$ATTNBENCH_RESULTS_DIR, else the per-user $XDG_DATA_HOME/attnbench, i.e. ~/.local/share/attnbench)",
    )
    p.add_argument(
        "--update-reference",
        action="store_true",
        help="allow writing into a folder of committed reference runs (one holding REFERENCE.md)",
    )
    p.add_argument("--table", default=None, help="a tuned table (default: this device's, if any)")
    p.add_argument(
        "--bench",
        action="append",
        default=[],
        metavar="JSON",
        help="an `attnbench bench --save` JSON (repeatable)",
    )
    p.add_argument(
        "--out", default=None, help="output file (default: calibration-<device>.yaml beside the table)"
    )
    add_device_option(p, what="device whose profile the calibration is for")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from attnbench.calibration import (
        Calibration,
        calibration_path,
        device_entry,
        points_from_bench,
        points_from_table,
    )
    from attnbench.device import load_profile
    from attnbench.gpuspec import device_memory_bytes, measured_flops
    from attnbench.locations import check_table_file, readable_results, writable_results
    from attnbench.registry import load_registry
    from attnbench.tuning.table import hardware_id, table_path

    profile = load_profile(args.device)
    dev = torch.device(args.device)
    results = readable_results(args.results_dir).path
    registry = load_registry()
    table = check_table_file(args.table) if args.table else table_path(results, profile.fingerprint)
    points = points_from_table(table, registry) if table.exists() else []
    for path in args.bench:
        if not Path(path).exists():
            raise ValueError(f"--bench {path!r}: no such file")
        data_device = (json.loads(Path(path).read_text()).get("device") or {}).get("fingerprint")
        if data_device and hardware_id(data_device) != hardware_id(profile.fingerprint):
            raise ValueError(
                f"--bench {path!r} was measured on {data_device.get('name')!r}, not on this device "
                f"({profile.name!r}): a calibration is per device"
            )
        points += points_from_bench(path, registry)
    if not points:
        raise ValueError(
            f"no measured steps to fit: {table} has none and no --bench JSON was given "
            "(run `attnbench tune` or `attnbench bench --save PREFIX` first)"
        )
    device = device_entry(
        profile,
        flops=measured_flops(dev, profile_id=profile.id),
        memory_bytes=device_memory_bytes(dev),
    )
    command = "attnbench calibrate" + "".join(f" --bench {b}" for b in args.bench)
    cal = Calibration.fit(points, device=device, command=command)
    if args.out:
        out = Path(args.out)
    else:
        folder = writable_results(args.results_dir, update_reference=args.update_reference).path
        out = calibration_path(folder, profile.fingerprint)
    cal.save(out)
    if args.json:
        emit_json(cal.as_dict() | {"path": str(out)})
        return 0
    con = console()
    t = Table(title=f"calibration of {profile.name} → {out}  (model: {cal.as_dict()['model']})")
    for col in (
        "backend",
        "dtype",
        "geometry",
        "t0 µs/layer",
        "t_seq µs/seq/layer",
        "bw_eff GB/s",
        "points",
        "span",
        "fit error rms / max",
    ):
        t.add_column(col, justify="left" if col in ("backend", "dtype", "geometry") else "right")
    for f in cal.fits:
        t.add_row(
            f.backend,
            f.dtype,
            f.geometry or "all",
            f"{1e6 * f.t0_s:.3g}",
            f"{1e6 * f.t_seq_s:.3g}",
            f"{f.bw_eff / 1e9:.3g}",
            str(f.points),
            f"{f.span:.0f}×",
            f"{100 * f.rms_rel_error:.1f}% / {100 * f.max_rel_error:.1f}%",
        )
    con.print(t)
    for s in cal.skipped:
        con.print(f"not fitted: {s}")
    return 0
