"""The latency estimator: bytes and FLOPs against hand-computed values, the formula's pieces, errors."""

from __future__ import annotations

import math

import pytest

from attnbench.cli import main
from attnbench.core.device import DeviceProfile
from attnbench.core.shapes import ModelShape, load_shape
from attnbench.cost.estimate import (
    MoERouting,
    _mean_of_max_linear,
    estimate,
    kv_bytes_per_token_per_gpu,
    list_gpus,
    load_gpu,
    measured_gpu,
)

# -- hand-computed bytes for two presets ------------------------------------------------------------


def test_llama_70b_on_h100_tp2_bytes_by_hand() -> None:
    # llama-3.3-70b: 70,553,706,496 params, vocab 128,256, hidden 8,192, 80 layers, 8 KV heads of 128.
    # embedding table = 128,256 · 8,192 = 1,050,673,152 params (input embedding and LM head, untied)
    # block params = 70,553,706,496 − 2 · 1,050,673,152 = 68,452,360,192
    # weight bytes (bf16, all GPUs) = 68,452,360,192 · 2     (blocks)
    #                               + 1,050,673,152 · 2      (LM head, bf16)
    #                               + 1 · 8,192 · 2          (one embedding row looked up)
    #                               = 136,904,720,384 + 2,101,346,304 + 16,384 = 139,006,083,072
    # per GPU (tp 2) = 69,503,041,536
    # KV per token, all GPUs = 80 layers · 2 (K, V) · 8 heads · 128 · 2 B = 327,680 B;
    # per GPU 8 / 2 = 4 heads → 163,840 B; a step at context 8192 reads 8,193 tokens → 1,342,341,120 B
    est = estimate("llama-3.3-70b", gpu="h100", tp=2, batch=1, context=8192, new_tokens=250)
    assert est.step.weight_bytes == 69_503_041_536
    assert est.kv_bytes_per_token == 163_840
    assert est.step.kv_bytes == 1_342_341_120
    # times at 0.8 · 3.35 TB/s = 2.68e12 B/s
    assert est.step.weight_s == pytest.approx(69_503_041_536 / 2.68e12)
    assert est.step.kv_s == pytest.approx(1_342_341_120 / 2.68e12)
    # plus the fixed cost: 2.7 ms engine host work + 80 layers · 12 kernels · 2 µs = 4.62 ms
    assert est.step.fixed_s == pytest.approx(2.7e-3 + 80 * 12 * 2e-6)
    assert est.itl_s == pytest.approx(est.step.fixed_s + (69_503_041_536 + 1_342_341_120) / 2.68e12)
    assert est.step.bound == "memory"
    # the round numbers: ~140 GB of weights, ~2.7 GB for an 8k cache (both GPUs together)
    assert 2 * est.step.weight_bytes == pytest.approx(140e9, rel=0.01)
    assert 8192 * 2 * est.kv_bytes_per_token == pytest.approx(2.68e9, rel=0.01)
    # KV overtakes weights when batch · (context + 1) > 69,503,041,536 / 163,840 = 424,212.9 tokens
    assert est.crossover_tokens == pytest.approx(69_503_041_536 / 163_840)


def test_llama_8b_on_h200_fp8_kv_batch8_bytes_by_hand() -> None:
    # llama-3.1-8b: 8,030,261,248 params, vocab 128,256, hidden 4,096, 32 layers, 8 KV heads of 128.
    # embedding table = 128,256 · 4,096 = 525,336,576
    # block params = 8,030,261,248 − 2 · 525,336,576 = 6,979,588,096
    # weights (bf16) = 6,979,588,096 · 2 + 525,336,576 · 2 + 8 rows · 4,096 · 2
    #                = 13,959,176,192 + 1,050,673,152 + 65,536 = 15,009,914,880
    # KV per token in fp8 = 32 · 2 · 8 · 128 · 1 B = 65,536 B
    # a step at context 4096, batch 8 reads 8 · 4,097 = 32,776 tokens · 65,536 B = 2,148,007,936 B
    est = estimate("llama-3.1-8b", gpu="h200", batch=8, context=4096, new_tokens=100, kv_dtype="fp8")
    assert est.step.weight_bytes == 15_009_914_880
    assert est.kv_bytes_per_token == 65_536
    assert est.step.kv_bytes == 2_148_007_936
    # 0.8 · 4.8 TB/s = 3.84e12 B/s
    fixed = 2.7e-3 + 32 * 12 * 2e-6  # engine host work + launches (gpus.yaml)
    assert est.itl_s == pytest.approx(fixed + (15_009_914_880 + 2_148_007_936) / 3.84e12)


