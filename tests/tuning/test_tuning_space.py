"""Tuning keys, search spaces, the TPE path and the worker's backend loading (no worker processes)."""

from __future__ import annotations

import optuna
import pytest
from helpers.tuning_helpers import RefuseBackend, stated_profile

from attnbench.backends.naive import NaiveBackend
from attnbench.core.backend import Tunable
from attnbench.core.workload import Workload, workload_to_dict
from attnbench.tables import CandidateResult, TuningKey
from attnbench.tuning import (
    Outcome,
    TuneOptions,
    backend_refs,
    build_space,
    evaluate,
    load_backend_class,
    open_storage,
    plan_studies,
    run_study,
)
from attnbench.tuning.worker import WorkerTask

W = Workload.uniform("tiny-gqa", batch=3, context=1000, dtype="fp32")
PROFILE = stated_profile(1e10)


class KnobBackend(NaiveBackend):
    """Three tunables of five choices: 125 candidates, more than the grid limit."""

    name = "knobs"
    tunables = (
        Tunable("a", (1, 2, 3, 4, 5), 5),
        Tunable("b", (1, 2, 3, 4, 5), 5),
        Tunable("c", ("x", "y", "z", "u", "v"), "x"),
    )


class PairBackend(NaiveBackend):
    name = "pair"
    tunables = (Tunable("block", (16, 32), 32), Tunable("shape", ((1, 2), (2, 1)), (1, 2)))


class InterpretedBackend(NaiveBackend):
    name = "interp"

    def interpreted(self, workload):
        return True


def _refs(*classes):
    from attnbench.tuning import BackendRef

    return [BackendRef.of(c) for c in classes]


def test_key_buckets_batch_and_context_and_round_trips():
    key = TuningKey.for_workload(W, device="dev1")
    assert (key.batch_bucket, key.context_bucket, key.dtype) == (4, 1024, "fp32")
    assert key.row == f"tiny-gqa@{W.shape.fingerprint()}/fp32/b4/ctx1024"
    assert TuningKey.from_fields(key.as_dict(), device="dev1") == key
    rep = key.representative(W)
    assert rep.batch == 4 and rep.context_lens == (1024,) * 4
    assert "dev1" in key.study_name("s1") and key.study_name("s1") != key.study_name("s2")
    with pytest.raises(ValueError, match="'batch_bucket' = '4': expected int"):
        TuningKey.from_fields(key.as_dict() | {"batch_bucket": "4"}, device="d")


def test_space_leaves_out_refusing_and_interpreted_backends_with_reasons():
    space = build_space(W, _refs(RefuseBackend, InterpretedBackend, PairBackend, NaiveBackend))
    assert list(space.backends) == ["pair", "naive"]
    reasons = {e.backend: e.reasons for e in space.excluded}
    assert reasons["planted_refuse"] == ("planted: refuses every workload",)
    assert "interpreter" in reasons["interp"][0]
    assert space.default_backend == "naive"  # the default order: flash, then naive


def test_grid_puts_the_default_first_and_covers_conditional_params():
    space = build_space(W, _refs(PairBackend, NaiveBackend))
    cands = space.candidates()
    assert space.size() == len(cands) == 5
    assert cands[0].backend == "naive" and cands[1].config == {"block": 32, "shape": (1, 2)}
    study = optuna.create_study()
    for c in cands:  # every candidate goes through Optuna's params and comes back the same
        study.enqueue_trial(space.params(c))
        trial = study.ask()
        assert space.suggest(trial) == c
        study.tell(trial, 1.0)
    assert study.trials[1].params == {"backend": "pair", "pair.block": 32, "pair.shape": "(1, 2)"}


class _FakeWorker:
    """Answers without a process: the time is a function of the config (best: a=1, b=2, c='z')."""

    def __init__(self):
        self.calls: list[dict] = []

    def run(self, task: WorkerTask, *, timeout: float, on_report: object = None) -> Outcome:
        self.calls.append(task.config)
        c = task.config
        value = 1.0 + (c.get("a", 3) - 1) ** 2 + (c.get("b", 3) - 2) ** 2 + (c.get("c") != "z")
        result = CandidateResult(task.backend, task.config, step_ms=value * 1e3, gbps=1.0)
        return Outcome(ok=True, value=value, kind="ok", result=result)


