"""Float64 reference attention and the error metrics the correctness gate reports."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

__all__ = ["ErrorStats", "compare", "reference_decode", "reference_prefill"]


def reference_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: Sequence[int], *, scale: float
) -> torch.Tensor:
    """Decode attention in float64.

    ``q [B, Hq, Dk]``; ``k [B, S, Hkv, Dk]`` and ``v [B, S, Hkv, Dv]`` hold each sequence's whole
    history (the new token included) in its first ``lengths[i]`` rows. Returns ``[B, Hq, Dv]`` float64.
    """
    q, k, v = q.double(), k.double(), v.double()
    b, hq, dk = q.shape
    s, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    qg = q.view(b, hkv, g, dk)
    scores = torch.einsum("bhgd,bshd->bhgs", qg, k) * scale  # [B, Hkv, G, S]
    lens = torch.as_tensor(list(lengths), device=q.device)
    valid = torch.arange(s, device=q.device)[None, :] < lens[:, None]  # [B, S]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgs,bshd->bhgd", probs, v)
    return out.reshape(b, hq, -1)


def reference_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: Sequence[int], *, scale: float
) -> torch.Tensor:
    """Causal prompt attention in float64; ``q [B, T, Hq, Dk]`` → ``[B, T, Hq, Dv]``, padded rows zero."""
    q, k, v = q.double(), k.double(), v.double()
    b, t, hq, dk = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    qg = q.view(b, t, hkv, g, dk)
    scores = torch.einsum("bthgd,bshd->bhgts", qg, k) * scale
    i = torch.arange(t, device=q.device)
    lens = torch.as_tensor(list(lengths), device=q.device)
    valid = (i[None, :, None] >= i[None, None, :]) & (i[None, None, :] < lens[:, None, None])  # [B, T, S]
    scores = scores.masked_fill(~valid[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out = torch.einsum("bhgts,bshd->bthgd", probs, v).reshape(b, t, hq, -1)
    return out * (i[None, :] < lens[:, None])[:, :, None, None]


@dataclass(frozen=True)
class ErrorStats:
    """How far an output is from the reference. ``nonfinite`` counts NaN/inf elements."""

    max_abs: float
    rel_l2: float
    cosine: float
    nonfinite: int
    numel: int

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def compare(out: torch.Tensor, ref: torch.Tensor) -> ErrorStats:
    """Error of ``out`` against the float64 ``ref`` (same shape). NaN/inf make every metric fail."""
    if out.shape != ref.shape:
        raise ValueError(f"output shape {tuple(out.shape)} != reference shape {tuple(ref.shape)}")
    o = out.detach().to("cpu", torch.float64).flatten()
    r = ref.detach().to("cpu", torch.float64).flatten()
    nonfinite = int((~torch.isfinite(o)).sum())
    if nonfinite:
        return ErrorStats(math.inf, math.inf, -1.0, nonfinite, o.numel())
    diff = o - r
    ref_norm = float(r.norm())
    rel = float(diff.norm()) / ref_norm if ref_norm > 0 else float(diff.norm())
    denom = float(o.norm()) * ref_norm
    cos = float(o @ r) / denom if denom > 0 else (1.0 if float(diff.norm()) == 0 else 0.0)
    return ErrorStats(float(diff.abs().max()) if o.numel() else 0.0, rel, cos, 0, o.numel())