def test_deepseek_v3_latent_cache_and_fp8_weights_by_hand() -> None:
    # MLA latent row per layer: kv_lora_rank 512 + qk_rope_head_dim 64 = 576 values;
    # 61 layers · 576 · 2 B = 70,272 B per token, replicated on each of the 8 GPUs (one shared head).
    # weights: activated 37,000,000,000 − 2 · (129,280 · 7,168 = 926,679,040) = 35,146,641,920 block params
    # in fp8 (1 B) + LM head 926,679,040 · 2 B + 1 row · 7,168 · 2 B = 37,000,014,336 B; per GPU / 8
    est = estimate("deepseek-v3", gpu="h200", tp=8, batch=1, context=4096, new_tokens=10, weight_dtype="fp8")
    assert est.kv_bytes_per_token == 70_272
    assert est.step.kv_bytes == 4097 * 70_272
    assert est.step.weight_bytes == 37_000_014_336 / 8
    assert any("replicated" in n for n in est.notes)
    assert any("MoE" in n for n in est.notes)  # the batch-1 assumption is stated


def test_gqa_kv_heads_fewer_than_tp_are_replicated() -> None:
    shape = load_shape("llama-3.1-8b")  # 8 KV heads
    # tp 16: each GPU holds one KV head: 32 layers · 2 · 1 · 128 · 2 B = 16,384 B
    assert kv_bytes_per_token_per_gpu(shape, tp=16) == 16_384
    assert kv_bytes_per_token_per_gpu(shape, tp=4) == 32 * 2 * 2 * 128 * 2
    est = estimate(shape, gpu="b200", tp=16, batch=1, context=1024, new_tokens=1)
    assert any("replicated" in n for n in est.notes)


# -- the formula's pieces -----------------------------------------------------------------------------


def test_fp8_kv_halves_kv_bytes_and_gqa_saves_its_group_size() -> None:
    bf16 = estimate("llama-3.1-8b", gpu="h100", batch=16, context=32768, new_tokens=10)
    fp8 = estimate("llama-3.1-8b", gpu="h100", batch=16, context=32768, new_tokens=10, kv_dtype="fp8")
    assert fp8.step.kv_bytes * 2 == bf16.step.kv_bytes
    assert fp8.itl_s < bf16.itl_s
    base = load_shape("llama-3.1-8b")
    mha = ModelShape.from_dict({**base.fields(), "num_kv_heads": 32}, name="llama-3.1-8b-mha")
    full = estimate(mha, gpu="h100", batch=16, context=32768, new_tokens=10)
    assert full.step.kv_bytes == 4 * bf16.step.kv_bytes  # 32 query heads share 8 KV heads
    assert full.crossover_tokens == pytest.approx(bf16.crossover_tokens / 4)


def test_token_counts_accept_suffixes() -> None:
    a = estimate("llama-3.1-8b", gpu="h100", batch=1, context="8k", new_tokens="1k")
    b = estimate("llama-3.1-8b", gpu="h100", batch=1, context=8192, new_tokens=1024)
    assert a.e2e_s == b.e2e_s
    with pytest.raises(ValueError, match="--context 'eight' is not a token count"):
        estimate("llama-3.1-8b", gpu="h100", batch=1, context="eight", new_tokens=1)


