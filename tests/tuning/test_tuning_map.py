"""``tune`` end to end with planted timing backends: the refined dispatch map, and merging entries.

The planted backends are exact (naive attention) and sleep in every layer call for a time that
depends on the batch, so one overtakes the other between two tuned batches. Workers load them by
import path (``test_tuning_map:Steady``). One layer per step and tiny shapes keep this quick.
"""

from __future__ import annotations

import random
import time
from typing import NamedTuple

import pytest
from helpers.tuning_helpers import planted_registry

from attnbench.backends.naive import NaiveBackend
from attnbench.core.workload import Workload
from attnbench.selection.select import select
from attnbench.tables import ResultsTable
from attnbench.tables.dispatch import load_maps, map_key
from attnbench.tables.margin import contending
from attnbench.tuning import TuneOptions, tune

# The studies time real steps. With two torch threads on a busy machine, a candidate's back-to-back
# sub-millisecond steps stalled for 150-160 ms (its threads wait at a barrier for a thread the
# scheduler has put off) in most runs beside two busy loops, which reordered the studies against the
# planted sleeps; with one thread the steps stay under a millisecond. The worker takes the parent's
# thread count.
pytestmark = pytest.mark.usefixtures("one_thread")

#: the virtual clock of the finalists' re-timing: the planted backends advance it by their planted
#: cost instead of sleeping, so the planted timings hold on a loaded machine (studies use real time)
CLOCK = "test_tuning_map:virtual_clock"
# a generous per-trial timeout: a planted backend never hangs, and a trial that times out on a loaded
# machine would let a planted slow candidate in as a finalist by the minimum-three rule
OPTIONS = TuneOptions(timeout_s=120.0, warmup=1, repeats=3, num_layers=1, clock=CLOCK)
_ELAPSED = [0.0]  # seconds of planted cost in this process (monotonic, never reset)


def virtual_clock() -> float:
    return _ELAPSED[0]


class Cost(NamedTuple):
    """A planted backend's cost per layer call: ``fixed_s + per_seq_s · batch`` (±2 %), and three times
    that in a share ``spike_p`` of the calls."""

    fixed_s: float = 0.0
    per_seq_s: float = 0.0
    spike_p: float = 0.0


class _Costed(NaiveBackend):
    """Exact; each layer call advances the virtual clock by its planted ``cost``."""

    cost = Cost()

    def decode(self, cache, plan, *, layer, q, k, v):
        fixed_s, per_seq_s, spike_p = self.cost
        slow = 3.0 if spike_p and random.random() < spike_p else 1.0
        _ELAPSED[0] += (fixed_s + per_seq_s * q.shape[0]) * slow * random.uniform(0.98, 1.02)
        return super().decode(cache, plan, layer=layer, q=q, k=k, v=v)


class Steady(_Costed):
    """2 ms per sequence in the batch: fastest at small batches."""

    name = "planted_steady"
    cost = Cost(per_seq_s=0.002)


class Overtaker(_Costed):
    """6 ms fixed + 0.5 ms per sequence: slower at batch 1, faster from batch 5 (they cross at 4)."""

    name = "planted_overtaker"
    cost = Cost(fixed_s=0.006, per_seq_s=0.0005)


class Laggard(_Costed):
    """Always the slowest (the third finalist)."""

    name = "planted_laggard"
    cost = Cost(fixed_s=0.012, per_seq_s=0.004)


class Noisy(_Costed):
    """The steady one's speed, but one step in three is 3× slower (a load spike it alone suffers)."""

    name = "planted_noisy"
    cost = Cost(per_seq_s=0.002 * 0.99, spike_p=0.3)


class NoisyFast(_Costed):
    """30 % faster than the steady one, with the same 3× spikes (one step in five)."""

    name = "planted_noisy_fast"
    cost = Cost(per_seq_s=0.002 * 0.7, spike_p=0.2)


def _workloads(batches, context=64):
    return [Workload.uniform("tiny-gqa", batch=b, context=context, dtype="fp32") for b in batches]


