"""The dispatch map's per-call verdict: decide()'s winner and tie by its own comparisons, its reason
written only when read (the same text), and select()'s reason likewise."""

from __future__ import annotations

import random
from dataclasses import replace

from attnbench.selection.choice import Choice
from attnbench.tuning.dispatch import DispatchMap, GridPoint, MapCandidate
from attnbench.tuning.lookup import _verdict
from attnbench.tuning.margin import Interval, decide


def test_the_verdict_is_decides_over_random_intervals() -> None:
    rng = random.Random(11)
    for _ in range(5000):
        times = {}
        for k in range(rng.randint(0, 6)):
            med = rng.choice([1.0, 1.0, rng.uniform(0.5, 2.0)])  # equal medians: the first wins
            times[f"c{k}"] = Interval(med, med * rng.uniform(0.8, 1.0), med * rng.uniform(0.98, 1.4), 15)
        default = rng.choice([None, "absent", *times])
        margin = rng.choice([0.0, 0.05, 0.1])
        v = decide(times, default=default, margin=margin)
        assert _verdict(times, default, margin) == (v.winner, v.tie)


def test_the_lookup_and_choice_reasons_are_written_when_read_and_equal_decides() -> None:
    cands = {"a": MapCandidate("a"), "b": MapCandidate("b")}
    points = {}
    for b in (1, 8):
        for c in (512, 4096):
            t = {"a": Interval(1.0, 0.97, 1.03, 15), "b": Interval(0.9, 0.88, 1.2 if b == 1 else 0.92, 15)}
            points[(b, c)] = GridPoint(b, c, t, winner="a")
    m = DispatchMap("m", "h", "bf16", "a", [1, 8], [512, 4096], cands, points)
    for batch in (1, 3, 8, 20):
        look = m.lookup(batch, 1000)
        assert callable(look.__dict__["_reason"])  # not written yet
        deciders = {k: look.predicted[k] for k in look.predicted}
        v = decide(deciders, default="a", margin=m.switch_margin)
        assert look.label == v.winner and look.tie == v.tie and look.reason == v.reason
        assert look == replace(look)  # the reason as a field: compared, copied
    choice = Choice(backend="a", config={}, source="tuned", workload=None, reason=lambda: "later")  # type: ignore[arg-type]
    assert choice.reason == "later" and choice.copy_for(None).reason == "later"  # type: ignore[arg-type]
    try:
        Choice(backend="a", config={}, source="tuned", workload=None)  # type: ignore[call-arg, arg-type]
    except TypeError as err:
        assert "reason" in str(err)
    else:
        raise AssertionError("Choice without a reason was accepted")
