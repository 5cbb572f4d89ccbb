"""Tiny Hugging Face decoders for the real-model tests: transformers' own classes and configs, random
weights, small enough to run greedy generation on a CPU in a second."""

from __future__ import annotations

from collections.abc import Callable

import torch
import transformers

#: Fields every tiny config shares.
TINY_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    max_position_embeddings=128,
    initializer_range=0.2,  # wide logits: top-1 well clear of top-2, so fp32 rounding cannot flip a token
    bos_token_id=None,
    eos_token_id=None,  # never stop early: every generated token is compared
    pad_token_id=None,
)


def tiny_deepseek(**overrides: object) -> transformers.PreTrainedModel:
    """A two-layer dense DeepSeek-V3 (MLA attention); ``overrides`` replace config fields."""
    fields = dict(
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=32,
        q_lora_rank=32,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,  # Dk = 32 != Dv = 16, as in the real model (192 / 128)
        first_k_dense_replace=2,  # = num_hidden_layers: all layers dense
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        moe_intermediate_size=32,
        **TINY_COMMON,
    )
    fields.update(overrides)
    return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**fields))


def seeded(build: Callable[[], transformers.PreTrainedModel]) -> transformers.PreTrainedModel:
    """``build()`` under seed 1234, in eval mode, its norm weights and biases randomised too (they are
    1 and 0 at initialisation, where a mix-up of them would go unseen)."""
    torch.manual_seed(1234)
    hf = build().eval()
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif pname.endswith(".bias"):
                p.copy_(0.5 * torch.randn_like(p))
    return hf
