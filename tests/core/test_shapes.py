from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from attnbench.core.shapes import ShapeError, list_presets, load_shape, parse_dtype
from attnbench.core.workload import Workload, bucket, parse_int_list, parse_tokens


def test_published_kv_bytes_per_token() -> None:
    # 2 (K and V) * 32 layers * 8 kv heads * 128 dims * 2 bytes
    assert load_shape("llama-3.1-8b").kv_bytes_per_token("bf16") == 2 * 32 * 8 * 128 * 2 == 131_072
    # 61 layers * (512 latent + 64 rope) * 2 bytes
    assert load_shape("deepseek-v3").kv_bytes_per_token("bf16") == 61 * 576 * 2 == 70_272
    # expanded MLA, as transformers caches it: 128 heads * (192 key + 128 value)
    assert load_shape("deepseek-v3").kv_bytes_per_token("bf16", "expanded") == 61 * 128 * 320 * 2
    assert load_shape("llama-3.3-70b").kv_bytes_per_token("fp8") == 2 * 80 * 8 * 128
    assert load_shape("llama-3.1-8b").kv_bytes_per_token("fp32") == 262_144


@pytest.mark.parametrize("name", list_presets())
def test_every_preset_loads(name: str) -> None:
    shape = load_shape(name)
    assert shape.num_heads % shape.num_kv_heads == 0
    assert shape.kv_bytes_per_token("bf16") > 0
    geom = shape.geometry("latent" if shape.is_mla else "expanded")
    assert geom.num_q_heads == shape.num_heads


def test_mla_geometry() -> None:
    ds = load_shape("deepseek-v3")
    latent = ds.geometry("latent")
    assert (latent.num_kv_heads, latent.qk_head_dim, latent.v_head_dim) == (1, 576, 512)
    assert latent.scale == pytest.approx(192**-0.5)
    with pytest.raises(ValueError, match="not MLA"):
        load_shape("llama-3.1-8b").geometry("latent")


def _yaml(tmp_path, text: str):
    p = tmp_path / "shape.yaml"
    p.write_text(text)
    return p


BASE = """num_layers: 4
num_heads: 8
num_kv_heads: 2
head_dim: 64
hidden_size: 512
intermediate_size: 1024
vocab_size: 1000
num_params: 1000000
"""


def test_yaml_shape_loads(tmp_path) -> None:
    shape = load_shape(_yaml(tmp_path, BASE))
    assert shape.name == "shape" and shape.num_kv_heads == 2


@pytest.mark.parametrize(
    ("change", "field", "rule"),
    [
        (("num_kv_heads: 2", "num_kv_heads: 3"), "num_kv_heads", "divisible"),
        (("head_dim: 64", "head_dim: 0"), "head_dim", "> 0"),
        (("head_dim: 64", "head_dim: -64"), "head_dim", "> 0"),
        (("num_heads: 8", "num_heads: eight"), "num_heads", "integer"),
        (("num_heads: 8", "num_heads: 8.0"), "num_heads", "integer"),
        (("vocab_size: 1000", "vocab_size: 1000\nrope_theta: 5"), "rope_theta", "unknown field"),
        (("vocab_size: 1000\n", ""), "vocab_size", "missing"),
        (("vocab_size: 1000", "vocab_size: 1000\nkv_lora_rank: 16"), "qk_rope_head_dim", "MLA shapes need"),
    ],
)
def test_bad_yaml_names_the_field(tmp_path, change, field, rule) -> None:
    with pytest.raises(ShapeError) as err:
        load_shape(_yaml(tmp_path, BASE.replace(*change)))
    msg = str(err.value)
    assert field in msg and rule in msg and "\n" not in msg, msg


def test_bad_yaml_cli_one_line_error(tmp_path) -> None:
    path = _yaml(tmp_path, BASE.replace("num_kv_heads: 2", "num_kv_heads: 3"))
    proc = subprocess.run(
        [sys.executable, "-m", "attnbench", "backends", "--model", str(path)], capture_output=True, text=True
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "num_kv_heads" in lines[0] and "divisible" in lines[0], proc.stderr


def test_unknown_model_lists_presets() -> None:
    with pytest.raises(ShapeError, match="llama-3.1-8b"):
        load_shape("llama-9")


def test_hf_config_json(tmp_path) -> None:
    cfg = {
        "model_type": "llama",
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
    }
    d = tmp_path / "llama-3.1-8b-copy"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    shape = load_shape(d / "config.json")
    preset = load_shape("llama-3.1-8b")
    assert shape.name == "llama-3.1-8b-copy"
    assert shape.kv_bytes_per_token("bf16") == preset.kv_bytes_per_token("bf16")
    assert shape.fingerprint() != preset.fingerprint() or shape.num_params == preset.num_params
    # the parameter estimate from the config matches the published count to within 0.1 %
    assert abs(shape.num_params - preset.num_params) / preset.num_params < 1e-3


def test_hf_config_mla(tmp_path) -> None:
    cfg = {
        "model_type": "deepseek_v3",
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "vocab_size": 129280,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
    }
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    shape = load_shape(p)
    assert shape.is_mla and shape.kv_bytes_per_token("bf16") == 70_272
    # total within 1 % of the published 671B; activated within 5 % of the published 37B
    assert abs(shape.num_params - 671e9) / 671e9 < 0.01, shape.num_params
    assert abs(shape.params_read_per_token - 37e9) / 37e9 < 0.05, shape.params_read_per_token


def test_missing_hf_field(tmp_path) -> None:
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"num_hidden_layers": 2}))
    with pytest.raises(ShapeError, match="num_attention_heads"):
        load_shape(p)


def test_tokens_and_buckets() -> None:
    assert parse_tokens("8k") == 8192 and parse_tokens("1m") == 2**20 and parse_tokens(300) == 300
    assert parse_int_list("1k, 8k,32k", field="--context") == [1024, 8192, 32768]
    with pytest.raises(ValueError, match="--context"):
        parse_int_list("1k,eight", field="--context")
    assert [bucket(x) for x in (1, 3, 5, 6, 1000, 1500)] == [
        1,
        4,
        4,
        8,
        1024,
        2048,
    ]  # 1500 > sqrt(1024 * 2048)


def test_workload_validation() -> None:
    w = Workload.uniform("tiny-gqa", batch=3, context="1k", dtype="fp16")
    assert w.batch == 3 and w.context == 1024 and w.dtype == torch.float16
    assert w.kv_bytes_per_step() == load_shape("tiny-gqa").kv_bytes_per_token("fp16") * 3 * 1025
    with pytest.raises(ValueError, match="batch"):
        Workload.uniform("tiny-gqa", batch=0, context=4)
    with pytest.raises(ValueError, match="dtype 'int3'.*accepted: bf16"):
        parse_dtype("int3")
    with pytest.raises(
        ValueError, match=r"field 'dtype' = 'fp8': compute dtype must be one of bf16, fp16, fp32"
    ):
        Workload.uniform("tiny-gqa", batch=1, context=4, dtype="fp8")
    with pytest.raises(ValueError, match=r"context_lens\[1\]"):
        Workload(load_shape("tiny-gqa"), (3, -1))


def test_shape_direct_validation() -> None:
    mla = load_shape("tiny-mla")  # head_dim 24 = qk_nope_head_dim 16 + qk_rope_head_dim 8
    with pytest.raises(ShapeError, match="head_dim.*must equal"):
        dataclasses.replace(mla, head_dim=10)
