"""A tuner's step of fewer layers than the model's (``timed_layers``) stands for the model's step: its
times, in a trial and in the interleaved re-timing, are each step × the model's layers / those run."""

from __future__ import annotations

import types

import pytest

from attnbench.backends.naive import NaiveBackend
from attnbench.core.workload import Workload, workload_to_dict
from attnbench.tuning import Worker
from attnbench.tuning.interleave import Finalist, retime, step_scale
from attnbench.tuning.study import TuneOptions
from attnbench.tuning.worker import WorkerTask, evaluate

LAYER_S = 0.004  # the planted cost of one layer's decode call, on a virtual clock
CLOCK = f"{__name__}:virtual_clock"
_ELAPSED = [0.0]  # planted seconds in this process (monotonic)


def virtual_clock() -> float:
    return _ELAPSED[0]


class Sleeper(NaiveBackend):
    """Exact attention, and ``LAYER_S`` on the virtual clock in every decode call."""

    name = "planted_sleeper"

    def decode(self, cache, plan, *, layer, q, k, v):  # type: ignore[no-untyped-def]
        _ELAPSED[0] += LAYER_S
        return super().decode(cache, plan, layer=layer, q=q, k=k, v=v)


def test_options_resolve_the_layers_per_workload_only_where_none_were_asked() -> None:
    w = Workload.uniform("llama-3.1-8b", batch=8, context=32768, dtype="bf16")
    auto = TuneOptions(materialise_bytes=256 * 2**20).settings(w)
    assert auto["num_layers"] == 2 and auto["step_layers"] == 32
    assert step_scale(auto, w) == 16
    asked = TuneOptions(num_layers=4).settings(w)
    assert asked["num_layers"] == 4 and "step_layers" not in asked and step_scale(asked, w) == 1


@pytest.mark.parametrize("step_layers", [None, 6])
def test_a_trial_reports_the_step_of_the_layers_it_stands_for(profile, monkeypatch, step_layers) -> None:
    # the trial (in this process) times its steps on the virtual clock: 2 planted layers a step
    monkeypatch.setattr("attnbench.core.timing.time", types.SimpleNamespace(perf_counter=virtual_clock))
    w = Workload.uniform("tiny-gqa", batch=1, context=64, dtype="fp32")
    task = WorkerTask(
        backend_ref=f"{__name__}:Sleeper",
        config={},
        workload=workload_to_dict(w),
        profile={k: v for k, v in profile.as_dict().items() if k != "id"},
        warmup=1,
        repeats=3,
        num_layers=2,
        step_layers=step_layers,
        backend="planted_sleeper",
    )
    got = evaluate(task.as_dict())
    assert got["ok"], got
    # each timed step runs 2 layers of LAYER_S, reported as a step of `step_layers`
    assert got["value"] == pytest.approx((step_layers or 2) * LAYER_S, rel=1e-6)
    assert got["result"]["step_ms"] == pytest.approx(got["value"] * 1e3, rel=1e-3)
    interval = got["result"]["study_interval"]
    assert interval["lo_ms"] <= got["result"]["step_ms"] <= interval["hi_ms"]


def test_the_interleaved_re_timing_reports_the_step_of_the_layers_it_stands_for(profile) -> None:
    w = Workload.uniform("tiny-gqa", batch=1, context=64, dtype="fp32")
    fins = [Finalist("sleeper", "planted_sleeper", f"{__name__}:Sleeper", {})]
    stated = {k: v for k, v in profile.as_dict().items() if k != "id"}
    got = {}
    with Worker() as worker:
        for step_layers in (None, 6):
            m = retime(
                worker, fins, workload=w, samples=5, num_layers=2, step_layers=step_layers, timeout_s=60,
                instances=1, clock=CLOCK, profile=stated,
            )  # fmt: skip
            assert not m.failed, m.failed
            got[step_layers] = m.times["sleeper"].median_ms
    assert got[None] == pytest.approx(2 * LAYER_S * 1e3, rel=1e-6)  # two planted layers a step
    assert got[6] == pytest.approx(6 * LAYER_S * 1e3, rel=1e-6)  # reported as a step of six
