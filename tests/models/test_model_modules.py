"""The model modules on their own: architecture presets, the shared decoder pieces (RMSNorm, RoPE,
config fields), MLA weight absorption, and loading a tiny DeepSeek-V3 checkpoint from a folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from attnbench.models.architectures import ARCHITECTURES, hf_config
from attnbench.models.base import UnsupportedModelError, apply_rope, config_field, rms_norm, rotate_half
from attnbench.models.deepseek import DEEPSEEK_FAMILY, DeepseekDecoder
from attnbench.models.loading import SUPPORTED_MODEL_TYPES, from_transformers, load_model, read_checkpoint
from attnbench.models.mla import expand_kv, expand_output, latent_query, split_kv_b

pytestmark = pytest.mark.usefixtures("one_thread")


def test_architecture_presets_build_their_transformers_config() -> None:
    assert "qwen2.5-0.5b" in ARCHITECTURES
    config = hf_config("qwen2.5-0.5b")
    assert config.model_type == "qwen2" and config.name_or_path == "qwen2.5-0.5b"
    assert config.num_hidden_layers == ARCHITECTURES["qwen2.5-0.5b"][1]["num_hidden_layers"]
    with pytest.raises(ValueError, match="unknown; presets: "):
        hf_config("no-such-model")


def test_rms_norm_rope_and_config_fields() -> None:
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    w = torch.full((8,), 2.0, dtype=torch.float64)
    out = rms_norm(x, w, 0.0)
    assert torch.allclose(out.pow(2).mean(-1), torch.full((2, 3), 4.0, dtype=torch.float64))
    assert torch.equal(rotate_half(torch.tensor([1.0, 2.0, 3.0, 4.0])), torch.tensor([-3.0, -4.0, 1.0, 2.0]))
    q = torch.randn(1, 2, 3, 8)
    ones, zeros = torch.ones(1, 2, 8), torch.zeros(1, 2, 8)
    assert torch.equal(apply_rope(q, ones, zeros), q)  # angle 0: unchanged
    assert torch.allclose(apply_rope(q, zeros, ones), rotate_half(q))  # a quarter turn
    assert config_field({"hidden_size": 64}, "hidden_size", model="m") == 64
    with pytest.raises(UnsupportedModelError, match="m: config field 'vocab_size' is missing"):
        config_field({}, "vocab_size", model="m")


def test_absorbed_mla_attention_scores_and_outputs_equal_the_expanded_form() -> None:
    h, nope, rope, v_dim, rank, s = 3, 4, 2, 5, 6, 7
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(h * (nope + v_dim), rank, generator=gen, dtype=torch.float64)
    w_uk, w_uv = split_kv_b(weight, num_heads=h, qk_nope_head_dim=nope, v_head_dim=v_dim)
    assert w_uk.shape == (h, nope, rank) and w_uv.shape == (h, v_dim, rank)
    latent = torch.randn(s, rank, generator=gen, dtype=torch.float64)
    k_pe = torch.randn(s, rope, generator=gen, dtype=torch.float64)
    q_nope = torch.randn(h, nope, generator=gen, dtype=torch.float64)
    q_pe = torch.randn(h, rope, generator=gen, dtype=torch.float64)
    k, v = expand_kv(latent, k_pe, w_uk, w_uv)
    assert k.shape == (s, h, nope + rope) and v.shape == (s, h, v_dim)
    expanded = torch.einsum("hd,shd->hs", torch.cat([q_nope, q_pe], -1), k)
    absorbed = torch.einsum("hr,sr->hs", latent_query(q_nope, q_pe, w_uk), torch.cat([latent, k_pe], -1))
    assert torch.allclose(expanded, absorbed)
    p = torch.softmax(expanded, -1)
    assert torch.allclose(torch.einsum("hs,shv->hv", p, v), expand_output(p @ latent, w_uv))
    with pytest.raises(ValueError, match="expected"):
        split_kv_b(weight[1:], num_heads=h, qk_nope_head_dim=nope, v_head_dim=v_dim)


def test_a_checkpoint_folder_loads_as_the_deepseek_latent_decoder(tmp_path: Path) -> None:
    from helpers.tiny_hf import seeded, tiny_deepseek

    hf = seeded(tiny_deepseek)
    hf.save_pretrained(tmp_path)
    config, weights = read_checkpoint(tmp_path)
    hf_config_dict, hf_weights = from_transformers(hf)
    assert config["model_type"] == hf_config_dict["model_type"] == "deepseek_v3"
    assert config["model_type"] in SUPPORTED_MODEL_TYPES and config["model_type"] in DEEPSEEK_FAMILY
    assert weights.keys() == hf_weights.keys()
    assert all(torch.equal(weights[n], hf_weights[n]) for n in weights)
    model = load_model(tmp_path, backend="mla", dtype=torch.float32)
    assert isinstance(model, DeepseekDecoder) and model.shape.is_mla
    assert model.shape.num_params == sum(p.numel() for p in hf.parameters())
