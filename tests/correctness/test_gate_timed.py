"""What is timed is checked too: an evader and a too-fast-to-be-true backend never win; lossy is opt-in.

The evader is right whenever the gate looks and returns zeros once it is being timed; the inflated
backend is right but claims to read 1,000,000× the KV bytes it does, so its step is faster than the
device's read bandwidth allows (what a missing device sync or a skipped read looks like). Workers
import them by path, as they import a plugin's backend.
"""

from __future__ import annotations

import pytest
import torch
from helpers.tuning_helpers import planted_registry

import attnbench
from attnbench.backends.naive import NaiveBackend
from attnbench.cli import main
from attnbench.core.kvcache import ContiguousKVCache
from attnbench.core.registry import load_registry
from attnbench.core.workload import Workload
from attnbench.measure.bench import CheckFailed, Implausible, measure_decode, plausibility
from attnbench.tuning import TuneOptions, build_space, tune
from attnbench.tuning.space import backend_refs

WORKLOAD = Workload.uniform("tiny-gqa", batch=1, context=64, dtype="fp32")
FAST = TuneOptions(timeout_s=30.0, warmup=1, repeats=4, num_layers=4)


class Evader(NaiveBackend):
    """Right in the gate (which runs two layers), zeros in a cache of any other depth: being timed."""

    name = "planted_evader"

    def decode(self, cache, plan, *, layer, q, k, v):
        out = super().decode(cache, plan, layer=layer, q=q, k=k, v=v)
        return out if cache.num_layers == 2 else torch.zeros_like(out)


class _InflatedCache(ContiguousKVCache):
    def bytes_per_token(self) -> int:
        return super().bytes_per_token() * 1_000_000


class Inflated(NaiveBackend):
    """Right, but its cache claims 1,000,000× the bytes per token it holds: implausibly fast."""

    name = "planted_inflated"

    def create_cache(self, workload, **kwargs):
        cache = super().create_cache(workload, **kwargs)
        cache.__class__ = _InflatedCache  # naive's own cache, but for what it claims to hold
        return cache


def test_the_evader_is_caught_in_its_timed_run(profile) -> None:
    with pytest.raises(CheckFailed, match="timed step") as info:
        measure_decode(Evader(), WORKLOAD, profile=profile, warmup=1, repeats=4, num_layers=4)
    assert info.value.check.error.rel_l2 > 0.5  # zeros: the whole output is missing


def test_an_honest_backend_passes_its_timed_check(profile) -> None:
    m = measure_decode(NaiveBackend(), WORKLOAD, profile=profile, warmup=1, repeats=4, num_layers=4)
    assert m.timed_check is not None and m.timed_check.passed
    assert "timed step" in m.timed_check.workload and m.timed_check.error.rel_l2 < 1e-5


def test_a_step_faster_than_the_read_bandwidth_is_refused(profile) -> None:
    with pytest.raises(Implausible, match=r"over 1\.5 × the measured read bandwidth"):
        measure_decode(Inflated(), WORKLOAD, profile=profile, warmup=1, repeats=4)
    assert plausibility(kv_bytes=10**9, seconds=1.0, profile=profile) == ""  # 1 GB/s of 10: fine
    why = plausibility(kv_bytes=10**11, seconds=1.0, profile=profile)
    assert "100.0 GB/s" in why and "10.0 GB/s" in why  # the refusal names the numbers
    flops = plausibility(kv_bytes=10**9, seconds=1.0, profile=profile, flops=1e12, peak_flops=1e11)
    assert "1000.0 GFLOP/s" in flops and "matmul peak 100.0 GFLOP/s" in flops
    assert plausibility(kv_bytes=10**9, seconds=1.0, profile=profile, flops=1e10, peak_flops=1e11) == ""


def test_a_stale_profile_is_checked_against_the_bandwidth_measured_again_now() -> None:
    """A profile cached at a slow moment (here: a stated 1 MB/s over a buffer past the last-level
    cache) does not refuse an honest step: the read bandwidth is measured again before refusing."""
    import dataclasses

    from helpers.tuning_helpers import stated_profile

    from attnbench.core.device import last_level_cache_bytes

    stale = dataclasses.replace(
        stated_profile(1e6), buffer_bytes=max(2 * last_level_cache_bytes("cpu"), 2**26)
    )
    assert plausibility(kv_bytes=10**8, seconds=1.0, profile=stale) == ""  # 0.1 GB/s: any memory reads that
    why = plausibility(kv_bytes=10**15, seconds=1.0, profile=stale)  # 1 PB/s: no memory does
    assert "over 1.5 × the measured read bandwidth 0.0 GB/s (measured again now: " in why


