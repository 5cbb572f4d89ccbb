"""A backend whose speed changes after its first timing steps never misleads the tuner: one fast on its
first steps and slow afterwards loses to a steady one, one slow on its first steps and fast afterwards
wins against it. What a backend is worth is its steady speed, which is what serving runs at."""

from __future__ import annotations

import time
from typing import Any, ClassVar

import pytest
from helpers.tuning_helpers import planted_registry

from attnbench.backends.naive import NaiveBackend
from attnbench.core.workload import Workload
from attnbench.tuning import TuneOptions, tune

pytestmark = pytest.mark.usefixtures("one_thread")

WORKLOAD = Workload.uniform("tiny-gqa", batch=1, context=64, dtype="fp32")
OPTIONS = TuneOptions(timeout_s=60.0, warmup=1, repeats=7)
#: the first steps of a cache: the warm-up and the first timed step (the "first timing round")
FIRST_STEPS = 2


class _Phased(NaiveBackend):
    """Correct; sleeps ``first_s`` a layer call in the first ``FIRST_STEPS`` steps on a cache and
    ``then_s`` afterwards (steps counted on layer 0, per cache: the gate's caches and the timed
    cache each start again)."""

    first_s: ClassVar[float] = 0.0
    then_s: ClassVar[float] = 0.0
    _steps: ClassVar[dict[int, int]] = {}

    def decode(self, cache: Any, plan: Any, *, layer: int, q: Any, k: Any, v: Any) -> Any:
        if layer == 0:
            self._steps[id(cache)] = self._steps.get(id(cache), 0) + 1
        time.sleep(self.first_s if self._steps.get(id(cache), 1) <= FIRST_STEPS else self.then_s)
        return super().decode(cache, plan, layer=layer, q=q, k=k, v=v)


class SteadyBackend(_Phased):
    """10 ms a layer call, always (registered first: the default)."""

    name = "phased_steady"
    first_s = then_s = 0.010
    _steps: ClassVar[dict[int, int]] = {}


class FastThenSlowBackend(_Phased):
    name = "phased_fast_then_slow"
    first_s, then_s = 0.0, 0.040
    _steps: ClassVar[dict[int, int]] = {}


class SlowThenFastBackend(_Phased):
    name = "phased_slow_then_fast"
    first_s, then_s = 0.040, 0.0
    _steps: ClassVar[dict[int, int]] = {}


@pytest.mark.parametrize(
    ("planted", "winner"),
    [(FastThenSlowBackend, "phased_steady"), (SlowThenFastBackend, "phased_slow_then_fast")],
    ids=["fast-then-slow-loses", "slow-then-fast-wins"],
)
def test_the_steady_speed_decides(tmp_path, profile, planted, winner) -> None:  # type: ignore[no-untyped-def]
    registry = planted_registry(SteadyBackend, planted)
    report = tune(
        [WORKLOAD], registry=registry, results_dir=tmp_path, options=OPTIONS, profile=profile, samples=5
    )
    (entry,) = report.entries.values()
    assert entry["complete"] and entry["trials"] == 2
    assert entry["winner"]["backend"] == winner, entry["candidates"]
    # the loser ran in full and was slower, or was pruned for its steady speed after its third step
    (loser,) = [c for c in entry["candidates"] if c["backend"] != winner]
    (won,) = [c for c in entry["candidates"] if c["backend"] == winner]
    assert loser.get("failed") == "pruned" or won["step_ms"] < loser["step_ms"], entry["candidates"]
