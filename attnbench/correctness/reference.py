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


#: Tokens per tile of the online-softmax calibration order (a typical flash-decoding tile).
CALIBRATION_BLOCK = 64


def _decode_by_sequence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: Sequence[int],
    *,
    scale: float,
    calibration: bool,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Float64 decode attention and, if asked, the calibration references, one sequence at a time.

    Working one sequence at a time keeps the float64 copies small (a 128k-token sequence with 8 KV
    heads of 128 dims is 1 GiB), so the gate can check the workload's full context.
    """
    b, hq, _ = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    dv = v.shape[-1]
    ref = torch.empty(b, hq, dv, dtype=torch.float64, device=q.device)
    cals = [
        torch.empty(b, hq, dv, dtype=torch.float32, device=q.device) for _ in range(2 if calibration else 0)
    ]
    for i in range(b):
        n = int(lengths[i])
        kd = k[i, :n].double().transpose(0, 1)  # [Hkv, n, Dk]
        vd = kd[..., :dv] if v.data_ptr() == k.data_ptr() else v[i, :n].double().transpose(0, 1)
        qd = q[i].double().view(hkv, g, -1)  # [Hkv, G, Dk]
        probs = torch.softmax(torch.matmul(qd, kd.transpose(1, 2)) * scale, dim=-1)  # [Hkv, G, n]
        ref[i] = torch.matmul(probs, vd).reshape(hq, -1)
        if calibration:
            kf, vf, qf = kd.float(), vd.float(), q[i].float().view(hkv, g, -1)
            scores = torch.matmul(qf, kf.transpose(1, 2)) * scale  # [Hkv, G, n], float32
            cals[0][i] = torch.matmul(torch.softmax(scores, dim=-1), vf).reshape(hq, -1)
            cals[1][i] = _blocked(scores, vf).reshape(hq, -1)
    return ref, cals


def _blocked(scores: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Flash-decoding's order in float32: tiles of :data:`CALIBRATION_BLOCK` tokens, each tile's max,
    sum and P·V, folded into a running output that is rescaled as the running max grows."""
    hkv, g, n = scores.shape
    blk = CALIBRATION_BLOCK
    nb = -(-n // blk)
    pad = nb * blk - n
    s = torch.nn.functional.pad(scores, (0, pad), value=-math.inf).view(hkv, g, nb, blk)
    vb = torch.nn.functional.pad(v, (0, 0, 0, pad)).view(hkv, nb, blk, -1)  # [Hkv, nb, blk, Dv]
    m_t = s.amax(dim=-1, keepdim=True)  # [Hkv, G, nb, 1]
    p = torch.exp(s - m_t)
    l_t = p.sum(dim=-1, keepdim=True)
    o_t = torch.einsum("hgbt,hbtd->hgbd", p, vb)  # [Hkv, G, nb, Dv]
    m, denom, acc = m_t[:, :, 0], l_t[:, :, 0], o_t[:, :, 0]
    for t in range(1, nb):  # the online rescaling, tile by tile, in float32
        m_new = torch.maximum(m, m_t[:, :, t])
        old, new = torch.exp(m - m_new), torch.exp(m_t[:, :, t] - m_new)
        acc = acc * old + o_t[:, :, t] * new
        denom = denom * old + l_t[:, :, t] * new
        m = m_new
    return acc / denom


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
) -> list[torch.Tensor]:
    """Decode attention rounded as careful kernels in the inputs' dtype round it, in two orders.

    Inputs stay in their dtype (``q``, ``k``, ``v`` as given); q·kᵀ is accumulated in float32 and kept
    float32, the softmax is float32, P stays float32 and P·V is accumulated in float32; the output is
    rounded once to the inputs' dtype. Two accumulation orders: one matmul over the whole sequence,
    and flash-decoding's tiles of :data:`CALIBRATION_BLOCK` tokens with the running output rescaled
    as the running max grows (the online softmax). In
    16-bit dtypes the output rounding dominates and both agree; in float32 the order is the error, and
    two equally careful orders differ by a random factor. The error of the worse of the two against
    :func:`reference_decode` is what the correctness gate calibrates its bounds with: the error that
    an implementation doing everything right in this dtype still makes.
    """
    return reference_pair(q, k, v, lengths, scale=scale)[1]


def reference_pair(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: Sequence[int], *, scale: float
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """:func:`reference_decode` and :func:`calibration_decode` of the same inputs, converted once."""
    ref, cals = _decode_by_sequence(q, k, v, lengths, scale=scale, calibration=True)
    return ref, [c.to(q.dtype) for c in cals]


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
