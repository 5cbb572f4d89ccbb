"""Optuna's pruner over a study's timed steps: a clearly slower candidate stops after its third timed
step (gated first, unchecked, never a finalist); a near-tie runs in full; a pruned candidate is a
verdict that a resumed run keeps; ``prune=False`` times everything in full."""

from __future__ import annotations

import time
from typing import Any

import optuna
import pytest
from helpers.tuning_helpers import planted_registry
from optuna.trial import TrialState

from attnbench.backends.naive import NaiveBackend
from attnbench.core.workload import Workload
from attnbench.tuning import TuneOptions, tune
from attnbench.tuning.pruning import PRUNE_MARGIN, ClearlySlower

pytestmark = pytest.mark.usefixtures("one_thread")

WORKLOAD = Workload.uniform("tiny-gqa", batch=1, context=64, dtype="fp32")
OPTIONS = TuneOptions(timeout_s=60.0, warmup=1, repeats=8)


class Quick(NaiveBackend):
    """5 ms a layer call (registered first: the default)."""

    name = "prune_quick"
    delay_s = 0.005

    def decode(self, cache: Any, plan: Any, *, layer: int, q: Any, k: Any, v: Any) -> Any:
        time.sleep(self.delay_s)
        return super().decode(cache, plan, layer=layer, q=q, k=k, v=v)


class Slow(Quick):
    """Four times as slow: clearly slower."""

    name = "prune_slow"
    delay_s = 0.020


class NearTie(Quick):
    """3 % slower: within the pruner's margin, so timed in full."""

    name = "prune_near_tie"
    delay_s = 0.00515


def _tune(tmp_path, profile, options=OPTIONS):  # type: ignore[no-untyped-def]
    report = tune(
        [WORKLOAD],
        registry=planted_registry(Quick, Slow, NearTie),
        results_dir=tmp_path,
        options=options,
        profile=profile,
        samples=5,
    )
    (entry,) = report.entries.values()
    return report, entry, {c["backend"]: c for c in entry["candidates"]}


def test_a_clearly_slower_candidate_is_pruned_after_its_third_step(tmp_path, profile) -> None:  # type: ignore[no-untyped-def]
    _, entry, by = _tune(tmp_path, profile)
    assert entry["complete"] and entry["trials"] == 3
    assert by["prune_slow"]["failed"] == "pruned" and "after 3 timed steps" in by["prune_slow"]["reason"]
    assert by["prune_slow"]["gate"]  # gated before it was timed, as every candidate
    assert by["prune_slow"]["study_ms"] > 2 * by["prune_quick"]["study_ms"]  # its running median when stopped
    assert by["prune_near_tie"].get("step_ms") and by["prune_quick"].get("step_ms")  # near-ties run in full
    assert entry["winner"]["backend"] in ("prune_quick", "prune_near_tie")
    again, entry2, _ = _tune(tmp_path, profile)  # resumed: the pruned trial is a verdict, not re-run
    assert again.evaluations["trials"] == 0 and entry2["complete"]


def test_without_pruning_every_candidate_is_timed_in_full(tmp_path, profile) -> None:  # type: ignore[no-untyped-def]
    _, entry, by = _tune(tmp_path, profile, TuneOptions(timeout_s=60.0, warmup=1, repeats=8, prune=False))
    assert all(c.get("step_ms") and not c.get("failed") for c in by.values()), entry["candidates"]


def test_the_pruner_stops_only_the_clearly_slower() -> None:
    """Successive halving keeps the best third at the third step; of the rest only one more than the
    margin above the best stops."""
    study = optuna.create_study(pruner=ClearlySlower(), direction="minimize")

    def run(running_medians: list[float]) -> bool:
        trial = study.ask()
        for step, value in enumerate(running_medians, start=1):
            trial.report(value, step)
            if trial.should_prune():
                study.tell(trial, state=TrialState.PRUNED)
                return True
        study.tell(trial, running_medians[-1])
        return False

    assert not run([10.0, 10.0, 10.0, 10.0])  # the first: nothing to compare with
    assert not run([10.4, 10.4, 10.5, 10.5])  # slower, but within the 10 % margin: runs in full
    assert run([30.0, 25.0, 20.0, 20.0])  # twice as slow at the third step: stopped there
    assert study.trials[-1].last_step == 3
    assert not run([40.0, 20.0, 9.0, 9.0])  # slow at first, the fastest by its third step: kept
    assert PRUNE_MARGIN == 0.10
