"""A candidate the interleaved re-timing gates itself (a map point no study measured, a corpus finalist):
the gate as in a trial, then the first step of the model that is timed checked against float64 — with
no model filled only to be checked, and one gate per combination of the tunables that change the bits."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

import attnbench.tuning.admit as admit
import attnbench.tuning.interleave as interleave
from attnbench.backends.naive import NaiveBackend
from attnbench.core.resolution import Tunable
from attnbench.core.workload import Workload, workload_to_dict
from attnbench.measure.synthetic import SyntheticModel

pytestmark = pytest.mark.usefixtures("one_thread")

WORKLOAD = Workload.uniform("tiny-gqa", batch=1, context=64, dtype="fp32")


class Wrong(NaiveBackend):
    """Off by 0.05 everywhere: the gate itself refuses it."""

    name = "interleave_wrong"

    def decode(self, cache: Any, plan: Any, *, layer: int, q: Any, k: Any, v: Any) -> Any:
        return super().decode(cache, plan, layer=layer, q=q, k=k, v=v) + 0.05


class LyingKnob(NaiveBackend):
    """Declares ``knob`` result-neutral, but knob 2 is wrong: its verdict is reused from knob 0, and
    only the check of its timed model's step can catch it."""

    name = "interleave_lying_knob"
    tunables: ClassVar[tuple[Tunable, ...]] = (Tunable("knob", (0, 1, 2), 0, "changes only the speed"),)
    result_neutral: ClassVar[tuple[str, ...]] = ("knob",)

    def decode(self, cache: Any, plan: Any, *, layer: int, q: Any, k: Any, v: Any) -> Any:
        out = super().decode(cache, plan, layer=layer, q=q, k=k, v=v)
        return out + 0.05 if cache.config["knob"] == 2 else out


def _candidate(label: str, cls: type, **config: Any) -> dict[str, Any]:
    return {"label": label, "backend_ref": f"{cls.__module__}:{cls.__qualname__}", "config": config}


def test_gated_candidates_are_checked_on_the_models_that_are_timed(profile, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    gated: list[str] = []
    real_gate = admit.gate_candidate

    def counting_gate(backend: Any, workload: Any, **kw: Any) -> Any:
        if kw.get("gate") is None:  # drawn, not a verdict reused
            gated.append(f"{backend.name}{kw['config']}")
        return real_gate(backend, workload, **kw)

    filled: list[str] = []
    real_fill = SyntheticModel.fill

    def counting_fill(self: SyntheticModel, **kw: Any) -> None:
        filled.append(f"{self.backend.name}{dict(self.config)}")
        real_fill(self, **kw)

    monkeypatch.setattr(admit, "gate_candidate", counting_gate)
    monkeypatch.setattr(SyntheticModel, "fill", counting_fill)
    task = {
        "workload": workload_to_dict(WORKLOAD),
        "samples": 3,
        "warmup": 1,
        "check": True,
        "num_layers": 2,
        "instances": 1,
        "profile": {k: v for k, v in profile.as_dict().items() if k != "id"},
        "candidates": [
            _candidate("knob0", LyingKnob, knob=0),
            _candidate("knob1", LyingKnob, knob=1),
            _candidate("knob2", LyingKnob, knob=2),
            _candidate("wrong", Wrong),
            _candidate("naive", NaiveBackend),
        ],
    }
    verdicts: dict[str, Any] = {}  # the worker's, kept across its studies and re-timings
    answer = interleave.run_interleaved(task, verdicts=verdicts)
    got = answer["attrs"]
    # where the run's time went, for tune --profile: the gates, fills, checked steps, warm-up and rounds
    assert set(answer["phases"]) == {"gate", "cache", "check", "warmup", "rounds", "release"}, answer[
        "phases"
    ]
    failed, times = got["failed"], got["samples_ms"]
    assert set(times) == {"knob0", "knob1", "naive"}, failed
    assert failed["wrong"].startswith("gate:") and "timed step" not in failed["wrong"], failed["wrong"]
    # knob 2's verdict was knob 0's; the check of its own timed model's step refused it
    assert failed["knob2"].startswith("gate:") and "timed step" in failed["knob2"], failed["knob2"]
    assert gated == ["interleave_lying_knob{'knob': 0}", "interleave_wrong{}", "naive{}"]
    # one fill per candidate that passed the gate (none only to be checked): the three knobs, naive
    assert sorted(filled) == sorted(
        [
            "interleave_lying_knob{'knob': 0}",
            "interleave_lying_knob{'knob': 1}",
            "interleave_lying_knob{'knob': 2}",
            "naive{}",
        ]
    )
    # a later run in the same worker (another key's re-timing, a map point of this workload) finds the
    # verdicts passed: only the candidate that failed is gated again, every model's step still checked
    gated.clear()
    again = interleave.run_interleaved(task, verdicts=verdicts)["attrs"]
    assert gated == ["interleave_wrong{}"]
    assert set(again["samples_ms"]) == {"knob0", "knob1", "naive"} and set(again["failed"]) == {
        "knob2",
        "wrong",
    }


def test_candidates_whose_models_do_not_fit_beside_the_others_wait_for_a_later_run(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    free = 8 * 2**30
    monkeypatch.setattr(admit, "available_memory", lambda device: free)
    task = {
        "workload": workload_to_dict(WORKLOAD),
        "samples": 3,
        "num_layers": 2,
        "instances": 1,
        "candidates": [_candidate(x, NaiveBackend) for x in ("a", "b", "c")],
    }
    got = interleave.run_interleaved(task | {"memory_reserve": free - 2**20})["attrs"]
    assert got["deferred"] == [] and set(got["samples_ms"]) == {"a", "b", "c"}  # a few KiB each: room
    # the first candidate always runs; one that would leave less than the reserve free waits
    got = interleave.run_interleaved(task | {"memory_reserve": free - 1})["attrs"]
    assert set(got["samples_ms"]) == {"a"} and got["deferred"] == ["b", "c"] and not got["failed"]
    assert admit.room_for(0, "cpu", task, checked=False)
    assert not admit.room_for(free - admit.MEMORY_RESERVE + 1, "cpu", task, checked=False)
    # a candidate gated in the run needs room for the gate's inputs too
    assert not admit.room_for(
        0, "cpu", task | {"memory_reserve": free - admit.CHECK_BUDGET_BYTES + 1}, checked=True
    )