def test_crossover_is_where_kv_equals_weights() -> None:
    est = estimate("llama-3.1-8b", gpu="h100", batch=4, context=1024, new_tokens=1)
    ctx = round(est.crossover_context)
    at = estimate("llama-3.1-8b", gpu="h100", batch=4, context=ctx, new_tokens=1)
    assert at.step.kv_bytes == pytest.approx(at.step.weight_bytes, rel=1e-4)


def test_e2e_is_ttft_plus_n_mean_itl_and_mean_lies_between_first_and_last() -> None:
    est = estimate("llama-3.1-8b", gpu="a100", batch=32, context=16384, new_tokens=2000)
    last = estimate("llama-3.1-8b", gpu="a100", batch=32, context=16384 + 1999, new_tokens=1)
    assert est.e2e_s == pytest.approx(est.ttft_s + 2000 * est.itl_mean_s)
    assert est.itl_s < est.itl_mean_s < last.itl_s
    assert est.tokens_per_s == pytest.approx(32 / est.itl_mean_s)
    assert est.prefill.bound == "compute"


@pytest.mark.parametrize(
    ("a0", "a1", "b0", "b1"), [(1, 0.5, 10, 0.1), (5, 0.1, 1, 0.2), (1, 1, 2, 1), (3, 0, 3, 0)]
)
def test_mean_of_max_linear_matches_brute_force(a0: float, a1: float, b0: float, b1: float) -> None:
    lo, n = 3, 57
    brute = sum(max(a0 + a1 * c, b0 + b1 * c) for c in range(lo, lo + n)) / n
    assert _mean_of_max_linear(a0, a1, b0, b1, lo, n) == pytest.approx(brute)


def test_large_batch_is_compute_bound_on_flops() -> None:
    # batch 1024 of short contexts: 2 · 8e9 · 1024 FLOPs ≈ 16 TFLOP per step vs 16 GB of weights
    est = estimate("llama-3.1-8b", gpu="h100", batch=1024, context=128, new_tokens=1)
    assert est.step.bound == "compute"
    assert est.itl_s == pytest.approx(est.step.fixed_s + est.step.flop_s)


def test_fp8_weights_on_a100_fall_back_to_bf16_flops() -> None:
    a100 = load_gpu("a100")
    assert a100.peak_flops("fp8") == (312e12, "bf16")
    est = estimate("llama-3.1-8b", gpu="a100", batch=1, context=1024, new_tokens=1, weight_dtype="fp8")
    assert any("no fp8 tensor cores" in n for n in est.notes)


def test_moe_routing_grows_weight_reads_with_batch() -> None:
    routing = MoERouting(num_experts=256, top_k=8)
    assert routing.experts_touched(1) == pytest.approx(8)
    one = estimate("deepseek-v3", gpu="h200", tp=8, batch=1, context=1024, new_tokens=1, moe=routing)
    plain = estimate("deepseek-v3", gpu="h200", tp=8, batch=1, context=1024, new_tokens=1)
    assert one.step.weight_bytes == pytest.approx(plain.step.weight_bytes)
    big = estimate("deepseek-v3", gpu="h200", tp=8, batch=256, context=1024, new_tokens=1, moe=routing)
    shape = load_shape("deepseek-v3")
    all_weights = (shape.num_params * 2 + 256 * shape.hidden_size * 2) / 8
    assert one.step.weight_bytes * 5 < big.step.weight_bytes < all_weights
    # 256 · (1 − (1 − 8/256)^256) ≈ 255.9 of 256 experts touched: nearly every weight is read
    assert big.step.weight_bytes == pytest.approx(all_weights, rel=0.01)


def test_memory_that_does_not_fit_is_said() -> None:
    est = estimate(
        "llama-3.3-70b", gpu="h100", batch=1, context=8192, new_tokens=1
    )  # 140 GB on one 80 GB GPU
    assert any("does not fit" in n for n in est.notes)


