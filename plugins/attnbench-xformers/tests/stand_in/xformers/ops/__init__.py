"""Stand-in for ``xformers.ops`` (see the package docstring)."""

from __future__ import annotations

from typing import Any

import torch

from xformers.ops import fmha  # noqa: F401
from xformers.ops.fmha.attn_bias import BlockDiagonalCausalWithOffsetPaddedKeysMask


def memory_efficient_attention_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_bias: Any = None,
    p: float = 0.0,
    scale: float | None = None,
    *,
    op: Any = None,
    output_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``query [1, Mq, G, H, K]``, ``key [1, Mk, G, H, K]``, ``value [1, Mk, G, H, Kv]`` → ``[1, Mq, G, H, Kv]``."""
    if query.ndim != 5 or key.ndim != 5 or value.ndim != 5 or query.shape[0] != 1:
        raise ValueError(
            f"stand-in expects BMGHK inputs with B=1; got {tuple(query.shape)}, {tuple(key.shape)}"
        )
    if not isinstance(attn_bias, BlockDiagonalCausalWithOffsetPaddedKeysMask):
        raise NotImplementedError(
            f"stand-in supports only BlockDiagonalCausalWithOffsetPaddedKeysMask, got {attn_bias}"
        )
    if op is not None and not getattr(op, "IS_STAND_IN_OP", False):
        raise NotImplementedError(f"unknown op {op}")
    q_lens, k_lens, pad = (
        attn_bias.q_seqinfo.seqlen_py,
        attn_bias.k_seqinfo.seqlen_py,
        attn_bias.k_seqinfo.padding,
    )
    if query.shape[1] != sum(q_lens) or key.shape[1] != pad * len(k_lens) or value.shape[1] != key.shape[1]:
        raise ValueError(
            f"bias {q_lens=} {k_lens=} {pad=} does not match {tuple(query.shape)} / {tuple(key.shape)}"
        )
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    outs, start = [], 0
    for i, (ql, kl) in enumerate(zip(q_lens, k_lens, strict=True)):
        qi = query[0, start : start + ql].float()  # [ql, G, H, K]
        ki, vi = key[0, i * pad : i * pad + kl].float(), value[0, i * pad : i * pad + kl].float()
        scores = torch.einsum("qghk,sghk->ghqs", qi, ki) * scale
        # causal from the bottom right: query j sees keys up to kl - ql + j
        allowed = torch.arange(kl)[None, :] <= (kl - ql + torch.arange(ql))[:, None]
        scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append(torch.einsum("ghqs,sghd->qghd", scores.softmax(-1), vi))
        start += ql
    return torch.cat(outs)[None].to(output_dtype or query.dtype)
