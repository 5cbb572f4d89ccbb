"""Float64 reference attention and the error metrics the correctness gate reports."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

__all__ = [
    "ErrorStats",
    "calibration_decode",
    "compare",
    "reference_decode",
    "reference_pair",
    "reference_prefill",
]


def _decode_by_sequence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: Sequence[int],
    *,
    scale: float,
    calibration: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float64 decode attention and, if asked, the calibration reference, one sequence at a time.

    Working one sequence at a time keeps the float64 copies small (a 128k-token sequence with 8 KV
    heads of 128 dims is 1 GiB), so the gate can check the workload's full context.
    """
    b, hq, _ = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    ref = torch.empty(b, hq, v.shape[-1], dtype=torch.float64, device=q.device)
    cal = torch.empty(b, hq, v.shape[-1], dtype=torch.float32, device=q.device) if calibration else None
    for i in range(b):
        n = int(lengths[i])
        kd = k[i, :n].double().transpose(0, 1)  # [Hkv, n, Dk]
        vd = kd[..., : v.shape[-1]] if v.data_ptr() == k.data_ptr() else v[i, :n].double().transpose(0, 1)
        qd = q[i].double().view(hkv, g, -1)  # [Hkv, G, Dk]
        probs = torch.softmax(torch.matmul(qd, kd.transpose(1, 2)) * scale, dim=-1)  # [Hkv, G, n]
        ref[i] = torch.matmul(probs, vd).reshape(hq, -1)
        if cal is not None:
            kf, vf, qf = kd.float(), vd.float(), q[i].float().view(hkv, g, -1)
            pf = torch.softmax(torch.matmul(qf, kf.transpose(1, 2)) * scale, dim=-1)
            cal[i] = torch.matmul(pf, vf).reshape(hq, -1)
    return ref, cal


def reference_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: Sequence[int], *, scale: float
) -> torch.Tensor:
    """Decode attention in float64.

    ``q [B, Hq, Dk]``; ``k [B, S, Hkv, Dk]`` and ``v [B, S, Hkv, Dv]`` hold each sequence's whole
    history (the new token included) in its first ``lengths[i]`` rows. Returns ``[B, Hq, Dv]`` float64.
    """
    return _decode_by_sequence(q, k, v, lengths, scale=scale, calibration=False)[0]


def calibration_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: Sequence[int], *, scale: float
) -> torch.Tensor:
    """Decode attention rounded as a careful kernel in the inputs' dtype rounds it.

    Inputs stay in their dtype (``q``, ``k``, ``v`` as given); q·kᵀ is accumulated in float32 and kept
    float32, the softmax is float32, P stays float32 and P·V is accumulated in float32; the output is
    rounded once to the inputs' dtype. Its error against :func:`reference_decode` on the same inputs is
    what the correctness gate calibrates its bounds with: the error that an implementation which does
    everything right in this dtype still makes.
    """
    return reference_pair(q, k, v, lengths, scale=scale)[1]


def reference_pair(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: Sequence[int], *, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`reference_decode` and :func:`calibration_decode` of the same inputs, converted once."""
    ref, cal = _decode_by_sequence(q, k, v, lengths, scale=scale, calibration=True)
    assert cal is not None
    return ref, cal.to(q.dtype)


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
