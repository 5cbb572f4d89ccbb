"""Causal attention over a prompt, at the speed of torch's best prefill kernel, in bounded memory.

Every backend's default ``prefill`` runs :func:`prefill_attention` on the prompt's K/V, then writes
them into its own layout in one vectorised call. The attention is torch SDPA — its flash kernel on
CPUs (fp32, fp16, bf16) and its fused kernels on GPUs (flash-attn's varlen kernel is used by the
``flash`` backend where installed) — so no ``T × T`` score matrix is materialised:

- uniform prompts on an empty cache: one batched ``is_causal`` call;
- ragged prompts: one call per sequence over its own length (no padding waste);
- a prompt appended to a cached prefix (the second turn of a chat) or a prompt longer than the
  memory budget allows in one call: chunks of query rows, each attending to the prefix and the
  prompt up to its last row through a ``[rows, keys]`` mask, sized so that what one call may
  allocate (the mask, or the scores where only SDPA's math kernel can run) stays within
  :data:`PREFILL_BUDGET_BYTES`. Memory is O(T · chunk), never O(T²).

Tensor conventions as in :mod:`attnbench.core.backend`: ``q [B, T, Hq, Dk]``, ``k [B, T, Hkv, Dk]``,
``v [B, T, Hkv, Dv]``, right-padded to ``T = max(lengths)``; the result is ``[B, T, Hq, Dv]`` with
rows past ``lengths[i]`` zero. GQA is native (``enable_gqa``): K/V are never repeated.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["PREFILL_BUDGET_BYTES", "prefill_attention", "sdpa_flash_error"]

#: What one attention call of a chunked prefill may allocate for its mask or scores (bytes).
PREFILL_BUDGET_BYTES = 256 * 2**20


@functools.cache
def sdpa_flash_error(device_type: str, dtype: torch.dtype, same_dims: bool = True) -> str | None:
    """``None`` when SDPA has a fused kernel (no materialised scores) for this device, dtype and
    head-dim pairing, with a GQA group and a boolean mask; else the reason, from one tiny probe."""

    fused = [SDPBackend.FLASH_ATTENTION]
    if device_type == "cuda":
        fused += [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    try:
        q = torch.randn(1, 2, 4, 64, device=device_type).to(dtype)
        k = torch.randn(1, 1, 8, 64, device=device_type).to(dtype)
        v = k if same_dims else torch.randn(1, 1, 8, 32, device=device_type).to(dtype)
        mask = torch.ones(4, 8, dtype=torch.bool, device=device_type).tril(4)
        with sdpa_kernel(fused), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch explains its refusal as a warning, then raises
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    except (RuntimeError, AssertionError) as err:
        return f"torch SDPA has no fused kernel for {device_type}/{dtype}: {str(err).splitlines()[0]}"
    return None


def _rows_per_call(*, keys: int, heads: int, fused: bool, budget: int) -> int:
    """Query rows per attention call so that what it allocates per row fits ``budget``: the boolean
    mask and SDPA's float copy of it (5 bytes a key), and for SDPA's math kernel also the fp32
    scores, their softmax and its cast, per head (measured peak: about 4 × 4 bytes a key and head)."""
    per_row = keys * (5 if fused else 5 + 16 * heads)
    return max(1, budget // per_row)


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal: bool = False,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q [B, T, Hq, Dk]`` over ``k [B, S, Hkv, Dk]``, ``v [B, S, Hkv, Dv]`` → ``[B, T, Hq, Dv]`` (a view)."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


def _one_sequence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, offset: int, scale: float, fused: bool, budget: int
) -> torch.Tensor:
    """One sequence's ``n`` new rows ``q [n, Hq, Dk]`` over ``k [offset + n, Hkv, Dk]`` (prefix first).

    Row ``r`` sees keys ``0 .. offset + r``. Returns ``[n, Hq, Dv]``.
    """
    n, keys = q.shape[0], k.shape[0]
    rows = _rows_per_call(keys=keys, heads=q.shape[1], fused=fused, budget=budget)
    if offset == 0 and fused:
        return _sdpa(q[None], k[None], v[None], scale=scale, causal=True)[0]
    out = q.new_empty(n, q.shape[1], v.shape[-1])
    cols = torch.arange(keys, device=q.device)
    for start in range(0, n, rows):
        end = min(n, start + rows)
        width = offset + end  # keys this chunk can see
        last = offset + torch.arange(start, end, device=q.device)  # [rows]: each row's last key
        mask = cols[None, :width] <= last[:, None]  # [rows, width]
        if fused:
            chunk = _sdpa(q[None, start:end], k[None, :width], v[None, :width], scale=scale, mask=mask)[0]
        else:
            chunk = _grouped_math(q[start:end], k[:width], v[:width], scale=scale, mask=mask)
        out[start:end] = chunk
    return out


def _grouped_math(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, mask: torch.Tensor
) -> torch.Tensor:
    """SDPA's math kernel without repeating K/V for GQA: a group's query heads become rows.

    ``q [r, Hq, Dk]``, ``k [S, Hkv, Dk]``, ``v [S, Hkv, Dv]``, ``mask [r, S]`` → ``[r, Hq, Dv]``.
    """
    r, hq, _ = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    qf = q.reshape(r, hkv, g, -1).permute(1, 2, 0, 3).reshape(1, hkv, g * r, -1)  # [1, Hkv, G·r, Dk]
    o = F.scaled_dot_product_attention(
        qf, k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask.repeat(g, 1), scale=scale
    )  # [1, Hkv, G·r, Dv]
    return o[0].reshape(hkv, g, r, -1).permute(2, 0, 1, 3).reshape(r, hq, -1)


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    lengths: Sequence[int],
    scale: float,
    prefix: Sequence[tuple[torch.Tensor, torch.Tensor] | None] | None = None,
    budget_bytes: int = PREFILL_BUDGET_BYTES,
) -> torch.Tensor:
    """Causal attention of right-padded prompts, each optionally after a cached prefix.

    ``q [B, T, Hq, Dk]``, ``k [B, T, Hkv, Dk]``, ``v [B, T, Hkv, Dv]`` → ``[B, T, Hq, Dv]`` in ``q``'s
    dtype; rows past ``lengths[i]`` are zero. ``prefix[i]`` is ``(k [P, Hkv, Dk], v [P, Hkv, Dv])``,
    sequence ``i``'s cached tokens before this prompt (``None``: none), in the inputs' dtype: row ``r``
    of the prompt then attends to the ``P`` cached tokens and prompt rows ``0..r``. May allocate
    (host work and device memory within ``budget_bytes`` per call); not capturable.
    """
    b, t = q.shape[:2]
    lengths = [int(n) for n in lengths]
    if len(lengths) != b or any(not 0 <= n <= t for n in lengths):
        raise ValueError(f"prefill: lengths {lengths} must hold {b} values in 0..{t}")
    if prefix is not None and len(prefix) != b:
        raise ValueError(f"prefill: prefix has {len(prefix)} entries for a batch of {b}")
    same_dims = q.shape[-1] == v.shape[-1]
    fused = sdpa_flash_error(q.device.type, q.dtype, same_dims) is None
    has_prefix = prefix is not None and any(p is not None and p[0].shape[0] for p in prefix)
    if not has_prefix and all(n == t for n in lengths):
        rows = _rows_per_call(keys=t, heads=q.shape[2], fused=fused, budget=budget_bytes)
        if fused or rows >= t:  # one batched call: the common case
            return _sdpa(q, k, v, scale=scale, causal=True)
    out = q.new_zeros(b, t, q.shape[2], v.shape[-1])
    for i, n in enumerate(lengths):
        if n == 0:
            continue
        ki, vi, offset = k[i, :n], v[i, :n], 0
        cached = prefix[i] if prefix is not None else None
        if cached is not None and cached[0].shape[0]:
            offset = cached[0].shape[0]
            ki = torch.cat([cached[0].to(k.dtype), ki])
            vi = torch.cat([cached[1].to(v.dtype), vi])
        out[i, :n] = _one_sequence(
            q[i, :n], ki, vi, offset=offset, scale=scale, fused=fused, budget=budget_bytes
        )
    return out
