"""The gate's inputs and float64 references shared by one study's candidates (CaseShelf): drawn once per
workload, every candidate still gated in full against them — a wrong one still fails after a right one
passed — and a backend that writes into the inputs it is handed gets the case dropped, so the next
candidate's gate draws a new one instead of comparing against changed inputs."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

import attnbench.correctness.timed as timed
from attnbench.backends.naive import NaiveBackend
from attnbench.core.workload import Workload
from attnbench.correctness import CaseShelf
from attnbench.measure.bench import CheckFailed, measure_decode

WORKLOAD = Workload.uniform("tiny-gqa", batch=2, context=48, dtype="fp32")


class Wrong(NaiveBackend):
    """Attends with the wrong scale: a gate failure."""

    name = "case_wrong"

    def decode(self, cache: Any, plan: Any, *, layer: int, q: Any, k: Any, v: Any) -> Any:
        return super().decode(cache, plan, layer=layer, q=q * 1.5, k=k, v=v)


class Scribbler(NaiveBackend):
    """Caches what it is handed, then writes into the K history it was handed."""

    name = "case_scribbler"

    def append(self, cache: Any, plan: Any, *, layer: int, k: Any, v: Any) -> None:
        super().append(cache, plan, layer=layer, k=k, v=v)
        k.add_(1.0)


@pytest.fixture
def drawn(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the cases drawn (each draw: new random inputs and their float64 references)."""
    calls: list[int] = []
    real = timed.prepare_case

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(timed, "prepare_case", counting)
    return calls


def _measure(backend: Any, cases: CaseShelf, workload: Workload = WORKLOAD) -> Any:
    return measure_decode(backend, workload, warmup=1, repeats=3, num_layers=2, cases=cases)


def test_one_draw_serves_a_workloads_candidates_and_each_is_still_gated(drawn: list[int]) -> None:
    cases = CaseShelf()
    first = _measure(NaiveBackend(), cases)
    second = _measure(NaiveBackend(), cases)
    assert first.check.passed and second.check.passed
    assert first.check.seed == second.check.seed and len(drawn) == 1  # one draw, two full gates
    with pytest.raises(CheckFailed):  # a wrong candidate after right ones: the shared case still fails it
        _measure(Wrong(), cases)
    assert len(drawn) == 1
    other = Workload.uniform("tiny-gqa", batch=1, context=40, dtype="fp32")
    assert _measure(NaiveBackend(), cases, other).check.passed and len(drawn) == 2  # another workload


def test_a_backend_that_writes_into_the_inputs_gets_the_case_dropped(drawn: list[int]) -> None:
    cases = CaseShelf()
    assert _measure(NaiveBackend(), cases).check.passed
    case = cases.get(WORKLOAD, form="expanded", num_layers=2)
    before = case.inputs.history[0][0].clone()
    with contextlib.suppress(CheckFailed):  # its timed steps' spot check may catch it or not: either way
        _measure(Scribbler(), cases)  # the kept case was written into
    assert not torch.equal(case.inputs.history[0][0], before)
    assert _measure(NaiveBackend(), cases).check.passed  # on a new draw, not the written-into one
    assert len(drawn) == 2
    assert cases.get(WORKLOAD, form="expanded", num_layers=2) is not case
    assert cases.verify()
