"""Stopping a study's clearly slower candidates early: Optuna's successive halving over a trial's timed
steps, with a margin (see :class:`ClearlySlower`). The worker reports each timed step's running median
(:class:`attnbench.tuning.worker.WorkerTask` ``report``); the study asks the pruner after each."""

from __future__ import annotations

import optuna
from optuna.trial import FrozenTrial, TrialState

__all__ = ["PRUNE_MARGIN", "ClearlySlower", "study_pruner"]


#: a trial is pruned only where its running median is this much above the best one at that step
PRUNE_MARGIN = 0.10


class ClearlySlower(optuna.pruners.BasePruner):
    """Optuna's ``SuccessiveHalvingPruner`` over a trial's timed steps, pruning only the clearly slower.

    Each timed step reports the running median of the steps so far (a median: a candidate slow for
    its first step or two, then fast, is judged by its steady speed). At the third step, and at the
    ninth, successive halving keeps the best third of the study's trials there; of the others, only
    one whose running median is more than ``margin`` above the best trial's at that step stops
    (``pruned``: gated, its steps checked, never a finalist). Near-ties run in full: they are what the
    finalists' interleaved re-timing decides between.
    """

    def __init__(
        self, *, margin: float = PRUNE_MARGIN, min_resource: int = 3, reduction_factor: int = 3
    ) -> None:
        self.margin = margin
        self.halving = optuna.pruners.SuccessiveHalvingPruner(
            min_resource=min_resource, reduction_factor=reduction_factor
        )

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        step = trial.last_step
        if step is None or not self.halving.prune(study, trial):
            return False
        others = [
            t.intermediate_values[step]
            for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
            if step in t.intermediate_values
        ]
        return bool(others) and trial.intermediate_values[step] > (1 + self.margin) * min(others)


def study_pruner() -> optuna.pruners.BasePruner:
    """The studies' pruner (:class:`ClearlySlower`). A study's timed steps only pick the finalists, which
    are re-timed interleaved; a clearly slower candidate saves its last steps and its timed step's check."""
    return ClearlySlower()
