"""measure_decode() and the ``attnbench bench`` / ``attnbench decode`` commands (small shapes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from attnbench.backends.naive import NaiveBackend
from attnbench.cli import main
from attnbench.core import device as device_mod
from attnbench.core.device import DeviceProfile
from attnbench.core.workload import Workload
from attnbench.measure.bench import CheckFailed, DecodeMeasurement, check_workload, measure_decode

SMALL_BUFFER = 4 * 2**20


@pytest.fixture
def small_profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private profile cache whose bandwidth measurements use a small buffer (fast)."""
    monkeypatch.setenv("ATTNBENCH_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("ATTNBENCH_LLC_BYTES", str(2**20))  # small eviction buffers
    real = device_mod.measure_bandwidth

    def small(device="cpu", *, nbytes=None):  # type: ignore[no-untyped-def]
        return real(device, nbytes=SMALL_BUFFER)

    monkeypatch.setattr(device_mod, "measure_bandwidth", small)
    return tmp_path


class NoisyNaive(NaiveBackend):
    """Naive with an error far beyond the tolerance: must fail the gate and never be timed."""

    name = "noisy"
    timed_calls = 0

    def decode(self, cache, plan, *, layer, q, k, v):  # type: ignore[override]
        type(self).timed_calls += 1
        return super().decode(cache, plan, layer=layer, q=q, k=k, v=v) + 0.05


class InterpretedNaive(NaiveBackend):
    name = "interp"

    def interpreted(self, workload: Workload) -> bool:
        return True


@pytest.fixture(autouse=True)
def small_llc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNBENCH_LLC_BYTES", str(2**20))


def test_measure_decode_fields_and_bytes(profile: DeviceProfile) -> None:
    workload = Workload.uniform("tiny-gqa", batch=2, context=96, dtype="fp32")
    m = measure_decode(NaiveBackend(), workload, profile=profile, warmup=1, repeats=4)
    assert isinstance(m, DecodeMeasurement)
    assert m.timed and m.step is not None and m.step.repeats == 4
    assert m.check is not None and m.check.passed and m.check.workload == workload.describe()
    assert m.num_layers == workload.shape.num_layers and 1 <= m.layers_materialised <= m.num_layers
    # the context grows by one token a step: the timed steps read between these bounds
    growth = workload.shape.kv_bytes_per_token("fp32") * workload.batch
    lo = workload.kv_bytes_per_step()
    assert lo < m.kv_bytes < lo + (1 + 4) * growth
    assert m.gbps == pytest.approx(m.kv_bytes / m.step.median_s / 1e9)
    assert m.pct_of_bandwidth == pytest.approx(100 * m.gbps * 1e9 / 1e10)
    d = json.loads(json.dumps(m.as_dict()))
    assert d["step"]["median_s"] > 0 and d["check"]["passed"] is True
    assert d["implementation"] == "torch.matmul" and d["layers_materialised"] == m.layers_materialised
    assert m.llc_flushed  # the tiny cache is far under 4 × the (1 MiB) last-level cache


def test_large_cache_is_not_flushed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNBENCH_LLC_BYTES", "1024")
    workload = Workload.uniform("tiny-gqa", batch=2, context=96, dtype="fp32")
    m = measure_decode(NaiveBackend(), workload, check=False, repeats=3)
    assert not m.llc_flushed


def test_measure_decode_without_profile_or_check() -> None:
    workload = Workload.uniform("tiny-mla", batch=1, context=40, dtype="bf16")
    m = measure_decode(NaiveBackend(), workload, check=False, repeats=3, num_layers=5)
    assert m.check is None and m.pct_of_bandwidth is None and m.num_layers == 5


def test_failed_check_raises_with_numbers_and_is_never_timed() -> None:
    workload = Workload.uniform("tiny-gqa", batch=1, context=32, dtype="fp32")
    NoisyNaive.timed_calls = 0
    with pytest.raises(CheckFailed, match="failed the correctness gate") as info:
        measure_decode(NoisyNaive(), workload)
    check = info.value.check
    assert not check.passed and check.error.max_abs > 1e-2
    assert check.decode_steps >= 2  # a random step and at least one needle-probe step
    gate_calls = check.decode_steps * 2  # the gate's decode steps over two layers, nothing more
    assert NoisyNaive.timed_calls == gate_calls


def test_interpreted_backend_is_checked_not_timed() -> None:
    workload = Workload.uniform("tiny-gqa", batch=1, context=32, dtype="fp32")
    m = measure_decode(InterpretedNaive(), workload)
    assert not m.timed and m.step is None and "never timed" in m.note
    assert m.check is not None and m.check.passed
    assert m.as_dict()["gbps"] is None


def test_unsupported_workload_names_the_reason() -> None:
    # fp8 is no longer a compute dtype a workload can hold; MLA's Dk != Dv is something flash refuses
    from attnbench.backends.flash import FlashBackend

    workload = Workload.uniform("tiny-mla", batch=1, context=32, dtype="fp32")
    with pytest.raises(
        ValueError, match=r"backend 'flash' cannot run .*key head_dim 24 != value head_dim 16"
    ):
        measure_decode(FlashBackend(), workload)


def test_check_workload_shrinks_batch_then_kv_heads_never_the_context() -> None:
    big = Workload.uniform("llama-3.1-8b", batch=8, context="32k", dtype="fp32")
    full = check_workload(big, budget_bytes=2**50)
    assert full is big
    smaller = check_workload(big, budget_bytes=3 * 2**30)
    assert smaller.batch < 8 and smaller.context == 32768 and smaller.shape.num_kv_heads == 8
    long = Workload.uniform("llama-3.1-8b", batch=4, context="128k", dtype="fp32")
    tiny = check_workload(long, budget_bytes=2**30)
    assert tiny.batch == 1 and tiny.context == 131072  # the full context, always
    assert 2 <= tiny.shape.num_kv_heads < 8  # fewer KV heads, at least two (a head mix-up shows)
    assert tiny.shape.num_heads // tiny.shape.num_kv_heads == 4  # query heads per KV head kept
    same = Workload.uniform("tiny-gqa", batch=4, context=64)
    assert check_workload(same) is same


# -- the command line ----------------------------------------------------------------------------
def _bench_json(capsys: pytest.CaptureFixture[str], *extra: str) -> dict:
    argv = ["bench", "--model", "tiny-gqa", "--batch", "1,2", "--context", "48", "--dtype", "fp32", "--json"]
    assert main([*argv, "--repeats", "2", "--warmup", "1", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_bench_json_schema(small_profile: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = _bench_json(capsys, "--backends", "naive,flash")
    assert set(report) >= {"command", "date", "device", "load_avg_start", "load_avg_end", "results"}
    assert report["command"].startswith("attnbench bench --model tiny-gqa --batch 1,2")
    assert report["device"]["fingerprint"]["kind"] == "cpu" and report["device"]["copy_bandwidth"] > 0
    rows = report["results"]
    assert [(r["batch"], r["backend"]) for r in rows] == [
        (1, "naive"),
        (1, "flash"),
        (2, "naive"),
        (2, "flash"),
    ]
    for r in rows:
        assert r["status"] in ("timed", "unsupported"), r
        if r["status"] == "timed":
            assert set(r) >= {"check", "step", "kv_bytes", "gbps", "pct_of_bandwidth", "speedup_vs_naive"}
            assert r["check"]["passed"] and r["step"]["median_s"] > 0 and r["step"]["p90_s"] > 0
            assert r["pct_of_bandwidth"] == pytest.approx(
                100 * r["gbps"] * 1e9 / report["device"]["copy_bandwidth"]
            )
    naive = [r for r in rows if r["backend"] == "naive"]
    assert all(r["speedup_vs_naive"] == 1.0 for r in naive)


def test_bench_measures_the_read_bandwidth_around_each_timed_row(
    small_profile: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # a read bandwidth that falls by 10 % at every measurement: the profile takes the first figure,
    # and each row's share is of the mean of the figures right before and right after it
    reads = [1e10 * 0.9**i for i in range(100)]
    calls = iter(reads)
    monkeypatch.setattr(device_mod, "_read_rate", lambda src: next(calls))
    report = _bench_json(capsys, "--backends", "naive,flash")
    assert report["device"]["read_bandwidth"] == reads[0]
    timed = [r for r in report["results"] if r["status"] == "timed"]
    assert len(timed) == len(report["results"]) == 4
    for i, r in enumerate(timed):
        before, after = reads[1 + 2 * i], reads[2 + 2 * i]
        assert r["read_around"] == {
            "before_bps": pytest.approx(before),
            "after_bps": pytest.approx(after),
            "mean_bps": pytest.approx((before + after) / 2),
        }
        assert r["pct_of_read"] == pytest.approx(100 * r["gbps"] * 1e9 / ((before + after) / 2))


def test_the_read_meter_refuses_a_buffer_the_cache_would_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNBENCH_LLC_BYTES", str(2**20))
    assert device_mod.ReadMeter("cpu", 2**20)() is None  # would measure the cache, not memory
    meter = device_mod.ReadMeter("cpu", 4 * 2**20)
    assert meter.available and meter() > 0


def test_bench_save_writes_table_and_json(small_profile: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prefix = small_profile / "out" / "bench-cpu-tiny-1.2"
    _bench_json(capsys, "--backends", "naive", "--save", str(prefix))
    data = json.loads(Path(f"{prefix}.json").read_text())
    text = Path(f"{prefix}.md").read_text()
    assert data["results"][0]["backend"] == "naive"
    assert "attnbench bench --model tiny-gqa" in text and data["device"]["id"] in text
    assert "load average" in text and "naive" in text


BENCH = ["bench", "--model", "tiny-gqa", "--context", "32"]
DECODE = ["decode", "--model", "tiny-gqa", "--prompt-len", "8", "--new-tokens", "3"]


def _bad(base: list[str], args: list[str], message: str) -> object:
    return pytest.param([*base, *args], message, id=" ".join([base[0], *args]))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        _bad(BENCH, ["--backends", "flsh"], "unknown backend 'flsh'; registered: naive"),
        _bad(BENCH, ["--batch", "0"], "--batch '0' must be > 0"),
        _bad(BENCH, ["--context", "8q"], "--context '8q' is not a token count"),
        _bad(BENCH, ["--dtype", "fp64"], "accepted: bf16"),
        _bad(BENCH, ["--repeats", "0"], "--repeats = 0 must be ≥ 1"),
        _bad(BENCH, ["--model", "llama-9"], "presets: llama-3.1-8b"),
        _bad(DECODE, ["--new-tokens", "1"], "--new-tokens '1' must be ≥ 2"),
        _bad(DECODE, ["--prompt-len", "x"], "--prompt-len 'x' is not a token count"),
        _bad(DECODE, ["--backend", "nope"], "unknown backend 'nope'"),
        _bad(
            DECODE, ["--dtype", "fp8"], "field 'dtype' = 'fp8': compute dtype must be one of bf16, fp16, fp32"
        ),
        _bad(DECODE, ["--backend", "mla"], "backend 'mla' cannot run"),
    ],
)
def test_bench_and_decode_bad_input(
    argv: list[str], message: str, small_profile: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_decode_command_json(small_profile: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["decode", "--model", "tiny-gqa", "--prompt-len", "64", "--new-tokens", "6", "--batch", "2"]
    assert main([*argv, "--dtype", "fp32", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["new_tokens"] == 6 and r["decode_steps"] == 5 and r["batch"] == 2
    assert r["check"]["passed"] and r["ttft_s"] > 0 and r["itl_p50_s"] > 0
    assert r["e2e_check_s"] == pytest.approx(r["ttft_s"] + 5 * r["itl_mean_s"])
    assert r["e2e_within_10pct"] == (abs(r["e2e_s"] / r["e2e_check_s"] - 1) <= 0.10)


def test_decode_command_table(small_profile: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["decode", "--model", "tiny-gqa", "--prompt-len", "32", "--new-tokens", "4", "--backend", "flash"]
    assert main([*argv, "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "TTFT" in out and "ITL p50" in out and "TTFT + 3·ITL mean" in out and "torch.sdpa[flash]" in out


def test_bench_remeasure_measures_again(small_profile: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    calls: list[int] = []
    inner = device_mod.measure_bandwidth

    def counting(device="cpu", *, nbytes=None):  # type: ignore[no-untyped-def]
        calls.append(1)
        return inner(device, nbytes=nbytes)

    monkeypatch.setattr(device_mod, "measure_bandwidth", counting)
    first = _bench_json(capsys, "--backends", "naive")
    second = _bench_json(capsys, "--backends", "naive")
    assert len(calls) == 1 and first["device"] == second["device"]
    third = _bench_json(capsys, "--backends", "naive", "--remeasure")
    assert len(calls) == 2 and third["device"]["id"] == first["device"]["id"]
    assert torch.get_num_threads() >= 1


def test_bench_says_which_bound_applies(small_profile: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "--model", "tiny-mla", "--batch", "2", "--context", "40", "--dtype", "fp32", "--json"]
    assert main([*argv, "--backends", "naive,mla", "--repeats", "2", "--warmup", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows, bandwidth = report["results"], report["device"]["copy_bandwidth"]
    assert {r["backend"] for r in rows} == {"naive", "mla"}
    for r in rows:
        roof = r["roofline"]
        memory, compute = roof["memory_floor_s"], roof["compute_floor_s"]
        assert roof["bound"] == ("compute" if compute > memory else "memory")
        assert memory == pytest.approx(r["kv_bytes"] / bandwidth)
        if r["step"]:  # mla's Triton kernel is interpreted under the tests: checked, not timed
            assert roof["x_floor"] == pytest.approx(r["step"]["median_s"] / max(memory, compute))
        else:
            assert r["status"] == "checked-only" and roof["x_floor"] is None
    naive, mla = (next(r for r in rows if r["backend"] == b) for b in ("naive", "mla"))
    # absorbed MLA does more FLOPs per cached byte than the expanded layout: that is why it can turn compute-bound
    assert mla["roofline"]["flops"] / mla["kv_bytes"] > naive["roofline"]["flops"] / naive["kv_bytes"]


def test_a_measurement_resolves_its_backend_once() -> None:
    """The gate, the synthetic model and the report read one Resolution: supports() runs once."""
    calls: list[Workload] = []

    class Counting(NaiveBackend):
        name = "planted_counting"

        def supports(self, workload):  # type: ignore[no-untyped-def]
            calls.append(workload)
            return super().supports(workload)

    w = Workload.uniform("tiny-gqa", batch=1, context=32, dtype="fp32")
    m = measure_decode(Counting(), w, warmup=1, repeats=2, num_layers=2)
    assert m.check is not None and m.check.passed and m.timed
    assert len(calls) == 1, f"supports() ran {len(calls)} times for one measurement"


class WrongLayerNaive(NaiveBackend):
    """Correct over the gate's two-layer cache; over more layer caches it reads the next layer's cache
    (the bug the timed step's check must see: every layer cache holds different data)."""

    name = "wrong_layer"

    def decode(self, cache, plan, *, layer, q, k, v):  # type: ignore[override]
        if cache.num_layers > 2:
            layer = (layer + 1) % cache.num_layers
        return super().decode(cache, plan, layer=layer, q=q, k=k, v=v)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_backend_reading_another_layers_cache_fails_the_timed_steps_check(dtype, monkeypatch) -> None:
    monkeypatch.setenv("ATTNBENCH_LLC_BYTES", str(2**30))  # every layer materialised: 6 caches
    workload = Workload.uniform("tiny-gqa", batch=2, context=96, dtype=dtype)
    ok = measure_decode(NaiveBackend(), workload, repeats=3, num_layers=6)
    assert ok.check is not None and ok.check.passed and ok.layers_materialised == 6
    with pytest.raises(CheckFailed):
        measure_decode(WrongLayerNaive(), workload, repeats=3, num_layers=6)
