"""attnbench.cost.generation: a decoder's parameters from its config, the calibration record, monotone
predictions, and a tiny model calibrated and predicted end to end (no speed targets)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import statistics
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from attnbench.cost import generation
from attnbench.cost.generation import GenerationCalibration, ModelCost, predict_generation
from attnbench.cost.generation_calibration import calibrate_generation

transformers = pytest.importorskip("transformers")

SMALL = dict(
    vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=24,
)  # fmt: skip


@pytest.mark.parametrize(
    ("model_type", "extra"),
    [
        ("llama", {}),
        ("llama", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True}),
        ("mistral", {}),
        ("qwen2", {"tie_word_embeddings": True}),
        ("qwen2", {"tie_word_embeddings": False}),
        ("qwen3", {"attention_bias": True}),
    ],
)
def test_model_cost_counts_parameters_as_the_model_does(model_type: str, extra: dict) -> None:
    config = transformers.AutoConfig.for_model(model_type, **SMALL, **extra)
    hf = transformers.AutoModelForCausalLM.from_config(config)
    cost = ModelCost.from_hf_config(config)
    assert cost.num_params == sum(p.numel() for p in hf.parameters())
    assert ModelCost.from_hf_config(config.to_dict()) == cost  # a config.json mapping reads the same
    linears = {n: m for n, m in hf.named_modules() if isinstance(m, torch.nn.Linear) and ".layers.0." in n}
    want = {
        n.rsplit(".", 1)[-1]: (m.in_features, m.out_features, m.bias is not None) for n, m in linears.items()
    }
    assert {x.name: (x.in_features, x.out_features, x.bias) for x in cost.layer_linears()} == want
    unread = 0 if cost.tie_word_embeddings else cost.vocab_size * cost.hidden_size
    assert cost.weight_bytes("bf16") == 2 * (cost.num_params - unread)


def test_qwen25_05b_geometry_counts_its_published_parameters() -> None:
    config = {
        "model_type": "qwen2", "num_hidden_layers": 24, "hidden_size": 896, "intermediate_size": 4864,
        "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True,
    }  # fmt: skip
    cost = ModelCost.from_hf_config(config, name="Qwen2.5-0.5B")
    assert (cost.head_dim, cost.num_params) == (64, 494_032_768)  # 0.49B, 0.36B without the embedding
    assert cost.shape().kv_bytes_per_token("bf16") == 24 * 2 * 2 * 64 * 2


def test_model_cost_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="model_type.*'gpt2'.*accepted: llama"):
        ModelCost.from_hf_config({**SMALL, "model_type": "gpt2", "num_hidden_layers": 2})
    with pytest.raises(ValueError, match="'num_layers' = None"):
        ModelCost.from_hf_config(
            {k: v for k, v in SMALL.items() if k != "num_hidden_layers"} | {"model_type": "llama"}
        )
    with pytest.raises(ValueError, match="num_kv_heads' = 3 must divide num_heads 4"):
        ModelCost.from_hf_config({**SMALL, "model_type": "llama", "num_key_value_heads": 3})


def _model(layers: int = 24) -> ModelCost:
    return ModelCost(
        name="qwen-ish", model_type="qwen2", num_layers=layers, hidden_size=896, intermediate_size=4864,
        num_heads=14, num_kv_heads=2, head_dim=64, vocab_size=151936, tie_word_embeddings=True, qkv_bias=True,
    )  # fmt: skip


def _calibration(model: ModelCost) -> GenerationCalibration:
    """A hand-made record (no measurement): at batch 4 some linears time *faster* than at batch 1, as noise
    can make them; predictions must still not fall with batch."""
    linears = []
    for layer in [*model.layer_linears(), model.lm_head]:
        per_row = 1e-9 * layer.params
        for rows, s in ((1, 40 * per_row), (4, 35 * per_row), (320, 320 * per_row), (1280, 1300 * per_row)):
            if layer.name != "lm_head" or rows < 5:
                linears.append(
                    generation.LinearTime(
                        layer.name, layer.in_features, layer.out_features, layer.bias, rows, s
                    )
                )
    point = generation.FramePoint("decode", 1, 3, 65.0, 0.002)
    paths = tuple(
        generation.PathCalibration(
            path,
            "hand-made",
            (
                generation.DecodeFit(1, 1e-3, 2e-4, 3e-8, 0.01),
                generation.DecodeFit(4, 9e-4, 2.5e-4, 1.1e-7, 0.02),
            ),
            generation.PrefillFit(2e-4, 1e-6, 2e-9, 0.01),
            (point,),
        )
        for path in ("sdpa", "sdpa-static", "cpu_decode[page_size=32]")
    )
    return GenerationCalibration(
        model, "bf16", "cpu", {"kind": "cpu"}, tuple(linears), paths, "now", (0.5, 0.4, 0.3), 1.0
    )


@pytest.mark.parametrize("path", ["sdpa", "sdpa-static", "cpu_decode[page_size=32]"])
def test_predictions_are_monotone_where_they_must_be(path: str) -> None:
    model = _model()
    cal = _calibration(model)

    def predict(**kw: int):  # type: ignore[no-untyped-def]
        return predict_generation(
            model, cal, path=path, **({"batch": 1, "prompt_len": 1024, "new_tokens": 32} | kw)
        )

    by_prompt = [predict(prompt_len=t) for t in (128, 1024, 8192, 32768)]
    assert all(a.ttft_s < b.ttft_s for a, b in itertools.pairwise(by_prompt))
    assert all(a.itl_s <= b.itl_s for a, b in itertools.pairwise(by_prompt))
    by_batch = [predict(batch=b) for b in (1, 2, 3, 4)]
    assert all(a.ttft_s < b.ttft_s for a, b in itertools.pairwise(by_batch))
    assert all(a.itl_s <= b.itl_s for a, b in itertools.pairwise(by_batch))
    longer = predict(new_tokens=64)
    assert longer.e2e_s > by_prompt[1].e2e_s
    for p in (*by_prompt, *by_batch):
        assert math.isclose(p.ttft_s, p.prefill_matmul_s + p.prefill_attention_s + p.prefill_other_s)
        assert math.isclose(p.itl_s, p.weights_s + p.kv_s + p.fixed_s)
        assert math.isclose(p.e2e_s, p.ttft_s + (p.new_tokens - 1) * p.itl_s)
        assert min(p.weights_s, p.kv_s, p.fixed_s, p.prefill_attention_s) >= 0
    # fewer layers, same widths: the same calibration answers, for less
    assert (
        predict_generation(_model(4), cal, path=path, batch=1, prompt_len=1024, new_tokens=32).itl_s
        < by_prompt[1].itl_s
    )


def test_static_cache_pays_for_its_whole_length() -> None:
    model = _model()
    cal = _calibration(model)
    short = predict_generation(model, cal, path="sdpa-static", batch=1, prompt_len=128, new_tokens=8)
    long = predict_generation(
        model, cal, path="sdpa-static", batch=1, prompt_len=128, new_tokens=8, max_cache_len=8192
    )
    assert long.kv_s > short.kv_s and long.ttft_s == short.ttft_s
    with pytest.raises(ValueError, match="max_cache_len"):
        predict_generation(
            model, cal, path="sdpa-static", batch=1, prompt_len=128, new_tokens=8, max_cache_len=100
        )


def test_prediction_refuses_what_was_not_calibrated() -> None:
    model = _model()
    cal = _calibration(model)
    with pytest.raises(
        ValueError, match=r"'flash' was not calibrated; calibrated: sdpa, sdpa-static, cpu_decode\["
    ):
        predict_generation(model, cal, path="flash", batch=1, prompt_len=128, new_tokens=8)
    with pytest.raises(ValueError, match=r"batch 8 is outside the calibrated batches \[1, 4\]"):
        predict_generation(model, cal, path="sdpa", batch=8, prompt_len=128, new_tokens=8)
    with pytest.raises(ValueError, match="measured for hidden_size = 896; model 'qwen-ish' has 1024"):
        predict_generation(
            dataclasses.replace(model, hidden_size=1024),
            cal,
            path="sdpa",
            batch=1,
            prompt_len=8,
            new_tokens=2,
        )
    with pytest.raises(ValueError, match="prompt_len = 0 must be an integer"):
        predict_generation(model, cal, path="sdpa", batch=1, prompt_len=0, new_tokens=2)


def test_calibration_round_trips_through_json() -> None:
    cal = _calibration(_model())
    data = json.loads(json.dumps(cal.to_dict()))
    assert GenerationCalibration.from_dict(data) == cal
    broken = json.loads(json.dumps(data))
    del broken["paths"][1]["prefill"]["token2_s"]
    with pytest.raises(ValueError, match=r"paths\[1\]\.prefill: missing \['token2_s'\]"):
        GenerationCalibration.from_dict(broken)
    with pytest.raises(ValueError, match=r"unknown \['colour'\]"):
        GenerationCalibration.from_dict(data | {"colour": "blue"})
    with pytest.raises(ValueError, match="field 'format' = 7; accepted: 1"):
        GenerationCalibration.from_dict(data | {"format": 7})


def _itl_of(hf: Any, *, cache: object, prompt: torch.Tensor, steps: int) -> float:
    """Median seconds of a decode step after a prefill, as an e2e loop takes them."""
    samples = []
    with torch.inference_mode():
        out = hf(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1].float().argmax(-1)
        for _ in range(steps):
            start = time.perf_counter()
            out = hf(input_ids=token[:, None], past_key_values=cache, use_cache=True, logits_to_keep=1)
            token = out.logits[:, -1].float().argmax(-1)
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One thread: on a shared 2-core machine two OpenMP threads wait for each other (ms per op)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_tiny_model_calibrates_and_predicts_end_to_end(
    monkeypatch: pytest.MonkeyPatch, one_thread: None
) -> None:
    monkeypatch.setenv("ATTNBENCH_LLC_BYTES", str(256 * 1024))  # small copies and flushes: a fast test
    config = transformers.Qwen2Config(**{**SMALL, "num_hidden_layers": 2})
    model = ModelCost.from_hf_config(config, name="tiny")
    lines: list[str] = []
    cal = calibrate_generation(
        model, paths=["sdpa", "sdpa-static", "naive"], dtype=torch.float32, batch_sizes=[1, 2],
        max_seconds=5, progress=lines.append, decode_contexts=(8, 48, 160), prefill_lengths=(16, 48, 112),
        prefill_rows=(32, 96),
    )  # fmt: skip
    assert [p.path for p in cal.paths] == ["sdpa", "sdpa-static", "naive"]
    assert any(line.startswith("naive: decode b=1") for line in lines)
    assert cal.dtype == "fp32" and cal.fingerprint["kind"] == "cpu"
    assert GenerationCalibration.from_dict(json.loads(json.dumps(cal.to_dict()))) == cal
    for p in cal.paths:
        assert {f.batch for f in p.decode} == {1, 2}
        assert all(min(f.step_s, f.layer_s, f.token_s) >= 0 for f in p.decode)
        assert {x.phase for x in p.points} == {"decode", "prefill"}
    preds = {
        p.path: predict_generation(model, cal, path=p.path, batch=1, prompt_len=40, new_tokens=6)
        for p in cal.paths
    }
    assert all(math.isfinite(p.e2e_s) and p.ttft_s > 0 and p.itl_s > 0 for p in preds.values())
    # the real tiny model's decode step, through transformers' own cache: the same order of magnitude
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    itl = _itl_of(
        hf, cache=transformers.DynamicCache(config=config), prompt=torch.randint(320, (1, 40)), steps=8
    )
    assert 0.1 < itl / preds["sdpa"].itl_s < 10, (itl, preds["sdpa"])
