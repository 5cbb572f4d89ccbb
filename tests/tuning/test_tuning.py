"""The tuner end to end with planted backends in a test registry, each candidate in a worker process.

The planted backends are correct or broken on purpose: one is slow, one crashes its process, one
segfaults, one hangs, one returns NaN, one returns wrong values, one raises, one runs out of memory,
one refuses every workload. Workers load them by import path (``test_tuning:FastBackend``), the way
they load a plugin's backend. Tiny shapes and short timeouts keep this file quick.
"""

from __future__ import annotations

import ctypes
import os
import pathlib
import signal
import threading
import time

import optuna
import pytest
import torch
from helpers.tuning_helpers import RefuseBackend, planted_registry

from attnbench.backends.naive import NaiveBackend
from attnbench.core.workload import Workload
from attnbench.tables import ResultsTable
from attnbench.tuning import JOURNAL_NAME, TuneOptions, open_storage, tune

# one torch thread (the worker takes the parent's count): with two on a busy machine, back-to-back
# tiny steps can stall at a thread barrier for longer than the planted sleeps (test_tuning_map.py)
pytestmark = pytest.mark.usefixtures("one_thread")

WORKLOAD = Workload.uniform("tiny-gqa", batch=1, context=64, dtype="fp32")
FAST = TuneOptions(timeout_s=20.0, warmup=1, repeats=3)
SAMPLES = 5  # interleaved re-timing of the finalists: few samples here, it is not what these tests check


# -- planted backends (module level: workers import them by path) ----------------------------------
class FastBackend(NaiveBackend):
    name = "planted_fast"


class SlowBackend(NaiveBackend):
    """Correct, and ``sleep_s`` (50 ms) slower per layer call."""

    name = "planted_slow"
    sleep_s = 0.05

    def decode(self, cache, plan, *, layer, q, k, v):
        time.sleep(self.sleep_s)
        return super().decode(cache, plan, layer=layer, q=q, k=k, v=v)


class CrashBackend(NaiveBackend):
    name = "planted_crash"

    def decode(self, cache, plan, *, layer, q, k, v):
        os._exit(7)


class SegfaultBackend(NaiveBackend):
    name = "planted_segfault"

    def decode(self, cache, plan, *, layer, q, k, v):
        ctypes.string_at(0)  # reads address 0: SIGSEGV
        return super().decode(cache, plan, layer=layer, q=q, k=k, v=v)


class HangBackend(NaiveBackend):
    name = "planted_hang"

    def decode(self, cache, plan, *, layer, q, k, v):
        threading.Event().wait()  # never set: it hangs until its worker is killed


class NaNBackend(NaiveBackend):
    name = "planted_nan"

    def decode(self, cache, plan, *, layer, q, k, v):
        out = super().decode(cache, plan, layer=layer, q=q, k=k, v=v)
        return out * float("nan")


class WrongBackend(NaiveBackend):
    """Off by 0.05 everywhere: far outside the fp32 tolerance, yet finite."""

    name = "planted_wrong"

    def decode(self, cache, plan, *, layer, q, k, v):
        return super().decode(cache, plan, layer=layer, q=q, k=k, v=v) + 0.05


class RaiseBackend(NaiveBackend):
    name = "planted_raise"

    def decode(self, cache, plan, *, layer, q, k, v):
        raise RuntimeError("planted failure in decode")


class OOMBackend(NaiveBackend):
    name = "planted_oom"

    def decode(self, cache, plan, *, layer, q, k, v):
        torch.empty(2**50, dtype=torch.uint8)  # 1 PiB: the allocator refuses
        return super().decode(cache, plan, layer=layer, q=q, k=k, v=v)


class PacedBackend(SlowBackend):
    """Correct, 0.3 s per layer call: slow enough to be interrupted in the middle."""

    name = "planted_paced"
    sleep_s = 0.3

    def decode(self, cache, plan, *, layer, q, k, v):
        marker = os.environ.get("ATTNBENCH_TEST_PACED_MARKER")
        if marker:  # tell the test that this candidate is running (in its worker process)
            pathlib.Path(marker).touch()
        return super().decode(cache, plan, layer=layer, q=q, k=k, v=v)


class FastTwoBackend(NaiveBackend):
    name = "planted_fast_two"


def _candidates(entry):
    return {c["backend"]: c for c in entry["candidates"]}


