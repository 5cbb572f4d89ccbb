"""``select()`` beyond the measured map: the calibrated step-time models choose where nothing was tuned.

Inside the tuned region of a model and dtype (its batch and context buckets within the tuned ones) the
measured map wins; outside it, :func:`calibrated_choice` predicts each runnable backend's step with
this device's calibration (:mod:`attnbench.calibration`) and takes the fastest, saying so.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from attnbench.calibration import Calibration, Fit
    from attnbench.registry import Registry
    from attnbench.workload import Workload

__all__ = ["beyond_tuned", "calibrated_choice"]


def beyond_tuned(table: Any, workload: Workload) -> str:
    """Why ``workload`` lies outside the region tuned for its model and dtype in ``table`` ('' inside).

    Inside means: batch and context buckets both within the range of the tuned buckets.
    """
    from attnbench.tuning.key import TuningKey
    from attnbench.workload import bucket

    keys = [
        TuningKey.from_row(row, device="")
        for row, e in (table.entries.items() if table is not None else [])
        if e.get("model") == workload.shape.name and e.get("dtype") == workload.dtype_name and e.get("winner")
    ]
    if not keys:
        return f"no tuned entry for {workload.shape.name} {workload.dtype_name}"
    b, c = bucket(workload.batch), bucket(workload.context)
    bs, cs = [k.batch_bucket for k in keys], [k.context_bucket for k in keys]
    out = []
    if not min(bs) <= b <= max(bs):
        out.append(f"batch bucket {b} outside the tuned {min(bs)}..{max(bs)}")
    if not min(cs) <= c <= max(cs):
        out.append(f"context bucket {c} outside the tuned {min(cs)}..{max(cs)}")
    return "; ".join(out)


def calibrated_choice(
    workload: Workload,
    registry: Registry,
    *,
    calibration: Calibration | None,
    failed_gate: Mapping[str, str],
    why_outside: str,
    skip: Iterable[str] = (),
) -> Any:
    """A :class:`~attnbench.select.Choice` from the calibrated step-time models: the runnable backend
    with the lowest predicted step (a backend without a fit, one that failed the gate, or one in
    ``skip`` is not a candidate); ``None`` when no candidate has a fit."""
    from attnbench.select import Choice, Rejected, _runnable

    if calibration is None:
        return None
    scored: list[tuple[float, str, Fit]] = []
    rejected: list[Rejected] = []
    skip = set(skip)
    for entry in registry:
        why_not = _runnable(registry, entry.name, workload) or failed_gate.get(entry.name, "")
        if entry.name in skip:
            continue
        if why_not:
            rejected.append(Rejected(entry.name, why_not))
            continue
        predicted = calibration.predict(registry.get(entry.name), workload)
        if predicted is None:
            rejected.append(
                Rejected(entry.name, f"no calibrated model for {workload.dtype_name} on this device")
            )
            continue
        scored.append((predicted[0], entry.name, predicted[1]))
    if not scored:
        return None
    scored.sort(key=lambda x: x[0])
    best_s, name, fit = scored[0]
    rejected += [
        Rejected(
            n, f"calibrated model predicts {1e3 * s:.4g} ms ({s / best_s:.2f}× the chosen)", step_ms=1e3 * s
        )
        for s, n, _ in scored[1:]
    ]
    where = calibration.path.name if calibration.path else "calibration"
    reason = (
        f"outside the tuned region ({why_outside}): the calibrated step-time model ({where}) predicts "
        f"{1e3 * best_s:.4g} ms for {name}, the lowest; {fit.describe()}"
    )
    config = registry.entry(name).cls.default_config()
    return Choice(name, config, "calibrated", workload, reason, rejected=rejected, estimate_ms=1e3 * best_s)
