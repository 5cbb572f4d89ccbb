"""``xformers`` — xformers' memory-efficient attention for decode, split-KV included.

One decode step is one ``xformers.ops.memory_efficient_attention_forward`` call over the whole batch:

- the cache is contiguous, sequence-major per batch row (``k: [L, B, S, Hkv, Dk]``), so layer ``l`` viewed
  as ``[1, B*S, Hkv, G, Dk]`` (``G = Hq // Hkv``, the head axis expanded with stride 0: K/V are never
  repeated) is xformers' 5-D ``BMGHK`` layout with each sequence padded to ``S``;
- the queries of the step are ``[1, B, Hkv, G, Dk]`` (one token per sequence, packed);
- the ragged lengths are a ``BlockDiagonalCausalWithOffsetPaddedKeysMask`` (``q_seqlen = [1] * B``,
  ``kv_padding = S``, ``kv_seqlen`` = lengths after the step), built once per step in :meth:`plan`.

Tunable ``op``: ``auto`` lets xformers' dispatcher choose; ``triton_splitk`` forces xformers' split-KV
decode kernel (``xformers.ops.fmha.triton_splitk.FwOp``, its own split heuristic) and
``triton_splitkN`` its fixed-split variants (``FwOp_SN``).

Where xformers is missing, or refuses the workload (no CUDA, dtype, head dim...), ``supports()``
returns the reason xformers itself gives: the import error, or the ``NotImplementedError`` of its
dispatcher, which names every operator and why it cannot run.

Which call may allocate: ``create_cache`` (buffers), ``plan`` (the attention bias: host lists → device
tensors). ``decode`` writes the new K/V and runs the kernel (xformers allocates its split-K scratch).
Prefill uses attnbench's default (append, then grouped causal attention in torch).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from attnbench.core.backend import KVCache, StepPlan, Tunable, base_plan
from attnbench.core.kvcache import ContiguousBackend, ContiguousKVCache
from attnbench.core.workload import Workload

SPLITS = (2, 4, 8, 16, 32)
OPS = ("auto", "triton_splitk", *(f"triton_splitk{n}" for n in SPLITS))
_MAX_REASON = 1200


@functools.cache
def xformers_import_error() -> str | None:
    """Why ``xformers.ops`` cannot be imported (its own error), or ``None``."""
    try:
        import xformers.ops  # noqa: F401
    except Exception as err:  # ImportError, or a broken binary extension raising anything else
        return f"xformers not importable ({type(err).__name__}: {err})"
    return None


def _fw_op(name: str) -> Any:
    """The xformers forward operator for tunable value ``name`` (``None``: xformers dispatches)."""
    if name == "auto":
        return None
    from xformers.ops.fmha import triton_splitk

    if name == "triton_splitk":
        return triton_splitk.FwOp
    return getattr(triton_splitk, f"FwOp_S{name.removeprefix('triton_splitk')}")


def _attn_bias(kv_lens: Sequence[int], padding: int, device: torch.device) -> Any:
    from xformers.ops.fmha.attn_bias import BlockDiagonalCausalWithOffsetPaddedKeysMask as Bias

    bias = Bias.from_seqlens(q_seqlen=[1] * len(kv_lens), kv_padding=padding, kv_seqlen=list(kv_lens))
    return bias.to(device) if device.type != "cpu" else bias


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, bias: Any, scale: float, op: str
) -> torch.Tensor:
    """``q [B, Hq, Dk]``, ``k [B, S, Hkv, Dk]``, ``v [B, S, Hkv, Dv]`` → ``[B, Hq, Dv]``."""
    import xformers.ops as xops

    b, hq, dk = q.shape
    s, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    g = hq // hkv
    q5 = q.reshape(1, b, hkv, g, dk)  # [1, B, Hkv, G, Dk]: one query per sequence, packed
    k5 = k.reshape(1, b * s, hkv, 1, dk).expand(1, b * s, hkv, g, dk)  # stride 0 over G: no copy
    v5 = v.reshape(1, b * s, hkv, 1, dv).expand(1, b * s, hkv, g, dv)
    out = xops.memory_efficient_attention_forward(q5, k5, v5, attn_bias=bias, scale=scale, op=_fw_op(op))
    return out.reshape(b, hq, dv)


@functools.cache
def xformers_refusal(
    device_type: str, dtype: torch.dtype, hkv: int, group: int, dk: int, dv: int, op: str
) -> str | None:
    """Run ``op`` once on a tiny input of this geometry; the reason xformers gives if it refuses."""
    err = xformers_import_error()
    if err:
        return err
    device = torch.device(device_type)
    if device.type == "cuda" and not torch.cuda.is_available():
        return "CUDA is not available to torch"
    b, s = 2, 16
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, hkv * group, dk, generator=gen).to(device, dtype)
    k = torch.randn(b, s, hkv, dk, generator=gen).to(device, dtype)
    v = torch.randn(b, s, hkv, dv, generator=gen).to(device, dtype)
    try:
        _attend(q, k, v, bias=_attn_bias([5, s], s, device), scale=dk**-0.5, op=op)
    except (NotImplementedError, ValueError, RuntimeError, AssertionError, TypeError) as e:
        text = " ".join(str(e).split())
        if len(text) > _MAX_REASON:
            text = text[:_MAX_REASON] + " …"
        return f"xformers refuses op={op} on {device_type}/{dtype}: {type(e).__name__}: {text}"
    return None


@dataclass
class XformersPlan(StepPlan):
    """The base plan plus the decode step's attention bias (built once per step, shared by every layer)."""

    attn_bias: Any = None


