"""``tune`` end to end with planted timing backends: the refined dispatch map, and merging entries.

The planted backends are exact (naive attention) and sleep in every layer call for a time that
depends on the batch, so one overtakes the other between two tuned batches. Workers load them by
import path (``test_tuning_map:Steady``). One layer per step and tiny shapes keep this quick.
"""

from __future__ import annotations

import random
from datetime import datetime, timezone

import pytest

from attnbench.backends.naive import NaiveBackend
from attnbench.device import DeviceProfile, fingerprint
from attnbench.hookspecs import hookimpl
from attnbench.registry import Registry, Source, load_registry
from attnbench.select import select
from attnbench.tuning import ResultsTable, TuneOptions, tune
from attnbench.tuning.dispatch import load_maps, map_key
from attnbench.workload import Workload

#: the virtual clock of the finalists' re-timing: the planted backends advance it by their planted
#: cost instead of sleeping, so the planted timings hold on a loaded machine (studies use real time)
CLOCK = "test_tuning_map:virtual_clock"
OPTIONS = TuneOptions(timeout_s=30.0, warmup=1, repeats=3, num_layers=1, clock=CLOCK)
_ELAPSED = [0.0]  # seconds of planted cost in this process (monotonic, never reset)


def virtual_clock() -> float:
    return _ELAPSED[0]


class Steady(NaiveBackend):
    """2 ms per sequence in the batch: fastest at small batches."""

    name = "planted_steady"

    def decode(self, cache, plan, *, layer, q, k, v):
        _ELAPSED[0] += 0.002 * q.shape[0] * random.uniform(0.98, 1.02)
        return super().decode(cache, plan, layer=layer, q=q, k=k, v=v)


class Overtaker(NaiveBackend):
    """6 ms fixed + 0.5 ms per sequence: slower at batch 1, faster from batch 5 (they cross at 4)."""

    name = "planted_overtaker"

    def decode(self, cache, plan, *, layer, q, k, v):
        _ELAPSED[0] += (0.006 + 0.0005 * q.shape[0]) * random.uniform(0.98, 1.02)
        return super().decode(cache, plan, layer=layer, q=q, k=k, v=v)


class Laggard(NaiveBackend):
    """Always the slowest (the third finalist)."""

    name = "planted_laggard"

    def decode(self, cache, plan, *, layer, q, k, v):
        _ELAPSED[0] += (0.012 + 0.004 * q.shape[0]) * random.uniform(0.98, 1.02)
        return super().decode(cache, plan, layer=layer, q=q, k=k, v=v)


class Noisy(NaiveBackend):
    """The steady one's speed, but one step in three is 3× slower (a load spike it alone suffers)."""

    name = "planted_noisy"

    def decode(self, cache, plan, *, layer, q, k, v):
        slow = 3.0 if random.random() < 0.3 else 1.0
        _ELAPSED[0] += 0.002 * q.shape[0] * 0.99 * slow * random.uniform(0.98, 1.02)
        return super().decode(cache, plan, layer=layer, q=q, k=k, v=v)


class NoisyFast(NaiveBackend):
    """30 % faster than the steady one, with the same 3× spikes (one step in five)."""

    name = "planted_noisy_fast"

    def decode(self, cache, plan, *, layer, q, k, v):
        slow = 3.0 if random.random() < 0.2 else 1.0
        _ELAPSED[0] += 0.002 * q.shape[0] * 0.7 * slow * random.uniform(0.98, 1.02)
        return super().decode(cache, plan, layer=layer, q=q, k=k, v=v)


class _Planted:
    def __init__(self, classes):
        self.classes = classes

    @hookimpl
    def attnbench_backends(self):
        return list(self.classes)


def _registry(*classes) -> Registry:
    reg = load_registry(builtins=False, env={"ATTNBENCH_DISABLE_PLUGIN_AUTOLOAD": "1"})
    plugin = _Planted(classes)
    reg.manager.register(plugin, name="planted")
    reg._add_from(plugin, Source("plugin", "planted", "tests"))
    return reg


@pytest.fixture
def profile() -> DeviceProfile:
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return DeviceProfile(fingerprint("cpu"), 1e10, 1e10, 1, now)  # bandwidth stated, not measured: tests


def _workloads(batches, context=64):
    return [Workload.uniform("tiny-gqa", batch=b, context=context, dtype="fp32") for b in batches]


def test_the_refined_map_locates_a_crossover_between_two_tuned_batches(tmp_path, profile):
    reg = _registry(Steady, Overtaker, Laggard)
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
    # every point's times carry intervals from interleaved samples
    p = m.points[(8, 64)]
    assert all(t.lo_ms <= t.median_ms <= t.hi_ms and t.samples >= 7 for t in p.times.values())


def test_a_narrower_run_keeps_the_full_entrys_winner(tmp_path, profile):
    reg = _registry(Laggard, Steady, Overtaker)  # the laggard is the default (first registered)
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
    tie = tune(
        [w], registry=_registry(Steady, Noisy), results_dir=tmp_path / "a", options=OPTIONS, profile=profile
    )
    (entry,) = tie.entries.values()
    assert entry["winner"]["backend"] == "planted_steady"  # the default, kept
    assert entry["retimed"]["samples"] >= 15  # at least 15 interleaved samples each
    assert all("interval" in c for c in entry["candidates"])
    if entry["tie"]:
        assert "tie: kept the default" in entry["decision"]
    win = tune(
        [w],
        registry=_registry(Steady, NoisyFast),
        results_dir=tmp_path / "b",
        options=OPTIONS,
        profile=profile,
    )
    (entry,) = win.entries.values()
    assert entry["winner"]["backend"] == "planted_noisy_fast" and not entry["tie"]
    iv = entry["winner"]["interval"]
    assert iv["lo_ms"] <= iv["median_ms"] <= iv["hi_ms"]
