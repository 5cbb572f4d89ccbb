"""``select()`` beyond the measured map: the calibrated step-time models choose where nothing was tuned.

Inside the tuned region of a model and dtype (its batch and context within the tuned ones) the
measured map wins; outside it, :func:`calibrated_choice` predicts each runnable backend's step with
this device's calibration (:mod:`attnbench.calibration`) and takes the fastest, saying so.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from attnbench.backend import Resolution
from attnbench.calibration import Calibration, Fit
from attnbench.choice import Choice, Rejected
from attnbench.costmodel import kv_bytes_per_step
from attnbench.select_heuristic import runnable_reason
from attnbench.select_tuned import TunedIndex
from attnbench.tuning.table import ResultsTable
from attnbench.workload import Workload

__all__ = ["beyond_tuned", "calibrated_choice"]


def beyond_tuned(table: ResultsTable | None, workload: Workload) -> str:
    """Why ``workload`` lies outside the region tuned for its model and dtype in ``table`` ('' inside).

    Inside means: batch and context buckets both within the range of the tuned buckets.
    """
    return TunedIndex.build(table, {}).beyond(workload, workload.shape.fingerprint())


def calibrated_choice(
    workload: Workload,
    resolutions: Iterable[tuple[str, Resolution, dict, str]],
    *,
    calibration: Calibration | None,
    failed_gate: Mapping[str, str],
    why_outside: str,
    skip: Iterable[str] = (),
) -> Choice | None:
    """A :class:`~attnbench.choice.Choice` from the calibrated step-time models: the runnable
    backend with the lowest predicted step. ``resolutions`` holds ``(name, resolution, default
    config, geometry key)`` per registered backend; one without a fit, one that failed the gate, or
    one in ``skip`` is not a candidate. ``None`` when no candidate has a fit."""
    if calibration is None:
        return None
    scored: list[tuple[float, str, Fit, dict]] = []
    rejected: list[Rejected] = []
    skip = set(skip)
    layers = workload.shape.num_layers
    tokens = workload.total_tokens + workload.batch
    for name, res, config, geometry in resolutions:
        if name in skip:
            continue
        why_not = runnable_reason(res) or failed_gate.get(name, "")
        if why_not:
            rejected.append(Rejected(name, why_not))
            continue
        fit = calibration.lookup(name, workload.dtype_name, geometry)
        if fit is None:
            rejected.append(Rejected(name, f"no calibrated model for {workload.dtype_name} on this device"))
            continue
        kv_bytes = kv_bytes_per_step(res.kv_bytes_per_token, tokens=tokens)
        scored.append(
            (fit.predict_s(batch=workload.batch, kv_bytes=kv_bytes, layers=layers), name, fit, config)
        )
    if not scored:
        return None
    scored.sort(key=lambda x: x[0])
    best_s, name, fit, config = scored[0]
    rejected += [
        Rejected(
            n, f"calibrated model predicts {1e3 * s:.4g} ms ({s / best_s:.2f}× the chosen)", step_ms=1e3 * s
        )
        for s, n, _, _ in scored[1:]
    ]
    where = calibration.path.name if calibration.path else "calibration"
    reason = (
        f"outside the tuned region ({why_outside}): the calibrated step-time model ({where}) predicts "
        f"{1e3 * best_s:.4g} ms for {name}, the lowest; {fit.describe()}"
    )
    return Choice(
        name, dict(config), "calibrated", workload, reason, rejected=rejected, estimate_ms=1e3 * best_s
    )
