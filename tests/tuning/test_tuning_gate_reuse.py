"""Gate verdicts reused across result-neutral tunables: ``tune`` gates one config per combination of a
backend's other tunables and reuses that verdict for the configs that differ only in its
``result_neutral`` ones — each still timed and its timed step checked, so a backend whose declaration
is wrong (a "neutral" value that computes something else) still never wins."""

from __future__ import annotations

import time
from typing import Any, ClassVar

import pytest
from helpers.tuning_helpers import planted_registry

from attnbench.backends.naive import NaiveBackend
from attnbench.core.resolution import Tunable
from attnbench.core.workload import Workload
from attnbench.tuning import TuneOptions, tune

pytestmark = pytest.mark.usefixtures("one_thread")

WORKLOAD = Workload.uniform("tiny-gqa", batch=1, context=64, dtype="fp32")
OPTIONS = TuneOptions(timeout_s=60.0, warmup=1, repeats=3)


class NeutralKnob(NaiveBackend):
    """Correct at every ``knob``; knob 0 (the default) 20 ms slower a layer call."""

    name = "neutral_knob"
    tunables: ClassVar[tuple[Tunable, ...]] = (Tunable("knob", (0, 1, 2), 0, "changes only the speed"),)
    result_neutral: ClassVar[tuple[str, ...]] = ("knob",)

    def decode(self, cache: Any, plan: Any, *, layer: int, q: Any, k: Any, v: Any) -> Any:
        if cache.config["knob"] == 0:
            time.sleep(0.02)
        return super().decode(cache, plan, layer=layer, q=q, k=k, v=v)


class LyingKnob(NeutralKnob):
    """Declares ``knob`` neutral, but knob 2 — the fastest — is wrong by far more than the tolerance."""

    name = "lying_knob"

    def decode(self, cache: Any, plan: Any, *, layer: int, q: Any, k: Any, v: Any) -> Any:
        out = super().decode(cache, plan, layer=layer, q=q, k=k, v=v)
        return out + 0.05 if cache.config["knob"] == 2 else out


def _entry(tmp_path, profile, backend):  # type: ignore[no-untyped-def]
    report = tune(
        [WORKLOAD], registry=planted_registry(backend), results_dir=tmp_path, options=OPTIONS, profile=profile
    )
    (entry,) = report.entries.values()
    return entry, {c["config"]["knob"]: c for c in entry["candidates"]}


def test_one_gate_per_combination_of_the_other_tunables(tmp_path, profile) -> None:  # type: ignore[no-untyped-def]
    entry, by_knob = _entry(tmp_path, profile, NeutralKnob)
    assert entry["trials"] == 3 and all(c.get("step_ms") for c in by_knob.values())
    drawn = [k for k, c in by_knob.items() if "reused_from" not in c["gate"]]
    assert drawn == [0]  # the default ran first and drew the verdict
    assert {c["gate"]["reused_from"] for k, c in by_knob.items() if k} == {"neutral_knob[knob=0]"}
    assert entry["winner"]["config"]["knob"] in (1, 2)


def test_a_wrong_declaration_is_caught_by_the_timed_step_check(tmp_path, profile) -> None:  # type: ignore[no-untyped-def]
    entry, by_knob = _entry(tmp_path, profile, LyingKnob)
    assert by_knob[2]["failed"] == "gate", by_knob[2]  # the timed step's check: the output is wrong
    assert entry["winner"]["config"]["knob"] == 1
