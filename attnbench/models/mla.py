"""MLA (DeepSeek-V2/V3 multi-head latent attention): weight absorption.

MLA caches, per token and layer, one compressed latent ``c`` (``kv_lora_rank``) and one decoupled RoPE
key ``k_pe`` (``qk_rope_head_dim``) shared by all heads. ``kv_b_proj`` decompresses the latent into
per-head keys and values: ``k_nope[h] = W_UK[h] @ c`` and ``v[h] = W_UV[h] @ c``. Because

    q_nope[h] · k_nope[h] = (W_UK[h]^T q_nope[h]) · c        and        Σ p · v[h] = W_UV[h] (Σ p · c),

decode can attend over the latent directly (the *absorbed* form): the query becomes
``[W_UK^T q_nope | q_pe]`` (``kv_lora_rank + qk_rope_head_dim``), every head attends to the one shared
row ``[c | k_pe]`` (like MQA), the value is ``c`` itself, and ``W_UV`` is applied to the output.
The softmax scale stays ``1/sqrt(qk_nope_head_dim + qk_rope_head_dim)``.

Weight layout (as in transformers' ``DeepseekV3Attention``): ``kv_b_proj.weight`` is
``[H * (qk_nope_head_dim + v_head_dim), kv_lora_rank]``; :func:`split_kv_b` gives
``w_uk [H, qk_nope_head_dim, kv_lora_rank]`` and ``w_uv [H, v_head_dim, kv_lora_rank]``.

The roofline of a decode step is the cost model's (:func:`attnbench.core.traffic.decode_roofline`,
``form="latent"``, ``projections=True`` for the absorption matmuls). Absorbed MLA does
``2 · H · (Dk + Dv)`` FLOPs per cached token and head over a row of ``Dk`` values read once for all
``H`` heads, so with 128 heads its arithmetic intensity (~240 FLOP/B in bf16) passes the ridge point of
several GPUs: it can be compute-bound, unlike the expanded form (~1 FLOP/B).
"""

from __future__ import annotations

import torch

__all__ = ["absorb_query", "expand_kv", "expand_output", "latent_query", "split_kv_b"]


# -- weight absorption ----------------------------------------------------------------------------
def split_kv_b(
    weight: torch.Tensor, *, num_heads: int, qk_nope_head_dim: int, v_head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv_b_proj.weight [H·(nope+v), rank]`` → ``w_uk [H, nope, rank]``, ``w_uv [H, v, rank]`` (views)."""
    per_head = qk_nope_head_dim + v_head_dim
    if weight.dim() != 2 or weight.shape[0] != num_heads * per_head:
        raise ValueError(
            f"kv_b_proj weight of shape {tuple(weight.shape)}: expected [{num_heads} * {per_head}, kv_lora_rank]"
        )
    w = weight.view(num_heads, per_head, weight.shape[1])
    return w[:, :qk_nope_head_dim], w[:, qk_nope_head_dim:]


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """Fold the key up-projection into the query: ``q_nope [..., H, nope]`` → ``[..., H, rank]``.

    ``w_uk [H, nope, rank]``. Computed in the inputs' dtype (cast them to float64 for a reference).
    """
    return torch.einsum("...hn,hnr->...hr", q_nope, w_uk)


def latent_query(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """The absorbed decode query ``[W_UK^T q_nope | q_pe]``: ``[..., H, rank + rope]``."""
    return torch.cat([absorb_query(q_nope, w_uk), q_pe], dim=-1)


def expand_output(out_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """Apply the value up-projection: ``out_latent [..., H, rank]`` → ``[..., H, v]``; ``w_uv [H, v, rank]``."""
    return torch.einsum("...hr,hvr->...hv", out_latent, w_uv)


def expand_kv(
    latent: torch.Tensor, k_pe: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decompress the latent cache into per-head K/V, as transformers caches them (the expanded form).

    ``latent [..., S, rank]``, ``k_pe [..., S, rope]`` → ``k [..., S, H, nope + rope]``,
    ``v [..., S, H, v]``; the RoPE key is shared by every head.
    """
    k_nope = torch.einsum("...sr,hnr->...shn", latent, w_uk)
    k_pe = k_pe.unsqueeze(-2).expand(*k_nope.shape[:-1], k_pe.shape[-1])
    v = torch.einsum("...sr,hvr->...shv", latent, w_uv)
    return torch.cat([k_nope, k_pe], dim=-1), v
