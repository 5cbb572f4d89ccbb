"""A costlier key starts from this run's cheaper keys' finalists: the grid's keys run cheapest first, the
second key of a dispatch map measures the first's finalists, then its default, then TPE, and stops once
``patience`` candidates in a row bring nothing better — with the same winner as a search in full, in
fewer trials. ``transfer=False`` searches every key in full."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, ClassVar

import optuna
import pytest
from helpers.tuning_helpers import planted_registry
from optuna.trial import TrialState

from attnbench.backends.naive import NaiveBackend
from attnbench.core.resolution import Tunable
from attnbench.core.workload import Workload
from attnbench.tuning import TuneOptions, tune
from attnbench.tuning.study import converged

pytestmark = pytest.mark.usefixtures("one_thread")

CHEAP = Workload.uniform("tiny-gqa", batch=1, context=64, dtype="fp32")
COSTLY = Workload.uniform("tiny-gqa", batch=4, context=64, dtype="fp32")
OPTIONS = TuneOptions(timeout_s=60.0, warmup=1, repeats=3, num_layers=2, patience=3, prune=False)


class Dial(NaiveBackend):
    """Correct at every ``dial``; 6 ms a layer call slower per step away from dial 7 (the default: 0).

    The studies time in real time: dial 7's step (about 1 ms) must be slowed past its neighbours' 13 ms
    by the load before a later candidate could seem better than it (at 3 ms a layer call, a loaded CI
    run once saw that happen)."""

    name = "seed_dial"
    tunables: ClassVar[tuple[Tunable, ...]] = (Tunable("dial", tuple(range(12)), 0, "only the speed"),)

    def decode(self, cache: Any, plan: Any, *, layer: int, q: Any, k: Any, v: Any) -> Any:
        time.sleep(0.006 * abs(cache.config["dial"] - 7))
        return super().decode(cache, plan, layer=layer, q=q, k=k, v=v)


def _tune(tmp_path, profile, options=OPTIONS):  # type: ignore[no-untyped-def]
    report = tune(
        [COSTLY, CHEAP],  # listed costliest first: studied cheapest first all the same
        registry=planted_registry(Dial),
        results_dir=tmp_path,
        options=options,
        profile=profile,
        samples=5,
    )
    return report, {e["batch_bucket"]: e for e in report.entries.values()}


def test_the_costlier_key_starts_from_the_cheaper_ones_finalists(tmp_path, profile) -> None:  # type: ignore[no-untyped-def]
    report, by_batch = _tune(tmp_path, profile)
    assert [r.plan.workload.batch for r in report.results] == [1, 4]
    cheap, costly = by_batch[1], by_batch[4]
    assert cheap["trials"] == 12 and cheap["search"] == "grid"  # the map's first key: searched as planned
    seeded = report.results[1]
    assert seeded.converged and costly["complete"]
    assert costly["search"].startswith("tpe from the finalists of b=1 ctx=64 (3)"), costly["search"]
    # its three seeds, its default, then three candidates in a row that brought nothing better
    assert costly["trials"] == 3 + 1 + 3 < 12
    assert [r.candidate.config["dial"] for r in seeded.records[:3]] == [
        c.candidate.config["dial"]
        for c in sorted((r for r in report.results[0].records if r.ok), key=lambda r: r.value or 0)[:3]
    ]
    assert cheap["winner"]["config"] == costly["winner"]["config"] == {"dial": 7}


def test_without_transfer_every_key_is_searched_in_full(tmp_path, profile) -> None:  # type: ignore[no-untyped-def]
    from dataclasses import replace

    _, by_batch = _tune(tmp_path, profile, replace(OPTIONS, transfer=False))
    assert by_batch[1]["trials"] == by_batch[4]["trials"] == 12
    assert by_batch[4]["search"] == "grid" and by_batch[4]["winner"]["config"] == {"dial": 7}


def test_converged_counts_only_the_candidates_chosen_after_the_seeds() -> None:
    study = optuna.create_study(direction="minimize")
    for value in (10.0, 10.2, 30.0, 9.8, 10.1, 9.0):  # a seed, a seed, then what the sampler chose
        study.add_trial(optuna.trial.create_trial(value=value, state=TrialState.COMPLETE))
    trials = study.get_trials(deepcopy=False)
    after_seeds = lambda t: t.number >= 2
    assert converged(trials[:5], 3, counted=after_seeds)  # 30, 9.8, 10.1: none > 5 % better than 10
    assert not converged(trials[:5], 4, counted=after_seeds)  # the seeds are not counted
    assert not converged(trials, 3, counted=after_seeds)  # 9.0: > 5 % better than 9.8, the count starts again
    assert not converged(trials[:2], 1, counted=after_seeds)  # seeds alone never converge


def test_a_key_is_seeded_from_its_two_nearest_studied_keys_only(profile) -> None:  # type: ignore[no-untyped-def]
    from attnbench.tables.table_schema import CandidateResult
    from attnbench.tuning import seeding
    from attnbench.tuning.space import BackendRef
    from attnbench.tuning.study import KeyResult, plan_studies

    loads = [Workload.uniform("tiny-gqa", batch=b, context=64, dtype="fp32") for b in (1, 2, 4, 8)]
    plans = plan_studies(loads, [BackendRef.of(Dial)], profile=profile, options=OPTIONS)
    target = next(p for p in plans if p.workload.batch == 8)
    # each studied key's three fastest dials: batch 1 → 0, 1, 2; batch 2 → 3, 4, 5; batch 4 → 6, 7, 8
    studied = [
        (p, KeyResult(p, [CandidateResult("seed_dial", {"dial": d}, step_ms=1.0 + d % 3) for d in dials]))
        for p, dials in zip(plans[:3], ((0, 1, 2), (3, 4, 5), (6, 7, 8)), strict=True)
    ]
    seeded = seeding.seeded_plan(target, studied, patience=3)
    assert [c.config["dial"] for c in seeded.seeds] == [6, 7, 8, 3, 4, 5]  # batch 4 first, then 2; not 1
    assert seeded.seeded_from == "b=4 ctx=64, b=2 ctx=64"
    everything = seeding.seeded_plan(target, studied, patience=3, keys=3)
    assert [c.config["dial"] for c in everything.seeds] == [6, 7, 8, 3, 4, 5, 0, 1, 2]


def test_a_keys_retiming_takes_every_finalist_of_its_map_gating_those_its_study_did_not_measure(
    profile,
) -> None:  # type: ignore[no-untyped-def]
    from attnbench.tables.table_schema import CandidateResult
    from attnbench.tuning.interleave import Finalist
    from attnbench.tuning.space import BackendRef
    from attnbench.tuning.study import KeyResult, plan_studies
    from attnbench.tuning.tuner import _with_group

    loads = [Workload.uniform("tiny-gqa", batch=b, context=64, dtype="fp32") for b in (1, 8)]
    far, here = plan_studies(loads, [BackendRef.of(Dial)], profile=profile, options=OPTIONS)
    ref = f"{Dial.__module__}:Dial"

    def fin(d: int) -> Finalist:
        return Finalist(f"seed_dial[dial={d}]", "seed_dial", ref, {"dial": d})

    finals = {
        far.key.row: {f.label: f for f in (fin(1), fin(2), fin(3))},
        here.key.row: {fin(7).label: fin(7)},
    }
    measured = [  # this key's study: dial 1 measured, dial 2 failed its gate, dial 3 never tried
        CandidateResult("seed_dial", {"dial": 7}, step_ms=1.0),
        CandidateResult("seed_dial", {"dial": 1}, step_ms=2.0),
        CandidateResult("seed_dial", {"dial": 2}, failed="gate", reason="rel_l2 too high"),
    ]
    studied = [(far, KeyResult(far, [])), (here, KeyResult(here, measured))]
    fins, failed = _with_group(here, KeyResult(here, measured), finals, studied)
    assert {f.config["dial"]: f.check for f in fins.values()} == {7: False, 1: False, 3: True}
    assert failed == {fin(2).label: "gate: rel_l2 too high"}


def test_a_keys_retiming_leaves_out_the_finalists_of_keys_it_shares_no_cell_with(
    profile,
) -> None:  # type: ignore[no-untyped-def]
    """Contexts 64, 512 and 4096 at batch 1: the cells are 64–512 and 512–4096, so the 64 key's finalist
    is re-timed at 512 and not at 4096, and the 4096 key's at 512 and not at 64."""
    from attnbench.tuning.interleave import Finalist
    from attnbench.tuning.space import BackendRef
    from attnbench.tuning.study import KeyResult, plan_studies
    from attnbench.tuning.tuner import _with_group

    loads = [Workload.uniform("tiny-gqa", batch=1, context=c, dtype="fp32") for c in (64, 512, 4096)]
    plans = plan_studies(loads, [BackendRef.of(Dial)], profile=profile, options=OPTIONS)
    low, mid, high = sorted(plans, key=lambda p: p.workload.context)
    ref = f"{Dial.__module__}:Dial"

    def fin(d: int) -> Finalist:
        return Finalist(f"seed_dial[dial={d}]", "seed_dial", ref, {"dial": d})

    finals = {low.key.row: {fin(1).label: fin(1)}, mid.key.row: {fin(2).label: fin(2)}}
    finals[high.key.row] = {fin(3).label: fin(3)}
    studied = [(p, KeyResult(p, [])) for p in (low, mid, high)]
    dials = {
        p.workload.context: sorted(
            f.config["dial"] for f in _with_group(p, KeyResult(p, []), finals, studied)[0].values()
        )
        for p in (low, mid, high)
    }
    assert dials == {64: [1, 2], 512: [1, 2, 3], 4096: [2, 3]}


