"""``select()`` beyond the measured map: the calibrated step-time models choose where nothing was tuned.

Inside the tuned region of a model and dtype (its batch and context within the tuned ones) the
measured map wins; outside it, :func:`calibrated_choice` predicts each runnable backend's step with
this device's calibration (:mod:`attnbench.cost.fit`) and takes the fastest, saying so. The fits
are found once per bucket (:func:`calibrated_ranking`); each call predicts only its own steps.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from attnbench.core.backend import Resolution
from attnbench.core.traffic import kv_bytes_per_step
from attnbench.core.workload import Workload
from attnbench.cost.fit import Calibration, Fit
from attnbench.selection.choice import Choice, Rejected
from attnbench.selection.heuristic import runnable_reason

__all__ = ["CalibratedRanking", "calibrated_choice", "calibrated_ranking"]


@dataclass(frozen=True)
class CalibratedRanking:
    """The calibrated models of one bucket's candidates, found once: each :meth:`choice` then only
    predicts the steps of its own batch and context (the winner may change inside a bucket)."""

    #: (name, fit, default config, KV bytes per token, the fit described) of each candidate with a
    #: fit, in registry order
    fitted: tuple[tuple[str, Fit, dict, int, str], ...]
    #: the backends that cannot run, failed the gate, or have no fit here, with why
    rejected: tuple[Rejected, ...]
    where: str  # the calibration file's name

    def choice(self, workload: Workload, *, why_outside: str) -> Choice | None:
        """The candidate with the lowest predicted step for ``workload`` (``None`` without one)."""
        if not self.fitted:
            return None
        batch, layers = workload.batch, workload.shape.num_layers
        tokens = workload.total_tokens + batch
        scored = sorted(
            (
                (
                    fit.predict_s(
                        batch=batch, kv_bytes=kv_bytes_per_step(per_token, tokens=tokens), layers=layers
                    ),
                    i,
                )
                for i, (_, fit, _, per_token, _) in enumerate(self.fitted)
            )
        )
        best_s, best = scored[0]
        name, _, config, _, described = self.fitted[best]
        reason = (
            f"outside the tuned region ({why_outside}): the calibrated step-time model ({self.where}) "
            f"predicts {1e3 * best_s:.4g} ms for {name}, the lowest; {described}"
        )
        choice = Choice(
            name,
            dict(config),
            "calibrated",
            workload,
            reason,
            rejected=self.rejected,
            estimate_ms=1e3 * best_s,
        )

        def slower() -> list[Rejected]:
            return [
                Rejected(
                    self.fitted[i][0],
                    f"calibrated model predicts {1e3 * s:.4g} ms ({s / best_s:.2f}× the chosen)",
                    step_ms=1e3 * s,
                )
                for s, i in scored[1:]
            ]

        choice.reject_later(slower)
        return choice


def calibrated_ranking(
    workload: Workload,
    resolutions: Iterable[tuple[str, Resolution, dict, str]],
    *,
    calibration: Calibration,
    failed_gate: Mapping[str, str],
    skip: Iterable[str] = (),
) -> CalibratedRanking:
    """The candidates of ``workload``'s bucket for :meth:`CalibratedRanking.choice`: ``resolutions``
    holds ``(name, resolution, default config, geometry key)`` per registered backend; one without a
    fit, one that failed the gate, or one in ``skip`` is not a candidate."""
    fitted: list[tuple[str, Fit, dict, int, str]] = []
    rejected: list[Rejected] = []
    skip = set(skip)
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
        fitted.append((name, fit, config, res.kv_bytes_per_token, fit.describe()))
    where = calibration.path.name if calibration.path else "calibration"
    return CalibratedRanking(tuple(fitted), tuple(rejected), where)


def calibrated_choice(
    workload: Workload,
    resolutions: Iterable[tuple[str, Resolution, dict, str]],
    *,
    calibration: Calibration | None,
    failed_gate: Mapping[str, str],
    why_outside: str,
    skip: Iterable[str] = (),
) -> Choice | None:
    """A :class:`~attnbench.selection.choice.Choice` from the calibrated step-time models: the runnable
    backend with the lowest predicted step. ``resolutions`` holds ``(name, resolution, default
    config, geometry key)`` per registered backend; one without a fit, one that failed the gate, or
    one in ``skip`` is not a candidate. ``None`` when no candidate has a fit. (``select()`` keeps the
    :func:`calibrated_ranking` of a bucket and asks its :meth:`~CalibratedRanking.choice` per call.)"""
    if calibration is None:
        return None
    ranking = calibrated_ranking(
        workload, resolutions, calibration=calibration, failed_gate=failed_gate, skip=skip
    )
    return ranking.choice(workload, why_outside=why_outside)