def test_the_refined_map_locates_a_crossover_between_two_tuned_batches(tmp_path, profile):
    reg = planted_registry(Steady, Overtaker, Laggard)
    report = tune(
        _workloads([1, 8]), registry=reg, results_dir=tmp_path, options=OPTIONS, profile=profile, samples=7
    )
    assert not report.interrupted and report.map_path is not None
    w = _workloads([1])[0]
    maps = load_maps(report.map_path)
    m = maps[map_key("tiny-gqa", w.shape.fingerprint(), "fp32")]
    assert m.batches[0] == 1 and m.batches[-1] == 8 and len(m.batches) > 2  # lines were added
    # the crossover (batch 4) is located: the lines around it are adjacent integers
    steady, over = "planted_steady", "planted_overtaker"
    won = {b: m.points[(b, 64)].winner for b in m.batches}
    assert won[1] == steady and won[8] == over
    last_steady = max(b for b in m.batches if won[b] == steady)
    first_over = min(b for b in m.batches if won[b] == over)
    assert last_steady < first_over and first_over - last_steady == 1 and 3 <= last_steady <= 5
    # lookups on both sides, at batches never measured by a study
    assert m.lookup(2, 64).label == steady
    assert m.lookup(7, 64).label == over
    assert m.lookup(16, 64).label == over and m.lookup(16, 64).extrapolated
    # and select(), as serving code calls it, from the map in the results folder
    for b, want in ((2, steady), (3, steady), (5, over), (7, over)):  # batch 3: a bucket lookup says over
        w = _workloads([b])[0]
        choice = select(w, results_dir=tmp_path, registry=reg)
        assert choice.backend == want, choice.explain()
    assert report.evaluations["refined"] > 0 and m.refinement["points"] == len(m.batches)
    # every point's times carry intervals from interleaved samples: 7 for each candidate that could
    # still win (the default: within the switch margin), the first block (3) for one clearly slower
    # (attnbench.tables.margin.sample_rounds)
    p = m.points[(8, 64)]
    doubt = contending(p.times, protect=[m.default] if m.default else [])
    assert doubt and all(
        t.lo_ms <= t.median_ms <= t.hi_ms and t.samples >= (7 if k in doubt else 3)
        for k, t in p.times.items()
    )


class LateBloomer(_Costed):
    """25 ms fixed: the slowest at batch 1, the fastest at 64. The studies time real steps, so it also
    sleeps 0.2 s at batch 1: no finalist there. (20 ms was not enough: with the suite's second process
    beside it, the real sub-millisecond steps of the others once had an interval wide enough for the
    finalist rule's reach to take it in.)"""

    name = "planted_late_bloomer"
    cost = Cost(fixed_s=0.025)

    def decode(self, cache, plan, *, layer, q, k, v):
        if q.shape[0] == 1:
            time.sleep(0.2)
        return super().decode(cache, plan, layer=layer, q=q, k=k, v=v)


class Laggard64(_Costed):
    """The laggard's planted cost; it sleeps 0.2 s at batch 64, so no finalist there (see LateBloomer)."""

    name = "planted_laggard64"
    cost = Laggard.cost

    def decode(self, cache, plan, *, layer, q, k, v):
        if q.shape[0] == 64:
            time.sleep(0.2)
        return super().decode(cache, plan, layer=layer, q=q, k=k, v=v)