# -- tests -------------------------------------------------------------------------------------------
def test_the_faster_backend_wins(tmp_path, profile):
    reg = planted_registry(SlowBackend, FastBackend)
    # 15 interleaved samples, not SAMPLES: with 5, a loaded machine (a second test process beside it)
    # once spread the fast one's interval wide enough for the margin policy to call a tie (default kept)
    report = tune([WORKLOAD], registry=reg, results_dir=tmp_path, options=FAST, profile=profile, samples=15)
    (entry,) = report.entries.values()
    assert entry["default"]["backend"] == "planted_slow"  # no flash/naive here: the first registered
    assert entry["winner"]["backend"] == "planted_fast"
    assert entry["runner_up"]["backend"] == "planted_slow"
    assert entry["margin"] > 0.05
    assert entry["complete"] and entry["search"] == "grid" and entry["trials"] == 2
    on_disk = ResultsTable.load(report.table_path, fingerprint=profile.fingerprint)
    row = f"tiny-gqa@{WORKLOAD.shape.fingerprint()}/fp32/b1/ctx64"
    assert on_disk.entries[row]["winner"]["backend"] == "planted_fast"
    # where the time went: the worker's phases and the bookkeeping add up to the wall time
    split = report.profile
    phases = split["phases"]
    assert {"gate", "cache", "warmup", "samples", "worker", "worker start-up", "bookkeeping"} <= set(phases)
    # the keys' interleaved re-timing split too: its caches, warm-up and rounds, the rest its worker's
    assert {f"re-timing (finalists): {p}" for p in ("cache", "warmup", "rounds", "worker")} <= set(phases)
    assert phases["re-timing (finalists): rounds"] > 0, phases
    assert sum(phases.values()) == pytest.approx(split["wall_s"], abs=0.05)
    assert set(split["by_backend"]) == {"planted_slow", "planted_fast"}
    assert split["by_backend"]["planted_fast"]["samples"] > 0
    assert split["sections"]["studies (trials through the worker)"] > 0


def test_broken_backends_fail_their_trials_and_the_study_picks_a_correct_one(tmp_path, profile):
    reg = planted_registry(
        CrashBackend,
        SegfaultBackend,
        HangBackend,
        NaNBackend,
        WrongBackend,
        RaiseBackend,
        OOMBackend,
        RefuseBackend,
        FastBackend,
    )
    options = TuneOptions(timeout_s=6.0, warmup=1, repeats=3)
    report = tune(
        [WORKLOAD], registry=reg, results_dir=tmp_path, options=options, profile=profile, samples=SAMPLES
    )
    (entry,) = report.entries.values()
    assert entry["complete"]
    assert entry["winner"]["backend"] == "planted_fast"
    assert entry["decision"].endswith("the default failed (crash)")
    got = _candidates(entry)
    assert (
        got["planted_crash"]["failed"] == "crash" and "exited with code 7" in got["planted_crash"]["reason"]
    )
    assert got["planted_segfault"]["failed"] == "crash" and "SIGSEGV" in got["planted_segfault"]["reason"]
    assert got["planted_hang"]["failed"] == "timeout" and "6 s" in got["planted_hang"]["reason"]
    assert got["planted_nan"]["failed"] == "nan" and got["planted_nan"]["error"]["nonfinite"] > 0
    assert got["planted_wrong"]["failed"] == "gate"
    assert got["planted_wrong"]["error"]["max_abs"] == pytest.approx(0.05, rel=0.05)  # the numbers, recorded
    assert (
        got["planted_raise"]["failed"] == "exception" and "planted failure" in got["planted_raise"]["reason"]
    )
    assert got["planted_oom"]["failed"] == "oom"
    assert entry["excluded"] == [{"backend": "planted_refuse", "reason": "planted: refuses every workload"}]
    # every failure is also on its Optuna trial, with the reason
    study = optuna.load_study(study_name=entry["study"], storage=open_storage(None, results_dir=tmp_path))
    failed = [t for t in study.trials if t.state == optuna.trial.TrialState.FAIL]
    assert len(failed) == 7 and all(t.user_attrs["result"]["reason"] for t in failed)


