"""``tune()``: one study per key, the finalists re-timed interleaved, the table and the dispatch map.

For every key: the study searches the space (each candidate checked and timed in a worker); then the
finalists (every candidate within two confidence intervals of the best, at least three, the default,
the incumbent of an existing entry and, when lossy caches compete, the fastest exact one) are re-timed
interleaved in one worker, and the margin policy decides the entry's winner. Then, per model and dtype, the tuned (batch, context) points form the
coarse grid of a dispatch map, refined where neighbouring winners differ.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnbench.core.backend import Backend
from attnbench.core.device import DeviceProfile, load_profile
from attnbench.core.locations import ResultsLocation, writable_results
from attnbench.core.registry import Registry, code_hash
from attnbench.core.workload import Workload
from attnbench.tables.corpus import corpus_enabled, corpus_entry
from attnbench.tables.dispatch import DispatchMap, GridPoint, dispatch_path, save_maps
from attnbench.tables.margin import NEAR_ENOUGH, SWITCH_MARGIN, beats, finalists
from attnbench.tables.table import CandidateResult, ResultsTable, TableError, hardware_id, table_path
from attnbench.tables.table_schema import Candidate
from attnbench.tuning import study
from attnbench.tuning.interleave import Finalist, retime
from attnbench.tuning.refine import RESOLUTION, PointMeasurement, grid_point, refine_map
from attnbench.tuning.seeding import by_cost, corpus_plans, seeded_plan
from attnbench.tuning.space import BackendRef, backend_refs
from attnbench.tuning.storage import redact
from attnbench.tuning.study import KeyResult, StudyPlan, TuneOptions
from attnbench.tuning.summary import candidate_label, summarize
from attnbench.tuning.supervisor import Worker

__all__ = ["DEFAULT_RETIMED_WITHIN", "TuneReport", "time_split", "tune"]

#: the default is re-timed beside the finalists where its study time is within this multiple of the best's
DEFAULT_RETIMED_WITHIN = NEAR_ENOUGH


@dataclass
class TuneReport:
    results: list[KeyResult]
    entries: dict[str, dict[str, Any]]
    table_path: Path
    storage: str
    messages: list[str] = field(default_factory=list)
    interrupted: bool = False
    maps: list[DispatchMap] = field(default_factory=list)
    map_path: Path | None = None
    #: worker evaluations (one candidate timed at one point): study trials, finalists re-timed, map refinement
    evaluations: dict[str, int] = field(default_factory=lambda: {"trials": 0, "retimed": 0, "refined": 0})
    #: where the table and the journal went, and why there (option, environment or per-user default)
    location: ResultsLocation | None = None
    #: where the run's wall time went (:func:`time_split`): ``wall_s``, ``phases`` (seconds by phase,
    #: summing to ``wall_s``), ``sections`` (the tuner's own stages, overlapping the phases) and
    #: ``by_backend`` (each backend's seconds by phase in the worker)
    profile: dict[str, Any] = field(default_factory=dict)

    @property
    def trials_run(self) -> int:
        return sum(r.ran for r in self.results)


def tune(
    workloads: Sequence[Workload],
    *,
    registry: Registry | None = None,
    backends: Sequence[str] | None = None,
    extra_backends: Sequence[type[Backend]] = (),
    results_dir: str | Path | None = None,
    storage: str | None = None,
    options: TuneOptions | None = None,
    profile: DeviceProfile | None = None,
    margin: float = SWITCH_MARGIN,
    samples: int = 15,
    refine: bool = True,
    resolution: float = RESOLUTION,
    command: str = "",
    on_plan: Callable[[list[StudyPlan]], None] | None = None,
    on_trial: Callable[[StudyPlan, CandidateResult, bool], None] | None = None,
    on_point: Callable[[GridPoint], None] | None = None,
    on_entry: Callable[[StudyPlan, Mapping[str, Any]], None] | None = None,
    on_study: Callable[[StudyPlan, Mapping[str, Any]], None] | None = None,
    update_reference: bool = False,
) -> TuneReport:
    """Tune every key that ``workloads`` fall in, merge the winners into the device's table, and
    write the device's dispatch map.

    Args:
        registry: where the candidate backends come from (default: the full registry).
        backends: only these registry names (default: all); an existing entry's other candidates are
            kept (merged) and its winner is re-measured beside this run's finalists.
        extra_backends: more backend classes (importable by path) to consider.
        results_dir: where the table, the map and the embedded study journal live (default: the
            results location of :mod:`attnbench.core.locations`; created if missing).
        update_reference: allow writing into a folder of committed reference runs (one holding
            ``REFERENCE.md``, like the repository's ``results/``); refused otherwise.
        storage: an Optuna RDB URL instead of the embedded journal.
        margin: the switch margin of the margin policy (:func:`attnbench.tables.margin.decide`).
        samples: interleaved samples per finalist (0: no re-timing, no map).
        refine / resolution: add grid lines where winners differ, to within ``resolution`` octaves.
        on_plan / on_trial / on_point / on_entry / on_study: progress hooks (the plans, each trial,
            each map point, each key's table entry once its finalists were re-timed, and each key's
            entry as its study ends, before any re-timing).

    Ctrl-C stops after marking the running trial interrupted; what was measured is kept in the
    study and written to the table (entries marked ``complete: false``), and ``interrupted`` is set.
    """
    started = time.monotonic()
    sections: dict[str, float] = {}
    options = options or TuneOptions()
    location = writable_results(results_dir, update_reference=update_reference)
    results = location.path
    profile = profile or load_profile(workloads[0].device if workloads else "cpu")
    refs = backend_refs(registry, only=backends, extra=extra_backends)
    everyone = {r.name: r for r in backend_refs(registry, extra=extra_backends)}
    hashes = {name: code_hash([r.cls]) for name, r in everyone.items()}
    plans = study.plan_studies(workloads, refs, profile=profile, options=options)
    if options.transfer:  # each map's cheapest key first: the costlier ones start from its finalists
        plans = by_cost(plans)
    known = corpus_entry(hardware_id(profile.fingerprint)) if options.corpus and corpus_enabled() else None
    if known is not None:  # a known kind of device: its measured finalists first (attnbench.tables.corpus)
        plans = corpus_plans(plans, ResultsTable.load(known.table), known.label)
    if on_plan is not None:
        on_plan(plans)
    report = TuneReport(
        [],
        {},
        table_path(results, profile.fingerprint),
        redact(storage) if storage else str(results / study.JOURNAL_NAME),
        location=location,
    )
    store = study.open_storage(
        storage, results_dir=results, heartbeat_s=options.heartbeat_s, messages=report.messages
    )
    table = ResultsTable(report.table_path, {})
    try:
        prior = ResultsTable.load(report.table_path, fingerprint=profile.fingerprint).entries
    except TableError:
        prior = {}  # the save below moves a corrupt table aside (or refuses another device's)
    measured: dict[str, tuple[StudyPlan, PointMeasurement, dict[str, Finalist]]] = {}
    task_profile = {k: v for k, v in profile.as_dict().items() if k != "id"}
    sections["planning, storage and the prior table"] = time.monotonic() - started

    def write(result: KeyResult, retimed: PointMeasurement | None) -> None:
        """Summarise one key (over ``retimed``'s interleaved times, else its study's) into the table."""
        t0 = time.monotonic()
        row = result.plan.key.row
        entry = summarize(
            result,
            profile=profile,
            margin=margin,
            command=command,
            retimed=retimed,
            prior=prior.get(row),
            code_hashes=hashes,
        )
        report.entries[row] = entry
        report.messages += table.save({row: entry}, profile=profile)
        sections["tables written"] = sections.get("tables written", 0.0) + time.monotonic() - t0

    with Worker(memory_limit_bytes=options.memory_limit_bytes) as worker:
        protect = {p.space.default_candidate().label() for p in plans if p.space.default_backend}
        protect |= {candidate_label(e["winner"]) for e in prior.values() if e.get("winner")}
        retimer = _Retimer(worker, options, task_profile, samples, frozenset(protect))
        studied: list[tuple[StudyPlan, KeyResult]] = []
        for plan in plans:
            if options.transfer:
                plan = seeded_plan(plan, studied, patience=options.patience)
            try:
                with _section(sections, "studies (trials through the worker)"):
                    result = study.run_study(
                        plan,
                        storage=store,
                        worker=worker,
                        profile=profile,
                        options=options,
                        on_trial=on_trial,
                        confirm=retimer.holds,
                    )
            except KeyboardInterrupt:
                report.interrupted = True
                break
            report.results.append(result)
            report.evaluations["trials"] += result.ran
            if not result.records:
                if result.interrupted:  # stopped in its first candidate: nothing to write
                    report.interrupted = True
                    break
                continue
            write(result, None)  # the study's own entry now: nothing lost if the run stops before re-timing
            if on_study is not None:
                on_study(plan, report.entries[plan.key.row])
            studied.append((plan, result))
            if result.interrupted:
                report.interrupted = True
                break
        # Every key's finalists re-timed once, with the finalists of the keys it shares a dispatch-map
        # cell with (gated here first where its study did not measure them), so that the map's coarse
        # points need no second interleaved run (each point's times still come from one run).
        finals = {
            plan.key.row: _finalists(plan, result, prior.get(plan.key.row), everyone)
            for plan, result in studied
        }
        for plan, result in studied if samples and not report.interrupted else ():
            fins, known_failed = _with_group(plan, result, finals, studied)
            try:
                with _section(sections, "finalists re-timed"):
                    retimed = retimer(fins, plan.workload, check=False)
            except KeyboardInterrupt:
                report.interrupted = True
                break
            retimed.failed = known_failed | retimed.failed
            report.evaluations["retimed"] += retimed.evaluations
            measured[plan.key.row] = (plan, retimed, fins)
            write(result, retimed)
            if on_entry is not None:
                on_entry(plan, report.entries[plan.key.row])
        for plan, _ in studied:
            if on_entry is not None and plan.key.row not in measured:  # not re-timed: its study's entry
                on_entry(plan, report.entries[plan.key.row])
        if measured and not report.interrupted:
            worker.section = "dispatch-map points"
            try:
                with _section(sections, "dispatch map (points and refinement)"):
                    _maps(report, measured, retimer, margin, refine, resolution, on_point)
            except KeyboardInterrupt:
                report.interrupted = True
    if report.maps:
        report.map_path = dispatch_path(report.table_path)
        report.messages += save_maps(
            report.map_path,
            report.maps,
            device={"hardware_id": hardware_id(profile.fingerprint), "fingerprint_id": profile.id},
            meta={"written_by": "attnbench tune", "command": command},
        )
    report.profile = time_split(time.monotonic() - started, worker.phases, worker.by_backend, sections)
    return report


@contextlib.contextmanager
def _section(sections: dict[str, float], name: str) -> Iterator[None]:
    t0 = time.monotonic()
    try:
        yield
    finally:
        sections[name] = sections.get(name, 0.0) + time.monotonic() - t0


def time_split(
    wall_s: float,
    worker_phases: Mapping[str, float],
    by_backend: Mapping[str, Mapping[str, float]],
    sections: Mapping[str, float],
) -> dict[str, Any]:
    """Where a tune's wall time went. ``phases``: the worker's (the correctness gate, cache creation,
    warm-up, timed samples, the timed step's check, the worker's own overhead, failed or refused
    candidates, interleaved re-timing, worker start-up) and ``bookkeeping``, the rest (Optuna, storage,
    planning, tables, this process's Python): together ``wall_s``. ``sections``: the tuner's stages
    (studies, re-timing, map refinement, tables), which overlap the phases."""
    phases = {k: round(v, 3) for k, v in worker_phases.items()}
    phases["bookkeeping"] = round(max(0.0, wall_s - sum(worker_phases.values())), 3)
    return {
        "wall_s": round(wall_s, 3),
        "phases": phases,
        "sections": {k: round(v, 3) for k, v in sections.items()},
        "by_backend": {b: {k: round(v, 3) for k, v in p.items()} for b, p in by_backend.items()},
    }


def _finalists(
    plan: StudyPlan,
    result: KeyResult,
    old: dict[str, Any] | None,
    everyone: dict[str, BackendRef],
) -> dict[str, Finalist]:
    """The candidates to re-time for one key: near the best, at least three, the default where its study
    time is within :data:`DEFAULT_RETIMED_WITHIN` × the best's, the incumbent, and — when lossy caches
    compete — the fastest exact one, so that the dispatch map has a measured choice for ``select()``
    without ``allow_lossy`` (else only the default would be left to it). A default further behind has
    no tie to decide and keeps its study time; re-timing it would cost the most (the default at batch
    8 × 32k tokens on a 2-core EPYC: 32 s a step, 36× the winner's). Where this machine agreed with the
    shipped corpus, the corpus's winner too: it held against its rival timed interleaved, whatever its
    study time (:func:`attnbench.tuning.study.corpus_verdict`)."""
    ok = {r.candidate.label(): r for r in result.records if r.ok and r.value}
    times = {k: r.search_interval() for k, r in ok.items()}
    default = plan.space.default_candidate().label() if plan.space.default_backend else None
    best = min((t.median_ms for t in times.values()), default=0.0)
    near = default in times and times[default].median_ms <= DEFAULT_RETIMED_WITHIN * best
    keep = [default] if default is not None and near else []
    if result.corpus == "agreed":
        keep.append(plan.corpus_first[0].label())
    exact = [k for k, r in ok.items() if not _lossy(plan.space.backends[r.backend])]
    if exact and len(exact) < len(ok):
        keep.append(min(exact, key=lambda k: times[k].median_ms))
    labels = finalists(times, keep=keep)
    picked = [(label, plan.space.backends[ok[label].backend], ok[label].config) for label in labels]
    incumbent = (old or {}).get("winner")
    if incumbent and incumbent["backend"] in everyone:
        picked.append(
            (candidate_label(incumbent), everyone[incumbent["backend"]], incumbent.get("config") or {})
        )
    out: dict[str, Finalist] = {}
    for label, ref, config in picked:  # the incumbent only when no finalist has its label
        out.setdefault(label, Finalist(label, ref.name, ref.ref, dict(config), _lossy(ref)))
    return out


def _with_group(
    plan: StudyPlan,
    result: KeyResult,
    finals: Mapping[str, dict[str, Finalist]],
    studied: Sequence[tuple[StudyPlan, KeyResult]],
) -> tuple[dict[str, Finalist], dict[str, str]]:
    """``plan``'s finalists and those of the keys it shares a cell of its dispatch map with
    (:func:`_share_a_cell`), and the reasons of those its study saw fail here. One its study measured
    was gated at this point already; one it did not (a seeded or TPE search, a key that stopped at the
    corpus's finalists) is gated here first, in the same interleaved run (``Finalist.check``), so the
    map needs no second run of the point."""
    fins = dict(finals[plan.key.row])
    records = {r.candidate.label(): r for r in result.records}
    failed: dict[str, str] = {}
    for other, _ in studied:
        if other is plan or not _share_a_cell(plan, other, [p for p, _ in studied]):
            continue
        for label, fin in finals[other.key.row].items():
            r = records.get(label)
            if label in fins:
                continue
            if r is None:
                fins[label] = dataclasses.replace(fin, check=True)
            elif r.ok and r.value:
                fins[label] = fin
            elif r.failed:
                failed[label] = f"{r.failed}: {r.reason}" if r.reason else r.failed
    return fins, failed


def _share_a_cell(a: StudyPlan, b: StudyPlan, plans: Sequence[StudyPlan]) -> bool:
    """Whether keys ``a`` and ``b`` are corners of one cell of their dispatch map, whose lines are the
    batches and contexts of ``plans`` in that map (next to each other, or the same, on both axes). The
    map answers a cell only from candidates measured at all four of its corners
    (:meth:`attnbench.tables.dispatch.DispatchMap.lookup`), so a key's finalists are re-timed at the
    keys it shares a cell with and nowhere else: a finalist of batch 1 × 1k tokens has no cell with
    batch 8 × 32k, where its re-timing would cost the most."""
    if a.group != b.group:
        return False
    batches = sorted({p.key.batch_bucket for p in plans if p.group == a.group})
    contexts = sorted({p.key.context_bucket for p in plans if p.group == a.group})

    def apart(lines: list[int], x: int, y: int) -> int:
        return abs(lines.index(x) - lines.index(y))

    return (
        apart(batches, a.key.batch_bucket, b.key.batch_bucket) <= 1
        and apart(contexts, a.key.context_bucket, b.key.context_bucket) <= 1
    )


def _lossy(ref: BackendRef) -> str:
    """What the backend's cache loses (``Backend.lossy``; ``""`` for an exact one)."""
    return getattr(ref.cls, "lossy", "") or ""


@dataclass
class _Retimer:
    """Times finalists interleaved in the worker with the tune's options (the gate first if asked)."""

    worker: Worker
    options: TuneOptions
    profile: dict[str, Any]
    samples: int
    #: the defaults and incumbents: re-timed while within the switch margin of the best, as the tie
    #: rule needs them (:func:`attnbench.tables.margin.decide`); any other finalist while it could win
    protect: frozenset[str] = frozenset()

    def __call__(self, fins: dict[str, Finalist], workload: Workload, *, check: bool) -> PointMeasurement:
        names: tuple[str, ...] = ("warmup", "num_layers", "materialise_bytes", "error_multiple")
        names += ("accuracy_budget", "timeout_s", "seed", "clock", "timing")
        settings = self.options.settings(workload, names)
        # no new block of rounds after 3 × a candidate's timing budget (30 s with tune's default 10)
        budget = 3 * self.options.max_seconds if self.options.max_seconds else None
        return retime(
            self.worker, list(fins.values()), workload=workload, samples=self.samples, check=check,
            profile=self.profile, max_seconds=budget, protect=sorted(self.protect & set(fins)), **settings,
        )  # fmt: skip

    def holds(self, plan: StudyPlan, winner: Candidate, rival: Candidate) -> bool:
        """Whether ``winner`` (the corpus's, at ``plan``'s key) holds against ``rival`` timed again
        interleaved, both gated by their study trials already: ``rival`` does not beat it beyond both
        intervals by the switch margin (:func:`attnbench.tuning.study.corpus_verdict`)."""
        fins = {}
        for c in (winner, rival):
            ref = plan.space.backends[c.backend]
            fins[c.label()] = Finalist(c.label(), c.backend, ref.ref, dict(c.config), _lossy(ref))
        section, self.worker.section = self.worker.section, "the corpus's winner against this machine's"
        try:
            got = self(fins, plan.workload, check=False)
        finally:
            self.worker.section = section
        mine, theirs = got.times.get(winner.label()), got.times.get(rival.label())
        return mine is not None and (theirs is None or not beats(theirs, mine, margin=SWITCH_MARGIN))

    def measurer(
        self, known: dict[str, Finalist], like: Workload
    ) -> Callable[[int, int, Sequence[str] | None], PointMeasurement]:
        """Measure a new grid point of ``like``'s shape and dtype: the gate first, then interleaved."""

        def measure(b: int, c: int, labels: Sequence[str] | None) -> PointMeasurement:
            w = Workload(like.shape, (c,) * b, like.dtype, like.device)
            return self({k: known[k] for k in (labels or known) if k in known}, w, check=True)

        return measure


def _maps(
    report: TuneReport,
    measured: dict[str, tuple[StudyPlan, PointMeasurement, dict[str, Finalist]]],
    retimer: _Retimer,
    margin: float,
    refine: bool,
    resolution: float,
    on_point: Callable[[GridPoint], None] | None,
) -> None:
    """One dispatch map per (model, dtype) whose tuned points form a full rectilinear grid."""
    groups: dict[tuple[str, str, str], list[tuple[StudyPlan, PointMeasurement, dict[str, Finalist]]]] = {}
    for plan, got, fins in measured.values():
        groups.setdefault(plan.group, []).append((plan, got, fins))
    for (model, shape_hash, dtype), items in groups.items():
        batches = sorted({p.key.batch_bucket for p, _, _ in items})
        contexts = sorted({p.key.context_bucket for p, _, _ in items})
        if len(items) != len(batches) * len(contexts):
            report.messages.append(
                f"dispatch map for {model} {dtype} not written: the tuned points are not a full "
                "batch × context grid (tune every --batch with every --context)"
            )
            continue
        plan0 = items[0][0]
        default = plan0.space.default_candidate().label() if plan0.space.default_backend else None
        known: dict[str, Finalist] = {}
        m = DispatchMap(model, shape_hash, dtype, default, batches, contexts, {}, {}, margin)
        #: at each coarse point, the finalists of the keys it shares a cell with (its own among them):
        #: what its key's re-timing took (_with_group). Not the union of those keys' re-timing sets,
        #: which hold the finalists of keys one more cell away: at batch 1 × 1k that took the finalists
        #: of batch 8 × 32k (through 8 × 8k's set) and re-timed every coarse point a second time.
        needed: dict[tuple[int, int], set[str]] = {}
        for plan, got, fins in items:
            known |= fins
            needed[(plan.key.batch_bucket, plan.key.context_bucket)] = set(fins)
            m.candidates |= got.candidates
            m.points[(plan.key.batch_bucket, plan.key.context_bucket)] = grid_point(
                plan.key.batch_bucket, plan.key.context_bucket, got, default=default, margin=margin
            )
        m.refinement = {"evaluations": sum(got.evaluations for _, got, _ in items)}

        measure = retimer.measurer(known, plan0.workload)
        # A finalist found by one point's study is measured at every coarse point it shares a cell
        # with: a candidate missing at a corner cannot be interpolated in that cell (seen: a config that
        # wins below 600 tokens, found only by the batch-8 study, was never offered at batch 1). The
        # point is re-timed whole, so that its times come from one interleaved run.
        for (b, c), point in list(m.points.items()):
            if needed[(b, c)] - set(point.times) - set(point.failed):
                got = measure(b, c, sorted(needed[(b, c)]))
                report.evaluations["refined"] += got.evaluations
                m.refinement["evaluations"] += got.evaluations
                m.candidates |= got.candidates
                m.points[(b, c)] = point = grid_point(b, c, got, default=default, margin=margin)
                if on_point is not None:
                    on_point(point)
        if refine:
            report.evaluations["refined"] += refine_map(m, measure, resolution=resolution, on_point=on_point)
        report.maps.append(m)
