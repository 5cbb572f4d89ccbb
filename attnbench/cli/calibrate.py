"""``attnbench calibrate`` — fit per-backend step-time models from tuned tables and bench runs.

Fit, per backend and dtype (and per attention geometry with enough points), the step-time model t =
layers · (t0 + t_seq · batch) + kv_bytes / bw_eff (with a knee where it fits better; see
:mod:`attnbench.cost.fit`) to the decode steps this device's tuned table and
the given bench JSON files measured (≥ 5 points spanning ≥ 16× in batch × context per fit), and
write calibration-<device>.yaml beside the tuned table. `attnbench estimate --gpu this` and select()
beyond the tuned region then use it; docs/latency-model.md explains the model.

example: attnbench calibrate --bench results/cpu/bench/bench-cpu-llama-3.1-8b-bf16-quiet.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from rich.markup import escape
from rich.table import Table

from attnbench.cli.common import (
    add_command,
    add_device_option,
    add_wide_option,
    cli_table,
    console,
    emit_json,
    print_table,
)
from attnbench.core.device import load_profile
from attnbench.core.locations import check_table_file, readable_results, writable_results
from attnbench.core.registry import load_registry
from attnbench.cost.fit import (
    Calibration,
    calibration_path,
    device_entry,
    points_from_bench,
    points_from_table,
)
from attnbench.cost.gpuspec import device_memory_bytes, measured_flops
from attnbench.tables.table import hardware_id, table_path

if TYPE_CHECKING:  # imported when the command runs (numpy)
    from attnbench.cost.fit import Calibration


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
    add_wide_option(p, adds="the points of each fit, their span in batch × context, the largest error")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:

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
    print_table(con, calibration_table(cal, device=profile.name, wide=args.wide))
    con.print(f"written to {out}", markup=False)
    for s in cal.skipped:
        con.print(f"not fitted: {s}", markup=False)
    return 0


def calibration_table(cal: Calibration, *, device: str, wide: bool = False) -> Table:
    """The fits of ``cal`` as a table that fits 80 columns: backend, dtype, geometry (in words), the
    fitted t0, t_seq and bw_eff, and the rms error of the fit over its measured points; ``wide`` adds
    the knee (where one was fitted, :mod:`attnbench.cost.fit`: one sequence's K/V of a layer in MiB, and
    the cost it adds per byte for each doubling past it), the number of points, their span in
    batch × context and the largest error."""
    title = escape(
        f"step-time models fitted to {device}'s measured decode steps: t = layers · (t0 + t_seq · batch) "
        "+ kv_bytes / bw_eff (+ a knee past the caches where one was fitted: --wide)"
    )
    columns = ["backend", "dtype", "geometry", "t0 µs/layer", "t_seq µs/seq/layer", "bw_eff GB/s"]
    columns += ["knee MiB", "ps/B per 2×", "points", "span", "rms error", "max error"] if wide else ["rms error"]  # fmt: skip
    table = cli_table(title, columns, right=columns[3:])
    for f in cal.fits:
        geometry = f.geometry if wide else _geometry_words(f.geometry)
        cells = [f.backend, f.dtype, geometry or "all", _num(1e6 * f.t0_s), _num(1e6 * f.t_seq_s)]
        cells.append(_num(f.bw_eff / 1e9))
        if wide:
            knee = (
                [_num(f.knee_bytes / 2**20), _num(1e12 * f.s_knee_per_byte)] if f.knee_bytes else ["-", "-"]
            )
            cells += [*knee, str(f.points), f"{f.span:.0f}×"]
        cells.append(f"{100 * f.rms_rel_error:.1f}%")
        if wide:
            cells.append(f"{100 * f.max_rel_error:.1f}%")
        table.add_row(*(escape(c) for c in cells))
    return table


def _geometry_words(key: str | None) -> str | None:
    """``expanded:q32/kv8/d128+128`` as ``expanded q32/kv8 d128+128``: words a column can wrap."""
    return key.replace(":", " ").replace("/d", " d") if key else None


def _num(x: float) -> str:
    """Three significant digits, whole numbers from 1000 up (never an exponent)."""
    return f"{x:.3g}" if not math.isfinite(x) or abs(x) < 1000 else f"{x:.0f}"
