"""One Optuna study per tuning key: build the space, run candidates in a worker, keep what was measured.

Small spaces are searched exhaustively (every candidate once, the default first); large ones with a
seeded TPE sampler, after the default and each backend's default config have been enqueued. The
loop is Optuna's ask/tell, so that each candidate can run in an isolated worker process
(:class:`attnbench.tuning.supervisor.Worker`) and a failure is told as a failed trial with its reason in
the trial's user attributes, never as an exception that stops the study.

Resuming: a candidate with a finished trial (complete, or failed with a verdict) is never run again;
trials cut short by Ctrl-C or SIGTERM are marked ``interrupted`` and run again on the next call.
Abandoned trials (their tuner was killed): with an RDB storage (a fleet), each running trial's tuner
records a heartbeat from a thread, and a trial whose heartbeat stopped for the grace period is failed
without a verdict by whichever tuner looks next, so its candidate runs again — this works across
machines. With the journal (one machine) a trial left ``RUNNING`` by a process that no longer exists
on this host is closed as interrupted. A tuner that finds only candidates running elsewhere waits for
them, so every tuner of a fleet ends with the complete study.
"""

from __future__ import annotations

import math
import os
import random
import socket
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from attnbench.core.device import DeviceProfile
from attnbench.core.registry import code_hash
from attnbench.core.workload import Workload, workload_to_dict
from attnbench.measure.layers import timed_layers
from attnbench.tables.key import TuningKey
from attnbench.tables.margin import SWITCH_MARGIN
from attnbench.tables.table_schema import Candidate, CandidateResult
from attnbench.tuning.pruning import study_pruner
from attnbench.tuning.space import BackendRef, SearchSpace, build_space
from attnbench.tuning.storage import (
    JOURNAL_NAME,
    close_abandoned,
    heartbeat,
    heartbeats_enabled,
    open_storage,
)
from attnbench.tuning.supervisor import Worker
from attnbench.tuning.worker import MEASURE_SETTINGS, Outcome, WorkerTask

__all__ = [
    "JOURNAL_NAME",
    "KeyResult",
    "StudyPlan",
    "TuneOptions",
    "converged",
    "corpus_verdict",
    "open_storage",
    "plan_studies",
    "run_study",
]

_MAX_DUPLICATES = 20


@dataclass
class TuneOptions:
    """How to tune. ``timeout_s`` bounds one candidate (check + timing) in its worker."""

    trials: int | None = None  # None: exhaustive up to grid_limit, else TPE with default_trials
    timeout_s: float = 120.0
    warmup: int = 2
    repeats: int = 10
    max_seconds: float | None = None
    #: layers a timed step runs (None: attnbench.measure.layers.timed_layers, one per distinct layer
    #: cache, and the times reported as the model's step: step × model layers / these)
    num_layers: int | None = None
    materialise_bytes: int | None = None
    timing: str | None = None  # "eager" or "graph" (attnbench.core.timing); None: graph on CUDA, else eager
    seed: int = 0
    grid_limit: int = 64
    default_trials: int = 40
    memory_limit_bytes: int | None = None
    retry_failed: bool = False  # run failed candidates again (e.g. after a timeout on a busy machine)
    host_id: str = field(default_factory=socket.gethostname)  # who runs a trial (fleet progress)
    heartbeat_s: int = 10  # RDB storages: heartbeat interval; a trial silent for 3x this is abandoned
    allow_lossy: bool = False  # lossy caches (fp8 K/V) compete only when allowed
    accuracy_budget: float | None = None  # or: lossy caches within this rel_l2 of exact attention compete
    error_multiple: float | None = None  # the gate's multiple for backends that declare none of their own
    clock: str | None = None  # import path of the re-timing's clock (default perf_counter; tests plant one)
    #: stop a trial's timed steps where Optuna's pruner finds it slower than the study's others
    #: (study_pruner); the finalists are re-timed in full either way
    prune: bool = True
    #: start each key from the shipped corpus's finalists where it has this device's kind (and
    #: ATTNBENCH_CORPUS is not off); stop there where this machine agrees (attnbench.tables.corpus)
    corpus: bool = True
    #: start a costlier key from the finalists of this run's cheaper keys of its dispatch map and stop
    #: its search after ``patience`` candidates in a row bring nothing better (attnbench.tuning.seeding)
    transfer: bool = True
    patience: int = 8

    def settings(self, workload: Workload, names: Sequence[str] = MEASURE_SETTINGS) -> dict[str, Any]:
        """These options' ``names`` for a measurement at ``workload``; without ``num_layers``, the layers
        :func:`~attnbench.measure.layers.timed_layers` gives there, and ``step_layers``, the model's:
        the times stand for its whole step."""
        out = {k: getattr(self, k) for k in names}
        if "num_layers" in out and out["num_layers"] is None:
            out["num_layers"] = timed_layers(workload, budget_bytes=self.materialise_bytes)
            out["step_layers"] = workload.shape.num_layers
        return out


