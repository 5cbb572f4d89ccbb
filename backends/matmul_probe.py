"""``matmul_probe`` — the naive math over *contiguous* per-head K/V: a bandwidth probe for ``bench --probe``.

Not registered (``tune`` and ``select()`` never see it): ``attnbench bench --probe`` adds it as one
more row, so every run shows what a plain batched matmul reaches when nothing is copied. Its cache
is :class:`~attnbench.core.kvcache.ContiguousKVCache` (heads first), and decode multiplies against the
*whole* per-layer buffer ``k[layer]: [B, Hkv, S_max, D]`` — a contiguous tensor, which torch's
batched matmul reads in place — masking the slots past each sequence's length. It therefore reads
``max_seq_len`` slots per sequence, not the sequence's length: in ``bench`` that is the context plus
the few tokens the timed steps append (e.g. 8192 + 14), so its bytes match the row's KV bytes to
within a fraction of a percent; with a cache sized far beyond the context it would waste reads,
which is why it is a probe and not a backend.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from attnbench.backends.naive import NaiveBackend, NaivePlan, grouped_attention
from attnbench.core.backend import KVCache, StepPlan, base_plan
from attnbench.core.kvcache import ContiguousKVCache
from attnbench.core.workload import Workload


class MatmulProbeBackend(NaiveBackend):
    """``naive``'s cache, dtypes and rounding (its error bound too); only decode's matmul differs."""

    name = "matmul_probe"
    description = "probe: batched torch.matmul over the whole contiguous cache buffer (bench --probe only)"

    def implementation(self, workload: Workload) -> str:
        return "torch.matmul[contiguous K/V]"

    def plan(self, cache: KVCache, *, num_new: Sequence[int]) -> NaivePlan:
        base = base_plan(cache, num_new)
        cols = torch.arange(cache.max_seq_len, device=cache.device)
        mask = (cols[None, :] >= base.device_lens[:, None])[:, None, None, :]  # [B, 1, 1, S_max]
        return base.extend(NaivePlan, mask=mask)

    def attend(
        self, cache: ContiguousKVCache, plan: StepPlan, *, layer: int, q: torch.Tensor
    ) -> torch.Tensor:
        assert isinstance(plan, NaivePlan) and plan.mask is not None
        return grouped_attention(q, cache.k[layer], cache.v[layer], cache.geometry, mask=plan.mask)
