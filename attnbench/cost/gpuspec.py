"""GPU (device) specifications for the estimator: datasheet presets, the measured current device, or a
calibrated device file written by ``attnbench calibrate``.

A :class:`GPUSpec` holds peak memory bandwidth and dense FLOP/s by dtype, the achievable fraction of
both, and the per-step fixed cost (kernel launches, the engine's host work) that
:func:`attnbench.core.traffic.step_fixed_s` turns into time. Presets live in ``gpus.yaml`` (datasheet
figures, with their sources); ``"this"`` measures the current device; a path to a calibration file
loads the device it was measured on, with its fitted per-backend step-time models.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import yaml

from attnbench.core.device import cache_dir, load_profile
from attnbench.core.timing import measure
from attnbench.cost.fit import Calibration, find_calibration

__all__ = ["GPUSpec", "calibrated_gpu", "list_gpus", "load_gpu", "matmul_peak", "measured_gpu"]

#: The dtype of the embedding and LM head, and of attention arithmetic.
HIGH = "bf16"


@dataclass(frozen=True)
class GPUSpec:
    """One GPU: peak memory bandwidth and dense FLOP/s by dtype, the achievable fraction of both, and
    the fixed cost of a decode step (``launch_s`` per kernel, ``step_overhead_s`` per step)."""

    name: str
    label: str
    memory_bandwidth: float  # bytes/s
    memory_bytes: float  # bytes of device memory
    flops: dict[str, float]  # dense FLOP/s by dtype
    achievable: float
    source: str
    measured: bool = False
    launch_s: float = 0.0  # per kernel launch (or graph-node gap)
    step_overhead_s: float = 0.0  # per step: the serving engine's host work
    fixed_cost_source: str = ""
    calibration: Calibration | None = None

    def __post_init__(self) -> None:
        for f in ("memory_bandwidth", "memory_bytes"):
            value = getattr(self, f)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"GPU {self.name!r}: field '{f}' = {value!r} must be a number > 0")
        for f in ("launch_s", "step_overhead_s"):
            value = getattr(self, f)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
                raise ValueError(f"GPU {self.name!r}: field '{f}' = {value!r} must be a number ≥ 0")
        if HIGH not in self.flops:
            raise ValueError(
                f"GPU {self.name!r}: field 'flops' needs a '{HIGH}' entry; got {sorted(self.flops)}"
            )
        for dt, value in self.flops.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"GPU {self.name!r}: flops[{dt!r}] = {value!r} must be a number > 0")
        check_fraction(self.achievable, field="achievable")

    def peak_flops(self, dtype: str) -> tuple[float, str]:
        """Dense FLOP/s for matmuls in ``dtype`` and the dtype actually used (bf16 if unsupported)."""
        if dtype in self.flops:
            return self.flops[dtype], dtype
        return self.flops[HIGH], HIGH

    def with_achievable(self, achievable: float | None) -> GPUSpec:
        return self if achievable is None else replace(self, achievable=check_fraction(achievable))


def check_fraction(value: Any, *, field: str = "--achievable") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"{field} = {value!r} must be a fraction in (0, 1]")
    return float(value)


def _gpu_table() -> dict[str, Any]:
    return yaml.safe_load(resources.files("attnbench.cost").joinpath("gpus.yaml").read_text())


def list_gpus() -> list[str]:
    """Preset names accepted by :func:`load_gpu` (plus ``"this"`` and a calibration file's path)."""
    return list(_gpu_table())


def load_gpu(name: str | Path | GPUSpec, *, achievable: float | None = None) -> GPUSpec:
    """A preset by name or alias (``"h100"``), ``"this"`` for the measured current device (with its
    calibration when one was written), or the path of a calibration file (``calibration-*.yaml``)."""
    if isinstance(name, GPUSpec):
        return name.with_achievable(achievable)
    key = str(name).strip().lower()
    if key == "this":
        return measured_gpu().with_achievable(achievable)
    table = _gpu_table()
    for preset, data in table.items():
        if key == preset or key in (data.get("aliases") or []):
            fields = {k: v for k, v in data.items() if k != "aliases"}
            return GPUSpec(name=preset, **fields).with_achievable(achievable)
    path = Path(str(name))
    if path.suffix in (".yaml", ".yml") or path.exists():
        return calibrated_gpu(Calibration.load(path)).with_achievable(achievable)
    raise LookupError(
        f"unknown GPU {name!r}; presets: {', '.join(table)}, this (the measured current device), "
        "or the path of a calibration file"
    )


def calibrated_gpu(cal: Calibration) -> GPUSpec:
    """A calibration file's device as a :class:`GPUSpec` (measured and calibrated: achievable 1)."""
    d = cal.device
    where = cal.path.name if cal.path else "calibration"
    return GPUSpec(
        name=f"calibrated:{where}",
        label=f"{d.get('name', 'device')} (calibrated, {where})",
        memory_bandwidth=float(d["bandwidth"]),
        memory_bytes=float(d["memory_bytes"]),
        flops={str(k): float(v) for k, v in d["flops"].items()},
        achievable=1.0,
        source=f"measured and calibrated: {where}, written {cal.written_at}",
        measured=True,
        calibration=cal,
    )


def matmul_peak(device: torch.device, dtype: torch.dtype) -> float:
    """Dense FLOP/s of square matmuls, the FLOP roofline of ``--gpu this`` and the ceiling
    ``bench`` holds a step's FLOP/s to.

    A ceiling, so the best of what was seen: each size's 10th-percentile time, the fastest size. A
    shared CPU's median can sit far under what the same matmul reaches moments later (1024² bf16 on a
    2-vCPU AMX VM: 300 to 900 GFLOP/s between runs), and a kernel measured above such a median was
    refused as implausible although it was right.
    """

    sizes = (4096,) if device.type == "cuda" else (1024, 2048)
    best = 0.0
    for n in sizes:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        # the default arguments bind this iteration's a and b; mypy cannot type a lambda that has them
        t = measure(lambda i, a=a, b=b: torch.mm(a, b), device=device, warmup=2, repeats=7)  # type: ignore[misc]  # see above
        best = max(best, 2 * n**3 / t.p10_s)
    return best


def measured_flops(device: torch.device, *, profile_id: str, remeasure: bool = False) -> dict[str, float]:
    """bf16 and fp32 matmul FLOP/s of ``device`` (:func:`matmul_peak`), measured once per
    fingerprint and cached."""

    path = cache_dir() / "device" / f"{profile_id}-matmul-peak.json"  # best of sizes (was: one median)
    flops: dict[str, float] = {}
    if path.exists() and not remeasure:
        try:
            flops = {str(k): float(v) for k, v in json.loads(path.read_text()).items()}
        except (ValueError, AttributeError):
            flops = {}
    if HIGH not in flops:
        flops = {
            "bf16": matmul_peak(device, torch.bfloat16),
            "fp32": matmul_peak(device, torch.float32),
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as tmp:
            json.dump(flops, tmp)
        os.replace(tmp.name, path)
    return flops


def device_memory_bytes(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def measured_gpu(
    device: str | torch.device | None = None,
    *,
    remeasure: bool = False,
    results_dir: str | Path | None = None,
) -> GPUSpec:
    """The current device as a :class:`GPUSpec`: measured, so ``achievable`` is 1.

    Bandwidth: :func:`attnbench.core.device.load_profile`'s measured copy bandwidth. FLOP/s: a square
    bf16 matmul (and fp32, recorded) timed once per device fingerprint and cached next to the
    profile. There is no fp8 matmul to time on CPU: fp8 weights then use the bf16 figure. The
    device's calibration file in ``results_dir`` (default: the tuned tables' directory), when one was
    written by ``attnbench calibrate``, is attached.
    """

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    profile = load_profile(dev, remeasure=remeasure)
    return GPUSpec(
        name="this",
        label=f"{profile.name} (measured, profile {profile.id})",
        memory_bandwidth=profile.bandwidth,
        memory_bytes=device_memory_bytes(dev),
        flops=measured_flops(dev, profile_id=profile.id, remeasure=remeasure),
        achievable=1.0,
        source=f"measured: copy bandwidth at {profile.measured_at}, bf16 matmul once per fingerprint",
        measured=True,
        calibration=find_calibration(profile.fingerprint, results_dir=results_dir),
    )
