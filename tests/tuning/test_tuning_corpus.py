"""tune with the shipped corpus on a machine of a known kind: the corpus's finalists run first (gated,
then timed, as every candidate); where this machine agrees with the corpus the key stops there, where it
disagrees the key is searched in full. Planted backends in a test registry, a planted corpus."""

from __future__ import annotations

import time

import pytest
from helpers.tuning_helpers import planted_registry, save_table

from attnbench.backends.naive import NaiveBackend
from attnbench.core.workload import Workload
from attnbench.tables import CandidateResult, ResultsTable, corpus
from attnbench.tuning import TuneOptions, backend_refs, plan_studies, summarize, tune
from attnbench.tuning.seeding import corpus_plans
from attnbench.tuning.study import KeyResult

pytestmark = pytest.mark.usefixtures("one_thread")

WORKLOAD = Workload.uniform("tiny-gqa", batch=1, context=64, dtype="fp32")
FAST = TuneOptions(timeout_s=20.0, warmup=1, repeats=3)


class SlowBackend(NaiveBackend):
    """Correct, 30 ms slower per layer call (registered first: the default)."""

    name = "corpus_slow"

    def decode(self, cache, plan, *, layer, q, k, v):
        time.sleep(0.03)
        return super().decode(cache, plan, layer=layer, q=q, k=k, v=v)


class FastBackend(NaiveBackend):
    name = "corpus_fast"


class SlowerBackend(SlowBackend):
    name = "corpus_slower"


class SlowestBackend(SlowBackend):
    name = "corpus_slowest"


def _registry():  # type: ignore[no-untyped-def]
    return planted_registry(SlowBackend, FastBackend, SlowerBackend, SlowestBackend)


def _corpus(tmp_path, monkeypatch, profile, steps_ms: dict[str, float]):  # type: ignore[no-untyped-def]
    """A corpus holding this device's table of WORKLOAD with ``steps_ms`` measured (fastest wins)."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    (plan,) = plan_studies([WORKLOAD], backend_refs(_registry()), profile=profile, options=TuneOptions())
    records = [CandidateResult(b, {}, step_ms=t, gbps=1.0, pct_of_bandwidth=1.0) for b, t in steps_ms.items()]
    result = KeyResult(plan, records)
    save_table(folder, {result.key.row: summarize(result, profile=profile)}, profile=profile)
    monkeypatch.setattr(corpus, "CORPUS_DIR", folder)
    monkeypatch.delenv(corpus.CORPUS_ENV, raising=False)


def test_where_this_machine_agrees_only_the_corpus_finalists_run(tmp_path, monkeypatch, profile) -> None:
    _corpus(tmp_path, monkeypatch, profile, {"corpus_fast": 1.0, "corpus_slow": 30.0})
    options = TuneOptions(timeout_s=20.0, warmup=1, repeats=8)
    report = tune([WORKLOAD], registry=_registry(), results_dir=tmp_path / "r", options=options, profile=profile, samples=5)  # fmt: skip
    (entry,) = report.entries.values()
    assert entry["winner"]["backend"] == "corpus_fast"
    assert entry["trials"] == 2 and entry["complete"]  # the corpus's winner and the default, gated and timed
    (result,) = report.results  # each on half the timed steps: the finalists are re-timed in full
    timed = {r.backend: r.study_interval["samples"] for r in result.records if r.study_interval}
    assert timed == {"corpus_fast": 4}, result.records  # (the slow default: pruned after its first)
    assert entry["search"].startswith("corpus finalists (2): agreed with ")
    assert all(c.get("gate") for c in entry["candidates"])  # each was gated before it was timed


def test_the_corpus_finalists_halved_study_never_times_more_steps_than_asked(
    tmp_path, monkeypatch, profile
) -> None:
    _corpus(tmp_path, monkeypatch, profile, {"corpus_fast": 1.0, "corpus_slow": 30.0})
    options = TuneOptions(timeout_s=20.0, warmup=1, repeats=2)
    report = tune([WORKLOAD], registry=_registry(), results_dir=tmp_path / "r", options=options, profile=profile, samples=5)  # fmt: skip
    (result,) = report.results
    timed = {r.backend: r.study_interval["samples"] for r in result.records if r.study_interval}
    assert timed == {"corpus_fast": 2, "corpus_slow": 2}, result.records  # two each, not the floor of 3


def test_where_this_machine_disagrees_the_key_is_searched_in_full(tmp_path, monkeypatch, profile) -> None:
    _corpus(tmp_path, monkeypatch, profile, {"corpus_slowest": 1.0, "corpus_fast": 2.0, "corpus_slow": 30.0})
    report = tune([WORKLOAD], registry=_registry(), results_dir=tmp_path / "r", options=FAST, profile=profile, samples=5)  # fmt: skip
    (entry,) = report.entries.values()
    assert entry["winner"]["backend"] == "corpus_fast"  # not the corpus's winner: it lost here
    assert entry["trials"] == 4 and entry["complete"]
    assert "lost here" in entry["search"] and "searched in full" in entry["search"]
    assert "again interleaved beyond the intervals" in entry["search"]  # the study's times confirmed


_WARM = [False]  # set once another backend than the cold starter ran in this process


class ColdStartBackend(NaiveBackend):
    """As fast as corpus_warm, but 30 ms slower per layer call until another backend ran in its
    process: a study's first trial in a fresh worker, timed alone, can be that much slower than it is."""

    name = "corpus_cold"

    def decode(self, cache, plan, *, layer, q, k, v):
        if not _WARM[0]:
            time.sleep(0.03)
        return super().decode(cache, plan, layer=layer, q=q, k=k, v=v)


