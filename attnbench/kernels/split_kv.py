"""Split-KV decode state and step plans, shared by the backends of the Triton decode family.

A paged cache read by :func:`attnbench.kernels.triton_decode.launch_decode` carries one :class:`SplitKV`
(its declared ``split_kv`` attribute): the launch shape, where Triton runs, the configured split count
and the partial buffers, allocated once for the cache's batch and the most splits it can ever use.
:func:`plan_split_kv` (host work, once per step; allocates nothing on the device) fills the paged
plan's buffers in place and picks the split count of the step's *context bucket*
(:func:`attnbench.kernels.triton_decode.context_bucket`), so every step of a bucket launches the same grid
and a CUDA graph captured for one step replays for the others (one graph per batch, bucket,
backend and config). :func:`decode_split_kv` is capturable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from attnbench.kernels.paged import PagedKVCache, PagedStepPlan
from attnbench.kernels.triton_decode import (
    DecodeSpec,
    auto_splits,
    context_bucket,
    device_programs,
    launch_decode,
)
from attnbench.kernels.triton_utils import TritonMode

__all__ = ["SplitKV", "SplitKVPlan", "attach_split_kv", "decode_split_kv", "plan_split_kv"]


@dataclass
class SplitKV:
    """What a cache read by the split-KV kernels needs besides its pages (allocated once)."""

    spec: DecodeSpec
    mode: TritonMode  # attnbench.kernels.triton_utils.triton_mode
    configured_splits: int  # the config's num_splits; 0: chosen per context bucket
    part_o: torch.Tensor  # [B, Hq, capacity, Dv] float32 scratch
    part_lse: torch.Tensor  # [B, Hq, capacity] float32 scratch

    def splits_for(self, *, batch: int, kv_heads: int, bucket: int, device: torch.device) -> int:
        """The split count of a context bucket (a pure function of the bucket: graphs replay)."""
        if self.configured_splits:
            return self.configured_splits
        return auto_splits(
            programs_per_split=batch * kv_heads * self.spec.head_blocks(),
            max_len=bucket,
            block_n=self.spec.block_n,
            programs=device_programs(device),
            max_splits=self.part_lse.shape[-1],
        )


@dataclass
class SplitKVPlan(PagedStepPlan):
    """A paged plan plus the step's split count; the partial buffers are the cache's (scratch)."""

    bucket: int = 0
    num_splits: int = 1
    part_o: torch.Tensor | None = field(default=None, metadata={"scratch": True})
    part_lse: torch.Tensor | None = field(default=None, metadata={"scratch": True})


def attach_split_kv(
    cache: PagedKVCache, *, spec: DecodeSpec, mode: TritonMode, num_splits: int, max_splits: int
) -> SplitKV:
    """Give ``cache`` its split-KV state; the partial buffers hold the most splits any bucket up to
    ``cache.max_seq_len`` can use (allocates, once)."""
    g = cache.geometry
    probe = SplitKV(spec, mode, num_splits, torch.empty(0), torch.empty(1, 1, max_splits))  # no storage
    capacity = probe.splits_for(
        batch=cache.batch, kv_heads=g.num_kv_heads, bucket=cache.max_seq_len, device=cache.device
    )
    f32: dict[str, Any] = {"dtype": torch.float32, "device": cache.device}
    cache.split_kv = SplitKV(
        spec=spec,
        mode=mode,
        configured_splits=num_splits,
        part_o=torch.empty(cache.batch, g.num_q_heads, capacity, g.v_head_dim, **f32),
        part_lse=torch.empty(cache.batch, g.num_q_heads, capacity, **f32),
    )
    cache.capturable = True
    return cache.split_kv


def plan_split_kv(cache: PagedKVCache, num_new: Sequence[int]) -> SplitKVPlan:
    """The step's plan: pages reserved, lengths, slots and block table filled in the cache's buffers."""
    state = cache.split_kv
    if state is None:
        raise TypeError("split-KV plan: the cache has no split_kv state (attach_split_kv first)")
    plan = cache.plan_step(num_new)
    bucket = context_bucket(max(plan.seq_lens_after), max_seq_len=cache.max_seq_len)
    splits = state.splits_for(
        batch=cache.batch, kv_heads=cache.geometry.num_kv_heads, bucket=bucket, device=cache.device
    )
    return plan.extend(
        SplitKVPlan,
        bucket=bucket,
        num_splits=splits,
        part_o=state.part_o,
        part_lse=state.part_lse,
    )


def decode_split_kv(cache: PagedKVCache, plan: SplitKVPlan, *, q: torch.Tensor, **pages: Any) -> torch.Tensor:
    """One layer's attention over pages already holding the new token (``pages``: the keyword
    arguments of :func:`~attnbench.kernels.triton_decode.launch_decode` that name the layer's pages and fp8
    scales). Capturable: allocates only the output, no host sync, the grid fixed by the bucket."""
    state = cache.split_kv
    assert state is not None and plan.part_o is not None and plan.part_lse is not None
    return launch_decode(
        spec=state.spec, mode=state.mode, plan=plan, q=q, scale=cache.geometry.scale, **pages
    )