def _trial_result(t: FrozenTrial) -> CandidateResult:
    return CandidateResult.from_dict(t.user_attrs["result"], where=f"trial {t.number}")


@dataclass
class StudyPlan:
    """One key about to be tuned: its representative workload, space and study."""

    key: TuningKey
    workload: Workload
    space: SearchSpace
    code_hash: str
    study_name: str
    exhaustive: bool
    target: int  # distinct candidates the study should hold when done
    #: the shipped corpus's fastest candidates at this key (its winner first; :func:`corpus_plans`),
    #: measured first: where this machine agrees the study stops there, else it is searched in full
    corpus_first: tuple[Candidate, ...] = ()
    corpus_label: str = ""  # the corpus's device in words
    #: this run's finalists of cheaper keys of the same dispatch map (attnbench.tuning.seeding), measured
    #: first; the search then stops after ``patience`` candidates in a row bring nothing better
    seeds: tuple[Candidate, ...] = ()
    seeded_from: str = ""  # those keys in words
    patience: int = 0

    @property
    def group(self) -> tuple[str, str, str]:
        """The dispatch map the key belongs to: its model, shape and dtype."""
        return (self.key.model, self.key.shape_hash, self.key.dtype)

    def load(self, storage: Any, *, seed: int) -> optuna.Study:
        sampler: optuna.samplers.BaseSampler
        if self.exhaustive:
            sampler = optuna.samplers.RandomSampler(seed=seed)  # unused: every trial is enqueued
        else:
            with (
                warnings.catch_warnings()
            ):  # multivariate/group are "experimental" but are what conditional spaces need
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                sampler = optuna.samplers.TPESampler(
                    seed=seed, multivariate=True, group=True, n_startup_trials=8
                )
        return optuna.create_study(
            study_name=self.study_name,
            storage=storage,
            sampler=sampler,
            pruner=study_pruner(),
            direction="minimize",
            load_if_exists=True,
        )


@dataclass
class KeyResult:
    plan: StudyPlan
    records: list[CandidateResult] = field(default_factory=list)  # in trial order
    ran: int = 0
    interrupted: bool = False
    #: "agreed" (this machine's fastest of the corpus's finalists is the corpus's winner, within the
    #: switch margin: the study stopped there), "disagreed" (searched in full), or "" (no corpus entry)
    corpus: str = ""
    corpus_note: str = ""  # what decided the corpus's verdict where the study's times alone did not
    #: a seeded study stopped: ``plan.patience`` candidates in a row brought nothing better
    converged: bool = False

    @property
    def key(self) -> TuningKey:
        return self.plan.key

    @property
    def complete(self) -> bool:
        if self.interrupted:
            return False
        if self.corpus == "agreed" or self.converged:
            return True
        return len({r.candidate.ident() for r in self.records}) >= min(
            self.plan.target, self.plan.space.size()
        )


def plan_studies(
    workloads: Sequence[Workload], refs: Sequence[BackendRef], *, profile: DeviceProfile, options: TuneOptions
) -> list[StudyPlan]:
    """One plan per distinct key (workloads in the same buckets share one)."""
    plans: dict[str, StudyPlan] = {}
    for w in workloads:
        key = TuningKey.for_workload(w, device=profile.id)
        if key.row in plans:
            continue
        rep = key.representative(w)
        space = build_space(rep, refs, allow_lossy=options.allow_lossy or options.accuracy_budget is not None)
        code = code_hash(r.cls for r in space.backends.values())
        size = space.size()
        exhaustive = size <= options.grid_limit if options.trials is None else options.trials >= size
        target = size if exhaustive else min(size, options.trials or options.default_trials)
        plans[key.row] = StudyPlan(
            key, rep, space, code, key.study_name(space.space_id(code)), exhaustive, target
        )
    return list(plans.values())