class XformersBackend(ContiguousBackend):
    name = "xformers"
    description = (
        "xformers memory_efficient_attention (split-KV decode via triton_splitk) over a padded cache"
    )
    tunables = (Tunable("op", OPS, "auto", "xformers forward operator; auto = xformers' dispatcher"),)
    heads_first = False  # [L, B, S, Hkv, D]: each sequence is one padded block of B*S rows

    def _refusal(self, workload: Workload, op: str = "auto") -> str | None:
        g = workload.geometry(self.kv_form)
        return xformers_refusal(
            torch.device(workload.device).type,
            workload.dtype,
            g.num_kv_heads,
            g.group_size,
            g.qk_head_dim,
            g.v_head_dim,
            op,
        )

    def error_multiple(self, dtype: torch.dtype, *, config: Mapping[str, Any] | None = None) -> float:
        """6 in fp32, else the default 2. In fp32 the order of the sums is the error, and xformers'
        kernels sum in their own (split-K tiles, a running softmax rescaled per tile), as SDPA's flash
        does. On a CPU the plumbing runs through a stand-in whose batched matmul over the stride-0 GQA
        view sums in torch's bmm order: over 200 seeds of the 5,003-token GQA case it measured up to
        1.32 of a ×2 bound (one seed failed, on the needle over near-equal keys), 0.84 of ×4, 0.81 of
        ×5 and 0.71 of ×6 over 400 more — ×6 keeps the 0.8 that every declared multiple leaves. The
        real kernels' fp32 ratio is not measured here (no GPU)."""
        return 6.0 if dtype == torch.float32 else super().error_multiple(dtype)

    def supports(self, workload: Workload) -> list[str]:
        err = self._refusal(workload)
        return [err] if err else []

    def implementation(self, workload: Workload) -> str:
        err = self._refusal(workload)
        return "unavailable: " + err if err else "xformers.ops.memory_efficient_attention_forward"

    def create_cache(
        self, workload: Workload, *, config: Mapping[str, Any], num_layers: int, max_seq_len: int
    ) -> ContiguousKVCache:
        cfg = self.resolve_config(config)
        err = self._refusal(workload, cfg["op"])
        if err:
            raise ValueError(f"backend 'xformers' cannot run {workload.describe()}: {err}")
        return super().create_cache(workload, config=cfg, num_layers=num_layers, max_seq_len=max_seq_len)

    def plan(self, cache: KVCache, *, num_new: Sequence[int]) -> XformersPlan:
        base = base_plan(cache, num_new)
        plan = base.extend(XformersPlan)
        if plan.max_new == 1:
            plan.attn_bias = _attn_bias(plan.seq_lens_after, cache.max_seq_len, cache.device)
        return plan

    def attend(
        self, cache: ContiguousKVCache, plan: StepPlan, *, layer: int, q: torch.Tensor
    ) -> torch.Tensor:
        assert isinstance(plan, XformersPlan)
        return _attend(
            q,
            cache.k[layer],
            cache.v[layer],
            bias=plan.attn_bias,
            scale=cache.geometry.scale,
            op=cache.config["op"],
        )
