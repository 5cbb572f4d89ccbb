"""``naive`` — plain PyTorch attention over a contiguous cache.

The baseline every other backend is measured against. GQA groups the query heads of one KV head
(``q: [B, Hkv, G, D]``) and multiplies against that head's keys, so repeated K/V are never
materialised. Scores and softmax are float32; the matmuls run in the cache dtype. Handles any head
dims (MLA's expanded form with ``Dk != Dv`` included) on any device torch supports.

Why decode loops over (sequence, KV head) with 2-D matmuls instead of one batched matmul over
``k[layer, :, :, :s]``: that slice is not contiguous (each head's ``s`` rows sit ``max_seq_len`` rows
apart), and torch's batched matmul copies a non-contiguous operand to a contiguous one first, so
every step read the whole cache, wrote a copy and read it again (about a fifth of the bandwidth of
the same math on contiguous K/V, on a CPU). One head's first ``s`` rows *are* contiguous, so a 2-D
matmul reads them in place. Each sequence attends over its own length, so a ragged batch needs no
mask. On CUDA, where the batched kernels take strided operands, the batched form is kept (one
launch per layer instead of ``B · Hkv``).

Not capturable (``capturable = False``), on purpose: it is the plain baseline, so every step slices
K/V to the step's lengths (host integers) and ``plan()`` may allocate (the ragged-batch mask on CUDA).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from attnbench.core.backend import KVCache, StepPlan, base_plan
from attnbench.core.kvcache import ContiguousBackend, ContiguousKVCache
from attnbench.core.shapes import AttentionGeometry
from attnbench.core.workload import Workload


@dataclass
class NaivePlan(StepPlan):
    """The base plan plus a ragged batch's mask ``[B, 1, 1, S]`` (CUDA's batched path only)."""

    mask: torch.Tensor | None = None


class NaiveBackend(ContiguousBackend):
    name = "naive"
    description = "plain torch matmul + softmax over a contiguous cache (the baseline)"
    tunables = ()
    #: the length-sliced baseline: host lengths in every step, so a captured graph would replay stale
    capturable: ClassVar[bool] = False

    def implementation(self, workload: Workload) -> str:
        return "torch.matmul"

    def error_multiple(self, dtype: torch.dtype, *, config: Mapping[str, Any] | None = None) -> float:
        """24 in bf16/fp16, else the default 2. torch's matmul on a 16-bit cache returns 16-bit
        results (the CPU has no float32-output variant), so the scores are rounded to the cache dtype
        before the float32 softmax — at the logits a needle probe plants (~10–13) bf16 keeps about two
        decimals — and P is rounded again for P·V. Measured on needle probes (scripts/gate_matrix.py,
        30 seeds): 7–8× the calibration reference's error at 1k, growing to 15–16× at 32k–128k as the
        logits grow with ln(context); 24 keeps the worst under 0.8 of the bound."""
        return 24.0 if dtype in (torch.float16, torch.bfloat16) else super().error_multiple(dtype)

    def supports(self, workload: Workload) -> list[str]:
        if workload.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return [f"dtype {workload.dtype_name} not in (fp32, fp16, bf16)"]
        return []

    def plan(self, cache: KVCache, *, num_new: Sequence[int]) -> NaivePlan:
        """Host work once per step; allocates the ragged-batch mask on CUDA (not capturable)."""
        plan = base_plan(cache, num_new).extend(NaivePlan)
        s = max(plan.seq_lens_after)
        if cache.device.type == "cuda" and len(set(plan.seq_lens_after)) > 1:
            # ragged batch on the batched path: mask the tail of shorter sequences, once per step
            cols = torch.arange(s, device=cache.device)
            plan.mask = (cols[None, :] >= plan.device_lens[:, None])[:, None, None, :]  # [B, 1, 1, S]
        return plan

    def attend(
        self, cache: ContiguousKVCache, plan: StepPlan, *, layer: int, q: torch.Tensor
    ) -> torch.Tensor:
        if cache.device.type != "cuda":
            return self._decode_per_head(cache, plan, layer=layer, q=q)
        s = max(plan.seq_lens_after)
        mask = plan.mask if isinstance(plan, NaivePlan) else None
        return grouped_attention(
            q, cache.k[layer, :, :, :s], cache.v[layer, :, :, :s], cache.geometry, mask=mask
        )

    def _decode_per_head(
        self, cache: ContiguousKVCache, plan: StepPlan, *, layer: int, q: torch.Tensor
    ) -> torch.Tensor:
        """One 2-D matmul pair per (sequence, KV head), each over that head's contiguous rows."""
        g = cache.geometry
        b = q.shape[0]
        qg = q.view(b, g.num_kv_heads, g.group_size, g.qk_head_dim)  # [B, Hkv, G, Dk]
        out = q.new_empty(b, g.num_kv_heads, g.group_size, g.v_head_dim)  # [B, Hkv, G, Dv]
        keys, values = cache.k[layer], cache.v[layer]  # [B, Hkv, S_max, D]
        for i, s in enumerate(plan.seq_lens_after):
            for h in range(g.num_kv_heads):
                scores = torch.matmul(qg[i, h], keys[i, h, :s].t()).float().mul_(g.scale)  # [G, s]
                probs = torch.softmax(scores, dim=-1).to(values.dtype)
                torch.matmul(probs, values[i, h, :s], out=out[i, h])  # [G, Dv]
        return out.view(b, g.num_q_heads, g.v_head_dim)


def grouped_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    geometry: AttentionGeometry,
    *,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """``q [B, Hq, Dk]`` over ``keys [B, Hkv, S, Dk]``, ``values [B, Hkv, S, Dv]`` → ``[B, Hq, Dv]``: batched
    matmuls with the query heads of one KV head grouped (K/V never repeated), float32 scores and
    softmax; ``mask`` (broadcast to ``[B, Hkv, G, S]``) is True where a position is left out."""
    g = geometry
    b = q.shape[0]
    qg = q.view(b, g.num_kv_heads, g.group_size, g.qk_head_dim)  # [B, Hkv, G, Dk]
    scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * g.scale  # [B, Hkv, G, S]
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    out = torch.matmul(probs, values)  # [B, Hkv, G, Dv]
    return out.view(b, g.num_q_heads, g.v_head_dim)