def test_large_space_uses_seeded_tpe_after_the_enqueued_defaults(tmp_path):
    refs = _refs(KnobBackend, NaiveBackend)
    options = TuneOptions(trials=30, seed=3)
    (plan,) = plan_studies([W], refs, profile=PROFILE, options=options)
    assert not plan.exhaustive and plan.target == 30 and plan.space.size() == 126
    storage = open_storage(None, results_dir=tmp_path)
    worker = _FakeWorker()
    result = run_study(plan, storage=storage, worker=worker, profile=PROFILE, options=options)
    assert result.complete and result.ran == 30 and len(result.records) == 30
    assert worker.calls[0] == {} and worker.calls[1] == {
        "a": 5,
        "b": 5,
        "c": "x",
    }  # default, then knobs' default
    assert len({tuple(sorted(c.items())) for c in worker.calls}) == 30  # no candidate measured twice
    best = min(r.value for r in result.records if r.value is not None)
    assert best < 4.0  # TPE found its way towards (1, 2, 'z') from a default worth 1 + 16 + 9 + 1
    again = run_study(plan, storage=storage, worker=_FakeWorker(), profile=PROFILE, options=options)
    assert again.ran == 0  # resumed: already 30 distinct candidates


def test_exhaustive_grid_when_trials_cover_the_space(tmp_path):
    refs = _refs(PairBackend, NaiveBackend)
    (plan,) = plan_studies([W], refs, profile=PROFILE, options=TuneOptions())
    assert plan.exhaustive and plan.target == 5
    worker = _FakeWorker()
    result = run_study(
        plan,
        storage=open_storage(None, results_dir=tmp_path),
        worker=worker,
        profile=PROFILE,
        options=TuneOptions(),
    )
    assert result.ran == 5 and len(worker.calls) == 5


def test_workloads_in_one_bucket_share_one_study():
    plans = plan_studies(
        [W, Workload.uniform("tiny-gqa", batch=4, context=1100, dtype="fp32")],
        _refs(NaiveBackend),
        profile=PROFILE,
        options=TuneOptions(),
    )
    assert len(plans) == 1


def test_worker_loads_backends_by_import_path_or_registry_name():
    assert load_backend_class("attnbench.backends.naive:NaiveBackend") is NaiveBackend
    assert load_backend_class("naive") is NaiveBackend
    with pytest.raises(TypeError, match="not an attnbench.Backend"):
        load_backend_class("attnbench.core.workload:Workload")
    task = WorkerTask(
        "naive", {}, workload_to_dict(Workload.uniform("tiny-gqa", batch=1, context=32, dtype="fp32"))
    )
    verdict = evaluate(task.as_dict() | {"repeats": 3, "warmup": 1})
    assert verdict["ok"] and verdict["value"] > 0


def test_the_worker_answers_one_trial_record_that_reaches_the_table_unchanged():
    """The worker's verdict carries the trial's CandidateResult; its dict reads back as the same record
    (worker pipe, study attribute and table file use this one pair), measured or failed."""
    from helpers.planted import NewestDropped

    w = workload_to_dict(Workload.uniform("tiny-gqa", batch=1, context=64, dtype="fp32"))
    good = evaluate(WorkerTask("naive", {}, w, repeats=3, warmup=1, backend="naive").as_dict())
    record = CandidateResult.from_dict(good["result"], where="worker")
    assert record.ok and record.backend == "naive" and record.step_ms == round(good["value"] * 1e3, 4)
    assert record.gate is not None and record.gate["error"]["rel_l2"] < 1e-3  # the gate's numbers kept
    assert record.search_interval().lo_ms <= record.step_ms <= record.search_interval().hi_ms
    assert CandidateResult.from_dict(record.as_dict(), where="again") == record
    ref = f"{NewestDropped.__module__}:NewestDropped"
    bad = evaluate(WorkerTask(ref, {}, w, repeats=3, warmup=1, backend="planted").as_dict())
    failed = CandidateResult.from_dict(bad["result"], where="worker")
    assert not bad["ok"] and failed.failed == "gate" == failed.kind and not failed.ok
    assert failed.backend == "planted" and failed.error and failed.error["rel_l2"] > 1e-3