def test_a_finalist_of_one_coarse_point_is_measured_at_every_coarse_point(tmp_path, profile):
    reg = planted_registry(Steady, Overtaker, Laggard64, LateBloomer)
    report = tune(
        _workloads([1, 64]),
        registry=reg,
        results_dir=tmp_path,
        options=OPTIONS,
        profile=profile,
        samples=5,
        refine=False,
    )
    # each study's finalists differ: the late bloomer is none at batch 1 (its study time there is far
    # beyond the finalist rule's reach), the laggard none at 64; each key is re-timed once with both
    # keys' finalists (its own study gated them all), so the map's coarse points need no second run
    finalists = {
        key: set(entry["retimed"]["finalists"])
        for key, entry in report.entries.items()
        if entry.get("retimed")
    }
    studied = {  # what each study measured (real time) or why a trial failed, for the failure message
        key: [
            (c["backend"], c.get("study_ms") or c.get("step_ms"), c.get("failed"), c.get("reason"))
            for c in entry.get("candidates", [])
        ]
        for key, entry in report.entries.items()
    }
    assert len(finalists) == 2 and len(set.union(*finalists.values())) == 4, (finalists, studied)
    at_1 = {b: t for b, t, failed, _ in studied[next(k for k in studied if k.endswith("/b1/ctx64"))] if t}
    assert at_1["planted_late_bloomer"] > 3 * min(at_1.values()), studied
    assert all(f == set.union(*finalists.values()) for f in finalists.values()), finalists
    assert report.evaluations["refined"] == 0  # no coarse point re-timed a second time
    m = report.maps[0]
    for point in m.points.values():  # every coarse point has every finalist, so every cell can use it
        assert set(point.times) == set.union(*finalists.values()), (point.batch, set(point.times))
    assert "planted_late_bloomer" in m.lookup(2, 64).predicted
    assert m.points[(64, 64)].winner == "planted_late_bloomer"


def test_a_narrower_run_keeps_the_full_entrys_winner(tmp_path, profile):
    reg = planted_registry(Laggard, Steady, Overtaker)  # the laggard is the default (first registered)
    (w,) = _workloads([8])
    full = tune([w], registry=reg, results_dir=tmp_path, options=OPTIONS, profile=profile, samples=7)
    (entry,) = full.entries.values()
    assert entry["winner"]["backend"] == "planted_overtaker" and entry["trials"] == 3
    narrow = tune(
        [w],
        registry=reg,
        backends=["planted_laggard"],
        results_dir=tmp_path,
        options=OPTIONS,
        profile=profile,
        samples=7,
    )
    (after,) = narrow.entries.values()
    assert after["winner"]["backend"] == "planted_overtaker"  # the incumbent, re-measured, still wins
    assert {c["backend"] for c in after["candidates"]} == {
        "planted_laggard",
        "planted_steady",
        "planted_overtaker",
    }
    assert after["trials"] == 3 and "planted_overtaker" in after["retimed"]["finalists"]
    assert "planted_steady" in after["merged"]  # kept from the full run, not re-measured
    on_disk = ResultsTable.load(narrow.table_path, fingerprint=profile.fingerprint)
    assert on_disk.entries[entry_row(w)]["winner"]["backend"] == "planted_overtaker"


def entry_row(w: Workload) -> str:
    return f"tiny-gqa@{w.shape.fingerprint()}/fp32/b8/ctx64"


def test_a_noisy_backend_never_wins_by_noise_and_a_genuinely_faster_noisy_one_does(tmp_path, profile):
    (w,) = _workloads([2])

    def tuned_entry(*classes, folder):  # type: ignore[no-untyped-def]
        report = tune(
            [w], registry=planted_registry(*classes), results_dir=folder, options=OPTIONS, profile=profile
        )
        (entry,) = report.entries.values()
        return entry

    entry = tuned_entry(Steady, Noisy, folder=tmp_path / "a")
    assert entry["winner"]["backend"] == "planted_steady"  # the default, kept
    assert all("interval" in c for c in entry["candidates"])
    won = entry["winner"]["interval"]
    assert won["samples"] >= 15  # the winner: at least 15 interleaved samples
    for c in entry["candidates"]:  # another stopped early only where its interval is wholly above
        iv = c["interval"]
        assert iv["samples"] >= 15 or iv["lo_ms"] > won["hi_ms"], (c["backend"], iv, won)
    if entry["tie"]:
        assert "tie: kept the default" in entry["decision"]
    entry = tuned_entry(Steady, NoisyFast, folder=tmp_path / "b")
    assert entry["winner"]["backend"] == "planted_noisy_fast" and not entry["tie"]
    iv = entry["winner"]["interval"]
    assert iv["lo_ms"] <= iv["median_ms"] <= iv["hi_ms"]


_DIRTY = [False]  # set by the polluter's step; the next planted step pays for it, then clears it


