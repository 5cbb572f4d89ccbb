"""The attention term of an estimate from this device's measurements, not the datasheet roofline.

A calibrated device (``attnbench calibrate``) carries per-backend fits of measured decode-step times;
the estimator's KV term becomes the fit of one backend — the one a :data:`Chooser` names (the CLI
passes ``select()``'s choice), else the fitted backend predicted fastest — with that backend's own
KV bytes per token.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnbench.core.registry import load_registry
from attnbench.core.traffic import backend_kv_bytes_per_token
from attnbench.core.workload import Workload
from attnbench.cost.fit import geometry_key
from attnbench.cost.gpuspec import HIGH as _HIGH
from attnbench.cost.gpuspec import GPUSpec

if TYPE_CHECKING:
    from attnbench.core.registry import Registry
    from attnbench.core.shapes import ModelShape
    from attnbench.core.workload import Workload
    from attnbench.cost.fit import Calibration

__all__ = ["CalibratedAttention", "Chooser", "calibrated_attention"]

#: Names the backend whose fit the calibrated attention term uses: ``(workload, results_dir) →
#: (backend, why)``.
Chooser = Callable[["Workload", "Path | None"], tuple[str, str]]


@dataclass(frozen=True)
class CalibratedAttention:
    """The attention part of a step from the device's calibration: the chosen backend,
    its own KV bytes per token, the fit used, and the time at the first step's context."""

    backend: str
    kv_bytes_per_token: int  # per GPU, over all layers, as the backend's cache stores it
    fit: str  # the fit's description (terms and fit error)
    selected: str  # why this backend (select()'s explanation, first line)
    step_s: float  # at `context`

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _fastest_fit(workload: Workload, cal: Calibration, registry: Registry) -> tuple[str, str]:
    """The fitted backend predicted fastest at ``workload`` (the default chooser)."""

    best: tuple[float, str] | None = None
    for name in sorted({f.backend for f in cal.fits if f.dtype == workload.dtype_name}):
        if name not in registry:
            continue
        backend = registry.get(name)
        fit = cal.lookup(name, workload.dtype_name, geometry_key(backend, workload))
        if fit is None:
            continue
        kv = workload.batch * backend_kv_bytes_per_token(backend, workload)
        t = fit.predict_s(batch=workload.batch, kv_bytes=kv, layers=workload.shape.num_layers)
        best = min(best or (t, name), (t, name))
    if best is None:
        raise LookupError(f"no fit for {workload.dtype_name} at this geometry")
    return best[1], f"the fitted backend predicted fastest ({best[0] * 1e3:.3f} ms a step)"


def calibrated_attention(
    shape: ModelShape,
    spec: GPUSpec,
    *,
    batch: int,
    context: int,
    tp: int,
    kv_dtype: str,
    choose: Chooser | None,
) -> tuple[CalibratedAttention | None, Any, float]:
    """The calibrated KV term of an estimate: (attention, seconds at context 0, seconds per context
    token), or (None, why not, 0) when the calibration has no fit for the chosen backend."""

    cal = spec.calibration
    assert cal is not None
    registry = load_registry()
    workload = Workload.uniform(shape, batch=batch, context=context, dtype=_HIGH)
    try:
        results_dir = cal.path.parent if cal.path else None
        name, why = choose(workload, results_dir) if choose else _fastest_fit(workload, cal, registry)
    except (LookupError, ValueError) as err:
        return None, f"no backend chosen ({err})", 0.0
    if kv_dtype == "fp8" and "fp8" in registry and name != "fp8":
        name, why = "fp8", "--kv-dtype fp8: the fp8 cache backend"
    backend = registry.get(name)

    fit = cal.lookup(name, workload.dtype_name, geometry_key(backend, workload))
    if fit is None:
        return (
            None,
            f"no fit for {name}/{workload.dtype_name} (fitted: {', '.join(sorted({f.backend + '/' + f.dtype for f in cal.fits})) or 'none'})",
            0.0,
        )
    per_token = backend_kv_bytes_per_token(backend, workload)
    if tp > 1 and not shape.is_mla:  # the backend's bytes per token, split like the heads
        per_token = per_token // shape.num_kv_heads * math.ceil(shape.num_kv_heads / tp)
    at0 = fit.predict_s(batch=batch, kv_bytes=batch * per_token, layers=shape.num_layers)
    # seconds per context token: the secant from one token to `context` (exact without a knee)
    far = max(context, 1) + 1
    per_ctx = (
        fit.predict_s(batch=batch, kv_bytes=batch * per_token * far, layers=shape.num_layers) - at0
    ) / (far - 1)
    att = CalibratedAttention(
        backend=name, kv_bytes_per_token=per_token, fit=fit.describe(), selected=why, step_s=at0
    )
    return att, at0, per_ctx