def test_backend_refs_name_unknown_backends_and_refuse_local_classes():
    with pytest.raises(ValueError, match="unknown backend 'flsh'; registered: naive, flash"):
        backend_refs(only=["flsh"])

    class Local(NaiveBackend):
        name = "local"

    with pytest.raises(ValueError, match="top level of an importable module"):
        _refs(Local)


def test_storage_takes_rdb_urls_and_names_bad_ones(tmp_path):
    with pytest.raises(ValueError, match="not a database URL"):
        open_storage("results/x.db", results_dir=tmp_path)
    storage = open_storage(f"sqlite:///{tmp_path / 's.db'}", results_dir=tmp_path)
    assert isinstance(storage, optuna.storages.RDBStorage)


class _FlakyWorker(_FakeWorker):
    """Fails every 'pair' candidate with a timeout until told otherwise."""

    def __init__(self, *, flaky: bool):
        super().__init__()
        self.flaky = flaky

    def run(self, task: WorkerTask, *, timeout: float, on_report: object = None) -> Outcome:
        if self.flaky and "block" in task.config:
            self.calls.append(task.config)
            return Outcome(ok=False, kind="timeout", reason="no result after 1 s")
        return super().run(task, timeout=timeout)


def test_failed_trials_are_final_unless_retried(tmp_path):
    (plan,) = plan_studies([W], _refs(PairBackend, NaiveBackend), profile=PROFILE, options=TuneOptions())
    storage = open_storage(None, results_dir=tmp_path)

    def study(*, flaky: bool, options: TuneOptions | None = None):  # type: ignore[no-untyped-def]
        worker = _FlakyWorker(flaky=flaky)
        return run_study(
            plan, storage=storage, worker=worker, profile=PROFILE, options=options or TuneOptions()
        )

    first = study(flaky=True)
    assert first.ran == 5 and sum(not r.ok for r in first.records) == 4
    again = study(flaky=False)
    assert again.ran == 0  # a failure is a verdict: not repeated by a plain resume
    fixed = study(flaky=False, options=TuneOptions(retry_failed=True))
    assert fixed.ran == 4 and all(r.ok for r in fixed.records) and len(fixed.records) == 5
    plain = study(flaky=True)
    assert plain.ran == 0 and all(r.ok for r in plain.records)  # the retry's verdicts supersede the failures


class _SlowFakeWorker(_FakeWorker):
    def run(self, task: WorkerTask, *, timeout: float, on_report: object = None) -> Outcome:
        import time

        time.sleep(0.2)
        return super().run(task, timeout=timeout)


def _tune_in_another_process(results_dir: str) -> int:
    (plan,) = plan_studies([W], _refs(KnobBackend), profile=PROFILE, options=TuneOptions(trials=125))
    storage = open_storage(None, results_dir=__import__("pathlib").Path(results_dir))
    return run_study(
        plan,
        storage=storage,
        worker=_SlowFakeWorker(),
        profile=PROFILE,
        options=TuneOptions(trials=125),
    ).ran


def test_two_processes_share_one_study_without_measuring_a_candidate_twice(tmp_path):
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(2) as pool:
        ran = pool.map(_tune_in_another_process, [str(tmp_path)] * 2)
    assert sum(ran) == 125 and min(ran) > 10  # both worked, and together measured each candidate once
    (plan,) = plan_studies([W], _refs(KnobBackend), profile=PROFILE, options=TuneOptions(trials=125))
    study = optuna.load_study(study_name=plan.study_name, storage=open_storage(None, results_dir=tmp_path))
    measured = [t for t in study.trials if t.state.name == "COMPLETE" and "duplicate_of" not in t.user_attrs]
    assert len(measured) == 125
    assert len({tuple(sorted(t.user_attrs["config"].items())) for t in measured}) == 125