class Polluter(_Costed):
    """1 ms, and it leaves the next step 4 ms slower (as a candidate streaming a large pool leaves
    cold caches behind)."""

    name = "planted_polluter"
    cost = Cost(fixed_s=0.001)

    def decode(self, cache, plan, *, layer, q, k, v):
        out = super().decode(cache, plan, layer=layer, q=q, k=k, v=v)
        _DIRTY[0] = True
        return out


class Twin(_Costed):
    """1 ms, plus 4 ms right after the polluter."""

    name = "planted_twin"
    cost = Cost(fixed_s=0.001)

    def decode(self, cache, plan, *, layer, q, k, v):
        if _DIRTY[0]:
            _ELAPSED[0] += 0.004
            _DIRTY[0] = False
        return super().decode(cache, plan, layer=layer, q=q, k=k, v=v)


def test_the_interleaved_order_spreads_what_a_step_leaves_for_the_next(profile):
    """Two identical candidates tie though one of them is listed right after a polluter: a rotated
    order would make that one follow the polluter in four rounds of five and lose by 4×. (One model
    instance each: the median over several instances would hide the after-effect from the order.)"""
    from attnbench.tables.margin import beats
    from attnbench.tuning import Worker
    from attnbench.tuning.interleave import Finalist, retime

    names = ["polluter", "twin_a", "twin_b", "twin_c", "twin_d"]
    refs = ["test_tuning_map:Polluter"] + ["test_tuning_map:Twin"] * 4
    fins = [Finalist(n, n, r, {}) for n, r in zip(names, refs, strict=True)]
    (w,) = _workloads([1])
    with Worker() as worker:
        got = retime(
            worker, fins, workload=w, samples=15, num_layers=1, clock=CLOCK, timeout_s=60, instances=1
        )
    assert not got.failed and all(got.times[n].samples >= 15 for n in names)
    twins = [got.times[n] for n in names[1:]]
    assert all(t.median_ms < 2.0 for t in twins)  # each follows the polluter in under half the rounds
    assert not any(beats(a, b, margin=0.0) for a in twins for b in twins if a is not b)


def test_every_candidate_runs_in_every_position_and_after_every_other_equally_often():
    import itertools
    from collections import Counter

    from attnbench.tuning.interleave import round_order

    for n in range(1, 10):
        cycle = n if n % 2 == 0 else 2 * n
        for start in (0, 3 * cycle):  # any cycle: each is relabelled, none loses the balance
            rows = [round_order(n, r, seed=7) for r in range(start, start + cycle)]
            assert all(sorted(row) == list(range(n)) for row in rows)
            pairs = Counter((a, b) for row in rows for a, b in itertools.pairwise(row))
            places = Counter((i, x) for row in rows for i, x in enumerate(row))
            assert len(pairs) == n * (n - 1) and len(set(pairs.values())) <= 1
            assert len(places) == n * n and len(set(places.values())) == 1
    # each cycle is relabelled: the step between rounds falls on other pairs in the next cycle
    assert [round_order(6, r, seed=1) for r in range(6)] != [round_order(6, r, seed=1) for r in range(6, 12)]


_INSTANCES = [0]  # caches this worker process created of the instance-bound backend


class InstanceBound(_Costed):
    """1 ms a call on the first cache it makes and 5 ms on the second: one config whose speed is its
    model instance's (as measured on this CPU at sub-millisecond steps, in milder form)."""

    name = "planted_instance_bound"

    def create_cache(self, workload, *, config, num_layers, max_seq_len):
        cache = super().create_cache(workload, config=config, num_layers=num_layers, max_seq_len=max_seq_len)
        cache.instance = _INSTANCES[0]
        _INSTANCES[0] += 1
        return cache

    def decode(self, cache, plan, *, layer, q, k, v):
        _ELAPSED[0] += 0.001 if cache.instance % 2 == 0 else 0.005
        return super().decode(cache, plan, layer=layer, q=q, k=k, v=v)