def test_interrupted_study_resumes_without_repeating_finished_trials(tmp_path, profile, monkeypatch, request):
    reg = planted_registry(FastBackend, FastTwoBackend, PacedBackend, SlowBackend)
    marker = tmp_path / "paced-is-running"
    monkeypatch.setenv("ATTNBENCH_TEST_PACED_MARKER", str(marker))
    # Ctrl-C as a user's terminal delivers it, whatever handler an earlier test left behind
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))
    seen: list[str] = []

    def send_sigint_once_paced_runs() -> None:
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)  # the paced candidate needs >= 3 s more: it is mid-trial

    def interrupt_during_the_third(plan, record, reused):
        seen.append(record.candidate.backend)
        if len(seen) == 2:  # the third candidate (paced, 0.6 s per step) is about to start
            threading.Thread(target=send_sigint_once_paced_runs, daemon=True).start()

    first = tune(
        [WORKLOAD],
        registry=reg,
        results_dir=tmp_path,
        options=FAST,
        profile=profile,
        samples=SAMPLES,
        on_trial=interrupt_during_the_third,
    )
    assert first.interrupted and first.trials_run == 2
    (entry,) = first.entries.values()
    assert not entry["complete"]
    storage = open_storage(None, results_dir=tmp_path)
    study = optuna.load_study(study_name=entry["study"], storage=storage)
    states = [
        (t.user_attrs["backend"], t.state.name, t.user_attrs.get("interrupted", False)) for t in study.trials
    ]
    assert states == [
        ("planted_fast", "COMPLETE", False),
        ("planted_fast_two", "COMPLETE", False),
        ("planted_paced", "FAIL", True),
    ]
    before = {t.number: t.value for t in study.trials if t.state.name == "COMPLETE"}

    second = tune(
        [WORKLOAD], registry=reg, results_dir=tmp_path, options=FAST, profile=profile, samples=SAMPLES
    )
    assert not second.interrupted and second.trials_run == 2  # the interrupted one and the one never started
    study = optuna.load_study(study_name=entry["study"], storage=storage)
    complete = [t for t in study.trials if t.state.name == "COMPLETE"]
    assert sorted(t.user_attrs["backend"] for t in complete) == sorted(
        ["planted_fast", "planted_fast_two", "planted_paced", "planted_slow"]
    )
    assert {t.number: t.value for t in complete if t.number in before} == before  # not measured again
    (entry,) = second.entries.values()
    assert entry["complete"] and entry["trials"] == 4
    assert entry["winner"]["backend"] in ("planted_fast", "planted_fast_two")
    assert (tmp_path / JOURNAL_NAME).exists()

    third = tune(
        [WORKLOAD], registry=reg, results_dir=tmp_path, options=FAST, profile=profile, samples=SAMPLES
    )
    assert third.trials_run == 0


def test_the_keys_re_timing_protects_the_default_and_then_the_incumbent(tmp_path, profile, monkeypatch):
    """The re-timing keeps sampling the default (and, on a second run, the table's incumbent) while
    within the switch margin of the best, as the tie rule needs (``tables.margin.contending``): the
    tuner passes those among the finalists to every interleaved run as ``protect``; the other
    finalists are timed while their intervals overlap the best's. Two planted twins: both finalists."""
    from attnbench.tuning import tuner

    seen: list[tuple[list[str], list[str]]] = []  # (finalists, protect) of each interleaved run

    def recording(worker, finalists, **kwargs):
        seen.append(([f.label for f in finalists], list(kwargs.get("protect", ()))))
        return real(worker, finalists, **kwargs)

    real = tuner.retime
    monkeypatch.setattr(tuner, "retime", recording)
    reg = planted_registry(FastTwoBackend, FastBackend)
    first = tune([WORKLOAD], registry=reg, results_dir=tmp_path, options=FAST, profile=profile, samples=15)
    (entry,) = first.entries.values()
    default, winner = entry["default"]["backend"], entry["winner"]["backend"]
    assert default == "planted_fast_two"
    assert seen == [(["planted_fast_two", "planted_fast"], ["planted_fast_two"])] or seen == [
        (["planted_fast", "planted_fast_two"], ["planted_fast_two"])
    ], seen
    seen.clear()
    tune([WORKLOAD], registry=reg, results_dir=tmp_path, options=FAST, profile=profile, samples=15)
    assert seen and all(sorted(p) == sorted({default, winner}) for _, p in seen), seen
