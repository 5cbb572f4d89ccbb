"""``triton_paged`` — Triton decode attention over a paged KV cache, with split-KV (flash-decoding).

The cache is an :class:`attnbench.kernels.paged.PagedKVCache` (``k_pages: [L, P, page_size, Hkv, D]``, a block
table per sequence, pages handed out in a random order). One decode call per layer:

1. ``cache.write``: the new token's K/V go to their slots (one ``index_copy_`` each);
2. the family's split-KV kernel (:mod:`attnbench.kernels.triton_decode`, expanded form, cache dtype = compute
   dtype), grid ``(B, Hkv, num_splits)``: each program takes one KV head of one sequence and one
   contiguous share of its tokens, loads each ``[block_n, D]`` K/V tile *once* for all
   ``G = Hq / Hkv`` query heads of the group and runs an online softmax over the tiles;
3. with several splits, the family's merge kernel combines the partials by their log-sum-exp.

Which call does what: ``create_cache`` allocates everything, once (pages, block table, the plan's
length/slot buffers, the split partials for the most splits any context bucket can use);
``plan()`` is host work once per step that fills those buffers in place (no device allocation) and
fixes the split count per context bucket; ``decode()`` allocates only its output, does no host sync
and reads lengths from the device: **capturable** — a CUDA graph of a whole step replays for every
step of the same (batch, bucket, config). Prefill uses the base class: write the pages, then torch
attention over the given K/V (not captured).

Runs natively on CUDA; on the CPU only in the Triton interpreter (``TRITON_INTERPRET=1``), where it is
checked for correctness and never timed. Every specialisation is compiled ahead of time for sm_80
and sm_90 in the tests (:mod:`attnbench.correctness.aot`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal

import torch

from attnbench.core.backend import Backend, KVCache, Resolution, StepPlan, Tunable
from attnbench.core.workload import Workload
from attnbench.kernels.paged import PagedKVCache
from attnbench.kernels.split_kv import SplitKVPlan, attach_split_kv, decode_split_kv, plan_split_kv
from attnbench.kernels.triton_decode import DecodeSpec
from attnbench.kernels.triton_utils import TritonMode, triton_mode

# -- the search space, as data ------------------------------------------------------------------------
PAGE_SIZES = (16, 32, 64, 128, 256)
NUM_SPLITS = (0, 1, 2, 4, 8, 16)  # 0: chosen per context bucket from batch × KV heads vs the device's SMs
BLOCK_N = (16, 32, 64)  # tokens per K/V tile
NUM_WARPS = {16: 4, 32: 4, 64: 4}  # by block_n
NUM_STAGES = 2
MAX_SPLITS = max(NUM_SPLITS)
MAX_HEAD_DIM = 256
MAX_GROUP = 64
DTYPES = (torch.float32, torch.float16, torch.bfloat16)

#: geometries compiled ahead of time besides Llama-3.1-8B's (bf16, 4 query heads per KV head, head_dim
#: 128), at the default tile config: fp32 and fp16; head_dim 64 with 8 per KV head; MLA's expanded
#: form (DeepSeek-V3: Dk 192 ≠ Dv 128, one per KV head); 16 per KV head (Llama-3.1-405B); the largest
AOT_GEOMETRIES: tuple[tuple[torch.dtype, int, int, int], ...] = (
    (torch.float32, 4, 128, 128),
    (torch.float16, 4, 128, 128),
    (torch.bfloat16, 8, 64, 64),
    (torch.bfloat16, 1, 192, 128),
    (torch.bfloat16, 16, 128, 128),
    (torch.bfloat16, MAX_GROUP, MAX_HEAD_DIM, MAX_HEAD_DIM),
)


class TritonPagedBackend(Backend):
    name = "triton_paged"
    description = "Triton paged-KV decode: GQA-grouped tiles, online softmax, split-KV with a merge"
    tunables = (
        Tunable("page_size", PAGE_SIZES, 16, "tokens per KV page"),
        Tunable("num_splits", NUM_SPLITS, 0, "split-KV programs per sequence and KV head; 0 = auto"),
        Tunable("block_n", BLOCK_N, 32, "tokens per K/V tile loaded by one program"),
    )
    #: decode steps replay as CUDA graphs (lengths on the device, grid fixed per context bucket)
    capturable: ClassVar[bool] = True
    #: order in which pages are handed out; "random" models a long-running server and catches kernels
    #: that assume a sequence's pages are contiguous
    page_order: ClassVar[Literal["sequential", "random"]] = "random"

    # -- availability ----------------------------------------------------------------------------
    def error_multiple(self, dtype: torch.dtype, *, config: Mapping[str, Any] | None = None) -> float:
        """6 in bf16, else the default 2: the kernel rounds P to the cache dtype for the tensor-core
        P·V dot (as FlashAttention does), which in bf16 costs up to ~4× the calibration reference's
        error on needle probes, where a few probabilities near 0.3 carry the output."""
        return 6.0 if dtype == torch.bfloat16 else super().error_multiple(dtype)

    def resolve(self, workload: Workload, config: Mapping[str, Any] | None = None) -> Resolution:
        reasons = []
        mode, why = triton_mode(workload.device)
        if mode is None:
            reasons.append(why)
        if workload.dtype not in DTYPES:
            reasons.append(f"dtype {workload.dtype_name} not in (fp32, fp16, bf16)")
        g = workload.geometry(self.kv_form)
        if max(g.qk_head_dim, g.v_head_dim) > MAX_HEAD_DIM:
            reasons.append(f"head_dim {max(g.qk_head_dim, g.v_head_dim)} > {MAX_HEAD_DIM}")
        if g.group_size > MAX_GROUP:
            reasons.append(f"query heads per KV head {g.group_size} > {MAX_GROUP}")
        return self.resolution(
            workload,
            config,
            reasons=reasons,
            implementation=f"triton[{mode}]",
            interpreted=mode == "interpreted",
            tunables=self.tunables,
        )

    # -- cache and plan --------------------------------------------------------------------------
    def create_cache(
        self, workload: Workload, *, config: Mapping[str, Any], num_layers: int, max_seq_len: int
    ) -> PagedKVCache:
        """Allocates the pages and every per-step buffer, once (the only call that allocates)."""
        res = self.resolve(workload, config).require()
        cfg = dict(res.config)
        g = workload.geometry(self.kv_form)
        cache = PagedKVCache(
            **self.cache_fields(workload, cfg, num_layers, max_seq_len),
            page_size=cfg["page_size"],
            page_order=self.page_order,
        )
        spec = DecodeSpec(
            group=g.group_size,
            dk=g.qk_head_dim,
            dv=g.v_head_dim,
            page_size=cfg["page_size"],
            block_n=cfg["block_n"],
            num_warps=NUM_WARPS[cfg["block_n"]],
            num_stages=NUM_STAGES,
        )
        mode: TritonMode = "interpreted" if res.interpreted else "native"
        attach_split_kv(cache, spec=spec, mode=mode, num_splits=cfg["num_splits"], max_splits=MAX_SPLITS)
        return cache

    def plan(self, cache: KVCache, *, num_new: Sequence[int]) -> SplitKVPlan:
        """Host work once per step; fills the cache's buffers in place (allocates nothing on the device)."""
        assert isinstance(cache, PagedKVCache)
        return plan_split_kv(cache, num_new)

    # -- the step --------------------------------------------------------------------------------
    def decode(
        self, cache: KVCache, plan: StepPlan, *, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """``q [B, Hq, Dk]``, new ``k [B, Hkv, Dk]``/``v [B, Hkv, Dv]`` → ``[B, Hq, Dv]``. Capturable."""
        assert isinstance(cache, PagedKVCache) and isinstance(plan, SplitKVPlan)
        cache.write(plan, layer=layer, k=k[:, None], v=v[:, None])
        return decode_split_kv(cache, plan, q=q, k_pages=cache.k_pages[layer], v_pages=cache.v_pages[layer])