def test_neither_the_evader_nor_the_inflated_backend_wins_a_tune(tmp_path, profile) -> None:
    reg = planted_registry(NaiveBackend, Evader, Inflated)
    report = tune([WORKLOAD], registry=reg, results_dir=tmp_path, options=FAST, profile=profile)
    (entry,) = report.entries.values()
    assert entry["winner"]["backend"] == "naive"
    cands = {c["backend"]: c for c in entry["candidates"]}
    assert cands["planted_evader"]["failed"] == "gate" and "timed step" in cands["planted_evader"]["reason"]
    assert cands["planted_inflated"]["failed"] == "implausible"
    assert cands["naive"]["gate"]["calibration"]["rel_l2"] > 0  # the table keeps the gate's numbers
    choice = attnbench.select(WORKLOAD, results_dir=tmp_path, registry=reg)
    assert choice.backend == "naive" and "accuracy: exact" in choice.explain()


def test_lossy_caches_compete_only_when_allowed() -> None:
    reg = load_registry(env={"ATTNBENCH_DISABLE_PLUGIN_AUTOLOAD": "1"})
    w = Workload.uniform("tiny-gqa", batch=1, context=64, dtype="bf16")
    refs = backend_refs(reg)
    shut = build_space(w, refs)
    assert "fp8" not in shut.backends
    assert any(e.backend == "fp8" and "lossy (fp8 e4m3 K/V)" in e.reasons[0] for e in shut.excluded)
    assert "fp8" in build_space(w, refs, allow_lossy=True).backends


def test_tune_without_allow_lossy_never_selects_fp8_and_with_it_says_lossy(tmp_path, capsys) -> None:
    w = ["--model", "tiny-gqa", "--batch", "1", "--context", "64", "--dtype", "bf16"]
    opts = ["--repeats", "3", "--warmup", "1", "--results", str(tmp_path)]
    assert main(["tune", *w, "--backends", "fp8,naive", *opts, "--json"]) == 0
    capsys.readouterr()
    exact = attnbench.select(model="tiny-gqa", batch=1, context=64, dtype="bf16", results_dir=tmp_path)
    assert exact.backend == "naive" and exact.lossy == ""
    # a folder of its own: in the first one the entry would merge naive, re-measured and faster here
    lossy_dir = tmp_path / "lossy"
    lossy_opts = ["--repeats", "3", "--warmup", "1", "--results", str(lossy_dir)]
    assert main(["tune", *w, "--backends", "fp8", *lossy_opts, "--allow-lossy", "--json"]) == 0
    capsys.readouterr()
    lossy = attnbench.select(
        model="tiny-gqa", batch=1, context=64, dtype="bf16", results_dir=lossy_dir, allow_lossy=True
    )
    assert lossy.backend == "fp8" and lossy.lossy == "fp8 e4m3 K/V"
    assert "lossy (fp8 e4m3 K/V), error against exact attention; gate: rel_l2" in lossy.explain()
    still_exact = attnbench.select(model="tiny-gqa", batch=1, context=64, dtype="bf16", results_dir=lossy_dir)
    assert still_exact.backend != "fp8"
    assert any(r.backend == "fp8" and "allow_lossy" in r.reason for r in still_exact.rejected)


@pytest.mark.parametrize(
    ("option", "value"),
    [("--tolerance-multiple", "-2"), ("--tolerance-multiple", "two"), ("--accuracy-budget", "0")],
)
def test_bad_gate_options_get_one_line(option: str, value: str, capsys) -> None:
    code = main(["tune", "--model", "tiny-gqa", "--context", "64", option, value])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert f"{option} {value!r} is not a positive number" in err and "accepted" in err
    assert main(["bench", "--model", "tiny-gqa", "--context", "64", "--tolerance-multiple", "0"]) == 2
    assert "--tolerance-multiple '0' is not a positive number" in capsys.readouterr().err