def _finished(t: FrozenTrial, *, retry_failed: bool = False, since: int = -1) -> bool:
    """A trial that measured its candidate (duplicates answered from another trial do not count).

    With ``retry_failed`` a failed trial counts only if it ran in this call (number > ``since``).
    """
    if "duplicate_of" in t.user_attrs or "result" not in t.user_attrs:  # (no result: older attnbench)
        return False
    if t.state == TrialState.COMPLETE or (
        t.state == TrialState.PRUNED and t.user_attrs.get("kind") == "pruned"
    ):
        return True  # measured, or gated and stopped early by the pruner: a verdict either way
    # a verdict is a failure kind recorded before the trial was told; a trial failed for its stale
    # heartbeat (its tuner died) or interrupted has none and runs again
    verdict = t.user_attrs.get("kind") not in (None, "", "ok", "interrupted")
    failed = t.state == TrialState.FAIL and verdict and not t.user_attrs.get("interrupted")
    return failed and (not retry_failed or t.number > since)


def run_study(
    plan: StudyPlan,
    *,
    storage: Any,
    worker: Worker,
    profile: DeviceProfile,
    options: TuneOptions,
    on_trial: Callable[[StudyPlan, CandidateResult, bool], None] | None = None,
    confirm: Callable[[StudyPlan, Candidate, Candidate], bool] | None = None,
) -> KeyResult:
    """Run ``plan``'s study until it holds ``plan.target`` distinct finished candidates.

    ``on_trial(plan, record, reused)`` is called after each trial (``reused``: a duplicate answered
    from an earlier trial). ``KeyboardInterrupt`` marks the running trial interrupted and returns
    what was measured with ``interrupted=True``. ``confirm``: whether the corpus's winner holds against
    a rival timed again interleaved (:func:`corpus_verdict`).
    """
    study = plan.load(storage, seed=options.seed)
    study.set_user_attr("key", plan.key.as_dict())
    study.set_user_attr("space", plan.space.describe())
    study.set_user_attr("code_hash", plan.code_hash)
    close_abandoned(study, study._storage, timeout_s=options.timeout_s, host=options.host_id)
    result = KeyResult(plan)
    if not plan.space.backends:
        return result
    rng = random.Random(options.seed)
    candidates = plan.space.candidates()
    since = len(study.get_trials(deepcopy=False)) - 1 if options.retry_failed else -1

    def finished(t: FrozenTrial) -> bool:
        return _finished(t, retry_failed=options.retry_failed, since=since)

    # a seeded study's patience counts the candidates its sampler chose, after the seeds and the defaults
    firsts = {c.ident() for c in (*plan.seeds, *candidates[: len(plan.space.backends)])}

    def explored(t: FrozenTrial) -> bool:
        return _trial_result(t).candidate.ident() not in firsts

    enqueued_defaults = False
    duplicates = stalls = 0
    result.corpus = str(study.user_attrs.get("corpus", "")) if plan.corpus_first else ""
    result.corpus_note = str(study.user_attrs.get("corpus_note", "")) if result.corpus else ""
    while True:
        trials = study.get_trials(deepcopy=False)
        done = {_trial_result(t).candidate.ident(): t for t in trials if finished(t)}
        busy = {
            Candidate(t.user_attrs["backend"], t.user_attrs.get("config", {})).ident()
            for t in trials
            if t.state == TrialState.RUNNING and "backend" in t.user_attrs
        }
        todo = [c for c in candidates if c.ident() not in done and c.ident() not in busy]
        if len(done) >= plan.target or result.corpus == "agreed":
            break
        confirming = bool(plan.corpus_first) and not result.corpus  # the corpus's finalists run first
        # on half the steps (gated all the same; corpus_verdict interleaves where in doubt)
        halved = {"repeats": max(min(3, options.repeats), options.repeats // 2)} if confirming else {}
        if confirming:
            if all(c.ident() in done for c in plan.corpus_first):
                checked = None if confirm is None else (lambda a, b: confirm(plan, a, b))
                result.corpus, result.corpus_note = corpus_verdict(plan.corpus_first, done, confirm=checked)
                study.set_user_attr("corpus", result.corpus)
                study.set_user_attr("corpus_note", result.corpus_note)
                continue
            todo = [c for c in plan.corpus_first if c in todo] or todo
        elif plan.seeds and any(c in todo for c in plan.seeds):  # this run's cheaper keys' finalists first
            confirming, todo = True, [c for c in plan.seeds if c in todo]
        elif plan.seeds and converged(list(done.values()), plan.patience, counted=explored):
            result.converged = True
            break
        if not todo:
            if not busy:
                break
            # the rest runs elsewhere: wait for it (or for its tuner to be found dead, then run it)
            time.sleep(max(1.0, options.heartbeat_s / 2))
            close_abandoned(study, study._storage, timeout_s=options.timeout_s, host=options.host_id)
            continue
        if plan.exhaustive or confirming or duplicates >= _MAX_DUPLICATES:
            pick = todo[0] if plan.exhaustive or confirming else rng.choice(todo)
            study.enqueue_trial(plan.space.params(pick))
            duplicates = 0
        elif not enqueued_defaults:
            for c in candidates[: len(plan.space.backends)]:  # the default, then each backend's default
                if c.ident() not in done:
                    study.enqueue_trial(plan.space.params(c))
            enqueued_defaults = True
        trial = study.ask()
        beating: Any = study._storage  # an RDB storage with heartbeats records them (optuna's BaseHeartbeat)
        if heartbeats_enabled(beating):  # at once: a tuner killed from here on is found stale
            beating.record_heartbeat(trial._trial_id)
        cand = plan.space.suggest(trial)
        trial.set_user_attr("backend", cand.backend)
        trial.set_user_attr("config", dict(cand.config))
        trial.set_user_attr("host", options.host_id)
        trial.set_user_attr("pid", os.getpid())
        taken = _taken_by_earlier(study, plan.space, trial.number, cand, finished=finished)
        if cand.ident() in done or cand.ident() in busy or taken:
            _tell_duplicate(study, trial, done.get(cand.ident()), answer=not plan.exhaustive)
            duplicates += 1
            stalls += 1
            if stalls > len(candidates) + _MAX_DUPLICATES:  # nothing left that this process may run
                break
            continue
        stalls = 0
        task = WorkerTask(
            backend_ref=plan.space.backends[cand.backend].ref,
            config=dict(cand.config),
            workload=workload_to_dict(plan.workload),
            profile={k: v for k, v in profile.as_dict().items() if k != "id"},
            backend=cand.backend,
            report=options.prune,
            **(options.settings(plan.workload) | halved),
        )

        def on_report(step: int, value: float, trial: optuna.Trial = trial) -> bool:
            trial.report(value, step)  # the running median after ``step`` timed steps
            return trial.should_prune()

        try:
            with heartbeat(study._storage, trial._trial_id):
                outcome = worker.run(task, timeout=options.timeout_s, on_report=on_report)
        except KeyboardInterrupt:
            trial.set_user_attr("interrupted", True)
            trial.set_user_attr("kind", "interrupted")
            trial.set_user_attr("reason", "interrupted (Ctrl-C or SIGTERM); runs again on resume")
            study.tell(trial, state=TrialState.FAIL)
            result.interrupted = True
            break
        _record(trial, cand, outcome)
        if outcome.ok:
            study.tell(trial, outcome.value)
        elif outcome.kind == "pruned":
            study.tell(trial, state=TrialState.PRUNED)
        else:
            study.tell(trial, state=TrialState.FAIL)
        result.ran += 1
        if on_trial is not None:
            on_trial(plan, _trial_result(study.get_trials(deepcopy=False)[trial.number]), False)
    result.records = _unique([t for t in study.get_trials(deepcopy=False) if _finished(t)])
    return result


def corpus_verdict(
    firsts: Sequence[Candidate],
    done: dict[str, FrozenTrial],
    *,
    confirm: Callable[[Candidate, Candidate], bool] | None = None,
) -> tuple[str, str]:
    """``("agreed", note)`` where this machine's fastest of the corpus's finalists (measured, gated) is
    the corpus's winner (``firsts[0]``) or within the switch margin of it; else ``("disagreed", note)``.
    Study trials run one after another: two configs 11 % apart there lay 4 % apart interleaved. So
    where the winner is beyond the margin behind a ``rival``, ``confirm(winner, rival)`` (if given)
    times the two interleaved: "disagreed" only where the rival beats it there beyond both intervals
    by the margin. ``note`` says what decided. The corpus's finalists are timed on half the steps."""
    times = {}
    for c in firsts:
        t = done[c.ident()]
        if t.state == TrialState.COMPLETE and t.value is not None:
            times[c.ident()] = float(t.value)
    winner = times.get(firsts[0].ident())
    if winner is None or not times:  # the corpus's winner failed here (gate, error): search everything
        return "disagreed", f"its winner {firsts[0].label()} failed here"
    rival = next(c for c in firsts if c.ident() == min(times, key=times.__getitem__))
    if winner <= times[rival.ident()] * (1 + SWITCH_MARGIN):
        return "agreed", ""
    behind = f"its study time {winner / times[rival.ident()]:.2f}× {rival.label()}'s"
    if confirm is None:
        return "disagreed", behind
    if confirm(firsts[0], rival):
        return "agreed", f"{behind}; timed again interleaved, not beyond the intervals by the margin"
    return "disagreed", f"{behind}, and again interleaved beyond the intervals by the margin"


def converged(
    trials: Sequence[FrozenTrial],
    patience: int,
    *,
    counted: Callable[[FrozenTrial], bool] = lambda t: True,
    margin: float = SWITCH_MARGIN,
) -> bool:
    """Whether the last ``patience`` measured candidates that are ``counted`` (timed in full or pruned,
    in trial order) all failed to beat the best before them by more than ``margin``; those not counted
    (a seeded study's seeds and defaults) still set the best."""
    since, best = 0, math.inf
    for t in sorted(trials, key=lambda t: t.number):
        if t.state == TrialState.COMPLETE and t.value is not None:
            v = float(t.value)
        elif t.state == TrialState.PRUNED and t.last_step is not None:
            v = float(t.intermediate_values[t.last_step])
        else:
            continue
        if counted(t):
            since = 0 if v < best * (1 - margin) else since + 1
        best = min(best, v)
    return patience > 0 and since >= patience


def _unique(trials: list[FrozenTrial]) -> list[CandidateResult]:
    """One finished trial per candidate, the latest (a retry supersedes a failure; several processes
    may also have measured one candidate twice), in trial order."""
    seen: dict[str, tuple[int, CandidateResult]] = {}
    for t in sorted(trials, key=lambda t: t.number, reverse=True):
        r = _trial_result(t)
        seen.setdefault(r.candidate.ident(), (t.number, r))
    return [r for _, r in sorted(seen.values(), key=lambda x: x[0])]


def _taken_by_earlier(
    study: optuna.Study,
    space: SearchSpace,
    number: int,
    cand: Candidate,
    *,
    finished: Callable[[FrozenTrial], bool],
) -> bool:
    """Another process has measured this candidate, or asked for it at the same moment: then the lower
    trial number runs it (a waiting one too: whoever pops it will).

    An enqueued trial carries its params from the moment it exists (``fixed_params``), a sampled one
    from its ``suggest`` calls, so the check sees the other trial even before its user attributes.
    """
    states = (TrialState.WAITING, TrialState.RUNNING, TrialState.COMPLETE, TrialState.FAIL)
    for t in study.get_trials(deepcopy=False, states=states):
        if t.number == number or "duplicate_of" in t.user_attrs or t.user_attrs.get("interrupted"):
            continue
        if t.state in (TrialState.WAITING, TrialState.RUNNING) and t.number > number:
            continue  # a later trial for the same candidate defers to this one
        if t.state in (TrialState.COMPLETE, TrialState.FAIL) and not finished(t):
            continue  # e.g. a failure being retried
        params = t.system_attrs.get("fixed_params") or t.params  # fixed: complete from the start
        other = space.candidate_from_params(params)
        if other is not None and other.ident() == cand.ident():
            return True
    return False


def _record(trial: optuna.Trial, cand: Candidate, outcome: Outcome) -> None:
    """The trial's record (the worker's, or a failure the parent saw: crash, timeout) and its
    diagnostics, as the trial's user attributes."""
    result = outcome.result or CandidateResult(
        cand.backend, dict(cand.config), failed=outcome.kind or "crash", reason=outcome.reason
    )
    trial.set_user_attr("result", result.as_dict())
    trial.set_user_attr("kind", outcome.kind or "ok")
    trial.set_user_attr("wall_s", round(outcome.wall_s, 3))
    for extra in ("traceback", "stderr_tail"):
        if extra in outcome.attrs:
            trial.set_user_attr(extra, outcome.attrs[extra])


def _tell_duplicate(
    study: optuna.Study, trial: optuna.Trial, earlier: FrozenTrial | None, *, answer: bool
) -> None:
    """A candidate already measured (or being measured): run nothing.

    The duplicate is PRUNED, so each candidate has one COMPLETE trial at most — except that a TPE
    study (``answer``) is told the earlier value, since the sampler must see a good region as good;
    such a trial carries ``duplicate_of`` and is never counted as a verdict.
    """
    if earlier is None:
        trial.set_user_attr("duplicate_of", "running elsewhere")
        study.tell(trial, state=TrialState.PRUNED)
        return
    trial.set_user_attr("duplicate_of", earlier.number)
    if answer and earlier.state == TrialState.COMPLETE:
        study.tell(trial, earlier.value)
    else:
        study.tell(trial, state=TrialState.PRUNED)