# -- presets, 'this', errors ------------------------------------------------------------------------


def test_presets_and_aliases() -> None:
    assert set(list_gpus()) == {"a100-80gb", "h100-sxm", "h200", "b200"}
    for alias, name in [("h100", "h100-sxm"), ("A100", "a100-80gb"), ("H200", "h200"), ("b200", "b200")]:
        assert load_gpu(alias).name == name
    h100 = load_gpu("h100-sxm")
    assert h100.memory_bandwidth == 3.35e12 and h100.flops == {"bf16": 989.5e12, "fp8": 1979e12}
    assert load_gpu("h100", achievable=0.5).achievable == 0.5


def test_this_uses_the_measured_profile(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("ATTNBENCH_CACHE_DIR", str(tmp_path))
    fake = DeviceProfile({"name": "cpu-under-test"}, 5e9, 6e9, 1, "now")
    monkeypatch.setattr("attnbench.cost.gpuspec.load_profile", lambda device=None, remeasure=False: fake)
    calls = []
    monkeypatch.setattr("attnbench.cost.gpuspec.matmul_peak", lambda dev, dt: calls.append(dt) or 1e11)
    gpu = measured_gpu("cpu")
    assert gpu.memory_bandwidth == 5e9 and gpu.achievable == 1.0 and gpu.measured
    assert gpu.flops["bf16"] == 1e11
    measured_gpu("cpu")  # the matmul figure is cached per fingerprint
    assert len(calls) == 2  # bf16 and fp32, once
    est = estimate("tiny-gqa", gpu="this", batch=1, context=100, new_tokens=1)
    assert est.gpu.name == "this"
    assert est.step.kv_s == pytest.approx(est.step.kv_bytes / 5e9)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gpu": "h300"}, "unknown GPU 'h300'; presets: a100-80gb, h100-sxm, h200, b200, this"),
        ({"tp": 3}, "--tp 3 does not divide num_heads 32"),
        ({"tp": 0}, "--tp = 0 must be an integer ≥ 1"),
        ({"batch": 0}, "--batch = 0 must be an integer ≥ 1"),
        ({"kv_dtype": "int4"}, "--kv-dtype 'int4' not accepted; accepted: bf16, fp8"),
        ({"weight_dtype": "fp32"}, "--weight-dtype 'fp32' not accepted"),
        ({"achievable": 1.5}, "--achievable = 1.5 must be a fraction in (0, 1]"),
        ({"prompt_len": 5000}, "--prompt-len 5000 must be ≤ --context 4096"),
        ({"moe": MoERouting(8, 2)}, "MoE routing given, but 'llama-3.1-8b' is dense"),
    ],
)
def test_bad_values_are_named(kwargs: dict, message: str) -> None:
    args = {"gpu": "h100", "batch": 1, "context": 4096, "new_tokens": 1} | kwargs
    with pytest.raises((ValueError, LookupError)) as err:
        estimate("llama-3.1-8b", **args)
    assert message in str(err.value)


def test_moe_routing_validates() -> None:
    with pytest.raises(ValueError, match="top-k 8 must be in 1..7"):
        MoERouting(num_experts=8, top_k=8)


# -- the CLI --------------------------------------------------------------------------------------------


def test_cli_must_show_example(capsys: pytest.CaptureFixture[str]) -> None:
    argv = "estimate --model llama-3.3-70b --gpu h100 --tp 2 --batch 1 --context 8192 --new-tokens 250"
    assert main(argv.split()) == 0
    out = capsys.readouterr().out
    for label in ("weight reads", "KV reads", "FLOP bound", "TTFT", "end-to-end", "KV overtakes weights"):
        assert label in out
    assert "69.503 GB" in out and "1.342 GB" in out