def test_a_small_finalist_is_timed_on_several_instances_in_turn(profile):
    """The instance-bound candidate would beat the steady 2-ms one on its first instance alone (1 ms
    every step); over its instances (four: its caches are small; its time the median over them of each
    one's median) it takes 3 ms, and it no longer beats the steady one."""
    from attnbench.tables.margin import beats
    from attnbench.tuning import Worker
    from attnbench.tuning.interleave import Finalist, retime

    fins = [
        Finalist("bound", "bound", "test_tuning_map:InstanceBound", {}),
        Finalist("steady", "steady", "test_tuning_map:Steady", {}),
    ]
    (w,) = _workloads([1])
    with Worker() as worker:
        got = retime(worker, fins, workload=w, samples=15, num_layers=1, clock=CLOCK, timeout_s=60)
    assert not got.failed
    bound, steady = got.times["bound"], got.times["steady"]
    assert bound.median_ms > 2.5  # on its first instance alone: 1 ms, every sample; over its four: 3 ms
    assert not beats(bound, steady, margin=0.0)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_retime_refuses_a_number_of_instances_that_is_not_a_whole_number_from_one(bad) -> None:
    from attnbench.tuning.interleave import retime

    (w,) = _workloads([1])
    with pytest.raises(
        ValueError, match=rf"retime: instances={bad!r}; expected a whole number of model instances >= 1"
    ):
        retime(None, [], workload=w, instances=bad)


def test_the_smaller_a_finalists_caches_the_more_instances_it_is_timed_on():
    from attnbench.tuning.interleave import instances_for

    mib = 2**20
    assert [instances_for(n * mib) for n in (1, 128, 129, 512, 513, 40_000)] == [4, 4, 2, 2, 1, 1]


class _Sleeper(_Costed):
    """A planted cost, and ``sleep_s`` of real time per call: the studies (real time) rank it behind
    the ones that do not sleep, while the re-timing (the virtual clock) sees its planted cost."""

    sleep_s = 0.0

    def decode(self, cache, plan, *, layer, q, k, v):
        time.sleep(self.sleep_s)
        return super().decode(cache, plan, layer=layer, q=q, k=k, v=v)


class DefaultLaggard(_Sleeper):
    name = "planted_default_laggard"  # registered first: the default
    cost = Laggard.cost
    sleep_s = 0.1


class ExactSecond(_Sleeper):
    """Exact, slower than every lossy one in the study, the fastest exact one in fact."""

    name = "planted_exact"
    cost = Cost(per_seq_s=0.002)
    sleep_s = 0.05


class _Lossy(_Costed):
    lossy = "planted: exact values, declared lossy"


class LossyA(_Lossy):
    name = "planted_lossy_a"
    cost = Cost(per_seq_s=0.0005)


class LossyB(_Lossy):
    name = "planted_lossy_b"
    cost = Cost(per_seq_s=0.0006)


class LossyC(_Lossy):
    name = "planted_lossy_c"
    cost = Cost(per_seq_s=0.0007)


def test_with_lossy_caches_allowed_the_fastest_exact_candidate_is_a_finalist(tmp_path, profile):
    """Three lossy candidates fill the finalists by the minimum-three rule; the fastest exact one is
    re-timed too, so that select() without allow_lossy gets it and not the slow default (which, far
    behind, is not re-timed)."""
    from dataclasses import replace

    reg = planted_registry(DefaultLaggard, ExactSecond, LossyA, LossyB, LossyC)
    (w,) = _workloads([2])
    report = tune(
        [w], registry=reg, results_dir=tmp_path, options=replace(OPTIONS, allow_lossy=True), profile=profile,
        samples=5, refine=False,
    )  # fmt: skip
    (entry,) = report.entries.values()
    finalists = set(entry["retimed"]["finalists"])
    studied = {c["backend"]: c.get("study_ms", c.get("step_ms")) for c in entry["candidates"]}
    assert "planted_exact" in finalists, (finalists, studied)
    # the default, 100× behind by its study: no tie to decide, not re-timed; it keeps its study time
    assert "planted_default_laggard" not in finalists, (finalists, studied)
    assert entry["default"]["step_ms"] and not entry["default"].get("retimed"), entry["default"]
    exact = select(w, results_dir=tmp_path, registry=reg)
    assert exact.backend == "planted_exact", exact.explain()
    lossy = select(w, results_dir=tmp_path, registry=reg, allow_lossy=True)
    assert lossy.backend == "planted_lossy_a" and lossy.lossy, lossy.explain()