class WarmBackend(NaiveBackend):
    name = "corpus_warm"

    def decode(self, cache, plan, *, layer, q, k, v):
        _WARM[0] = True
        return super().decode(cache, plan, layer=layer, q=q, k=k, v=v)


def test_a_corpus_winner_behind_by_its_first_trial_alone_is_agreed_with_once_timed_interleaved(
    tmp_path, monkeypatch, profile
) -> None:
    reg = planted_registry(SlowBackend, WarmBackend, ColdStartBackend, SlowerBackend)
    folder = tmp_path / "corpus"
    folder.mkdir()
    (plan,) = plan_studies([WORKLOAD], backend_refs(reg), profile=profile, options=TuneOptions())
    records = [CandidateResult(b, {}, step_ms=t, gbps=1.0, pct_of_bandwidth=1.0) for b, t in {"corpus_cold": 1.0, "corpus_warm": 1.01, "corpus_slow": 30.0}.items()]  # fmt: skip
    save_table(folder, {plan.key.row: summarize(KeyResult(plan, records), profile=profile)}, profile=profile)
    monkeypatch.setattr(corpus, "CORPUS_DIR", folder)
    monkeypatch.delenv(corpus.CORPUS_ENV, raising=False)
    _WARM[0] = False  # (the worker is a process of its own: this is for a worker run in-process)
    report = tune([WORKLOAD], registry=reg, results_dir=tmp_path / "r", options=FAST, profile=profile, samples=5)  # fmt: skip
    (entry,) = report.entries.values()
    cold = next(c for c in entry["candidates"] if c["backend"] == "corpus_cold")
    warm = next(c for c in entry["candidates"] if c["backend"] == "corpus_warm")
    studied = {
        c["backend"]: c.get("study_ms", c["step_ms"]) for c in (cold, warm)
    }  # a non-finalist's is its study's
    assert studied["corpus_cold"] > 1.5 * studied["corpus_warm"], studied  # the study alone put it behind
    assert "agreed with" in entry["search"] and "timed again interleaved" in entry["search"], entry["search"]
    assert entry["trials"] == 3 and entry["complete"]  # the corpus's three finalists, not the fourth
    assert "corpus_cold" in entry["retimed"]["finalists"]  # agreed with: re-timed whatever its study time
    assert entry["winner"]["backend"] in {"corpus_cold", "corpus_warm"}