def test_the_maps_coarse_points_are_not_re_timed_after_the_keys_re_timing(profile, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Each coarse point of the map is its key's re-timing (its finalists and those of the keys it
    shares a cell with): no second interleaved run, though the middle key's set holds the 4096 key's
    finalist, which shares no cell with 64 (a run re-timed every coarse point of a 2 × 3 grid again
    with the finalists of keys two cells away)."""
    from attnbench.tables.margin import Interval
    from attnbench.tuning.interleave import Finalist
    from attnbench.tuning.refine import PointMeasurement
    from attnbench.tuning.space import BackendRef
    from attnbench.tuning.study import KeyResult, plan_studies
    from attnbench.tuning.tuner import TuneReport, _maps, _with_group

    loads = [Workload.uniform("tiny-gqa", batch=1, context=c, dtype="fp32") for c in (64, 512, 4096)]
    plans = sorted(
        plan_studies(loads, [BackendRef.of(Dial)], profile=profile, options=OPTIONS),
        key=lambda p: p.workload.context,
    )
    ref = f"{Dial.__module__}:Dial"
    fin = {d: Finalist(f"seed_dial[dial={d}]", "seed_dial", ref, {"dial": d}) for d in (1, 2, 3)}
    finals = {p.key.row: {fin[d].label: fin[d]} for p, d in zip(plans, (1, 2, 3), strict=True)}
    studied = [(p, KeyResult(p, [])) for p in plans]
    measured = {}
    for p in plans:
        fins = _with_group(p, KeyResult(p, []), finals, studied)[0]
        times = {
            label: Interval(1.0 + f.config["dial"], 0.9 + f.config["dial"], 1.1 + f.config["dial"], 9)
            for label, f in fins.items()
        }
        measured[p.key.row] = (p, PointMeasurement(times), fins)
    calls = []

    class Retimer:
        def measurer(self, known, like):  # type: ignore[no-untyped-def]
            def measure(b, c, labels):  # type: ignore[no-untyped-def]
                calls.append((b, c, labels))
                return PointMeasurement({k: Interval(1.0, 0.9, 1.1, 9) for k in labels or known})

            return measure

    report = TuneReport([], {}, tmp_path / "t.yaml", "memory")
    _maps(report, measured, Retimer(), 0.05, False, 0.25, None)  # type: ignore[arg-type]
    assert calls == [] and len(report.maps) == 1
    m = report.maps[0]
    assert {c: sorted(m.points[(1, c)].times) for c in (64, 512, 4096)} == {
        c: sorted(measured[p.key.row][2]) for c, p in zip((64, 512, 4096), plans, strict=True)
    }


def test_the_entry_keeps_a_finalist_only_the_retiming_measured(profile) -> None:  # type: ignore[no-untyped-def]
    """Another key's finalist that this key's study never measured, gated and timed in its re-timing,
    is a candidate of the entry (and can win); one whose gate failed there is recorded failed."""
    from attnbench.tables.dispatch import MapCandidate
    from attnbench.tables.margin import Interval
    from attnbench.tables.table_schema import CandidateResult
    from attnbench.tuning.refine import PointMeasurement
    from attnbench.tuning.space import BackendRef
    from attnbench.tuning.study import KeyResult, plan_studies
    from attnbench.tuning.summary import summarize

    (plan,) = plan_studies([COSTLY], [BackendRef.of(Dial)], profile=profile, options=OPTIONS)
    result = KeyResult(plan, [CandidateResult("seed_dial", {"dial": d}, step_ms=2.0 + d) for d in (0, 1)])
    label = {d: f"seed_dial[dial={d}]" for d in (0, 1, 3, 7)}
    retimed = PointMeasurement(
        times={label[0]: Interval(2.0, 1.9, 2.1, 15), label[1]: Interval(3.0, 2.9, 3.1, 15), label[7]: Interval(1.0, 0.95, 1.05, 15)},
        failed={label[3]: "gate: rel_l2 0.3 > 0.01"},
        candidates={label[d]: MapCandidate("seed_dial", {"dial": d}) for d in (0, 1, 3, 7)},
    )  # fmt: skip
    entry = summarize(result, profile=profile, retimed=retimed)
    assert entry["winner"]["config"] == {"dial": 7} and entry["winner"]["retimed"]
    by_dial = {c["config"]["dial"]: c for c in entry["candidates"]}
    assert by_dial[3]["failed"] == "gate" and "rel_l2" in by_dial[3]["reason"]
    assert entry["trials"] == 4  # the candidates listed: the study's two and the re-timing's two
    assert entry["runner_up"]["config"] == {"dial": 0}
    assert entry["retimed"]["interleaved"] and "isolated" not in entry["retimed"]
    # a re-timing whose interleaved worker died (killed for memory) was timed one at a time: so recorded
    alone = dataclasses.replace(
        retimed, isolated="the interleaved run's worker died (crash): each candidate timed alone"
    )
    got = summarize(result, profile=profile, retimed=alone)["retimed"]
    assert got["interleaved"] is False and "worker died" in got["isolated"]