def test_cli_json_matches_library(cli_json) -> None:  # type: ignore[no-untyped-def]
    argv = "estimate -m llama-3.1-8b --gpu h200 -b 8 -c 8k --prompt-len 2k -n 64 --kv-dtype fp8"
    data = cli_json(*argv.split())
    est = estimate(
        "llama-3.1-8b", gpu="h200", batch=8, context=8192, prompt_len=2048, new_tokens=64, kv_dtype="fp8"
    )
    assert data["step"]["kv_bytes"] == est.step.kv_bytes
    assert data["e2e_s"] == pytest.approx(est.e2e_s)
    assert data["prompt_len"] == 2048 and math.isfinite(data["ttft_s"])


def test_cli_errors_are_one_clear_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["estimate", "--model", "llama-3.1-8b", "--gpu", "h300", "--context", "1k", "--new-tokens", "1"])
        == 2
    )
    err = capsys.readouterr().err
    assert "unknown GPU 'h300'; presets: a100-80gb, h100-sxm, h200, b200, this" in err
    assert "Traceback" not in err
    h100_8b = ["estimate", "--model", "llama-3.1-8b", "--gpu", "h100", "-c", "1k", "-n", "1"]
    assert main([*h100_8b, "--moe-experts", "8"]) == 2
    assert "--moe-experts and --moe-top-k go together" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*h100_8b, "--achievable", "2"])
    assert "--achievable '2' must be a fraction in (0, 1]" in capsys.readouterr().err


# -- the docs ---------------------------------------------------------------------------------------------


def test_latency_model_docs_show_current_cli_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ``<!-- example: … -->`` block in docs/latency-model.md is what the CLI prints today."""
    from pathlib import Path

    from helpers.script_module import load_script

    root = Path(__file__).resolve().parents[2]
    module = load_script("latency_model_docs")
    monkeypatch.chdir(root)
    monkeypatch.setenv("COLUMNS", "118")
    page = (root / "docs" / "latency-model.md").read_text()
    assert page.count("<!-- example:") >= 7
    assert module.render(page) == page, (
        "docs/latency-model.md is stale: run python scripts/latency_model_docs.py"
    )


# -- the published anchors ------------------------------------------------------------------------------


def test_vllm_llama_8b_h100_anchor_fixed_part_and_slope_within_15_percent() -> None:
    # vLLM's fit for Llama-3.1-8B (fp8 weights, bf16 KV) on one H100, batch 1:
    # ITL ≈ 6.44 ms + 43.7 µs per 1k context tokens. The estimate is linear in context; fit it the same way.
    def itl(context: int) -> float:
        return estimate(
            "llama-3.1-8b", gpu="h100", batch=1, context=context, new_tokens=1, weight_dtype="fp8"
        ).itl_s

    slope_per_1k = (itl(65_536) - itl(1_024)) / 64
    intercept = itl(1_024) - slope_per_1k
    assert intercept == pytest.approx(6.44e-3, rel=0.15)
    assert slope_per_1k == pytest.approx(43.7e-6, rel=0.15)
    # the fixed part is the documented fixed cost, not a change of bandwidth: the weight reads stay
    # bytes / (0.8 · 3.35 TB/s)
    est = estimate("llama-3.1-8b", gpu="h100", batch=1, context=1, new_tokens=1, weight_dtype="fp8")
    assert est.step.weight_s == pytest.approx(est.step.weight_bytes / 2.68e12)
    assert est.step.fixed_s == pytest.approx(2.7e-3 + 32 * 12 * 2e-6)


def test_llama_70b_on_two_h100_stays_in_its_band() -> None:
    # bf16, batch 1, 8k context: the weight-read roofline alone is 26.43 ms; with the fixed cost the ITL
    # must stay within the roofline … +25 % (26.4 – 33.0 ms; ~30 tokens/s per sequence)
    est = estimate("llama-3.3-70b", gpu="h100", tp=2, batch=1, context=8192, new_tokens=250)
    floor = est.step.memory_s
    assert floor == pytest.approx(26.43e-3, rel=1e-3)
    assert floor < est.itl_s <= 1.25 * floor
    assert 26.4e-3 < est.itl_s < 33.0e-3