def test_no_corpus_searches_everything(tmp_path, monkeypatch, profile) -> None:
    _corpus(tmp_path, monkeypatch, profile, {"corpus_fast": 1.0, "corpus_slow": 30.0})
    options = TuneOptions(timeout_s=20.0, warmup=1, repeats=3, corpus=False)
    report = tune([WORKLOAD], registry=_registry(), results_dir=tmp_path / "r", options=options, profile=profile, samples=5)  # fmt: skip
    (entry,) = report.entries.values()
    assert entry["trials"] == 4 and entry["search"] == "grid"


class WrongBackend(NaiveBackend):
    """Off by 0.05 everywhere: a corpus that names it (another machine, another build) must not make it win."""

    name = "corpus_wrong"

    def decode(self, cache, plan, *, layer, q, k, v):
        return super().decode(cache, plan, layer=layer, q=q, k=k, v=v) + 0.05


def test_a_corpus_winner_that_fails_the_gate_here_never_wins(tmp_path, monkeypatch, profile) -> None:
    reg = planted_registry(SlowBackend, FastBackend, WrongBackend)
    folder = tmp_path / "corpus"
    folder.mkdir()
    (plan,) = plan_studies([WORKLOAD], backend_refs(reg), profile=profile, options=TuneOptions())
    records = [CandidateResult(b, {}, step_ms=t, gbps=1.0, pct_of_bandwidth=1.0) for b, t in {"corpus_wrong": 0.5, "corpus_slow": 30.0}.items()]  # fmt: skip
    result = KeyResult(plan, records)
    save_table(folder, {result.key.row: summarize(result, profile=profile)}, profile=profile)
    monkeypatch.setattr(corpus, "CORPUS_DIR", folder)
    monkeypatch.delenv(corpus.CORPUS_ENV, raising=False)
    report = tune(
        [WORKLOAD], registry=reg, results_dir=tmp_path / "r", options=FAST, profile=profile, samples=5
    )
    (entry,) = report.entries.values()
    assert entry["winner"]["backend"] == "corpus_fast"
    wrong = next(c for c in entry["candidates"] if c["backend"] == "corpus_wrong")
    assert wrong["failed"] == "gate"
    assert "searched in full" in entry["search"] and entry["trials"] == 3


def test_each_key_also_measures_the_corpus_finalists_of_its_maps_other_keys(tmp_path, profile) -> None:
    """So that the dispatch map's points are re-timed once, with candidates every point's study measured."""
    longer = Workload.uniform("tiny-gqa", batch=1, context=128, dtype="fp32")
    plans = plan_studies(
        [WORKLOAD, longer], backend_refs(_registry()), profile=profile, options=TuneOptions()
    )
    measured = {
        64: {"corpus_fast": 1.0, "corpus_slow": 30.0},
        128: {"corpus_slower": 1.0, "corpus_slow": 30.0},
    }
    entries = {}
    for plan in plans:
        records = [
            CandidateResult(b, {}, step_ms=t, gbps=1.0, pct_of_bandwidth=1.0)
            for b, t in measured[plan.key.context_bucket].items()
        ]
        result = KeyResult(plan, records)
        entries[result.key.row] = summarize(result, profile=profile)
    path = save_table(tmp_path, entries, profile=profile)
    firsts = {
        p.key.context_bucket: [c.backend for c in p.corpus_first]
        for p in corpus_plans(plans, ResultsTable.load(path), "planted")
    }
    assert firsts == {
        64: ["corpus_fast", "corpus_slow", "corpus_slower"],
        128: ["corpus_slower", "corpus_slow", "corpus_fast"],
    }
