"""``flex`` — FlexAttention (``torch.nn.attention.flex_attention``) compiled with ``torch.compile``.

Decode attends one query per sequence over a contiguous heads-first cache (``k: [L, B, Hkv, S, Dk]``).

- **Ragged batches**: a :class:`~torch.nn.attention.flex_attention.BlockMask` built from the sequence
  lengths. For sequence ``b`` the first ``len_b // block_size`` KV blocks are *full* (no mask is
  evaluated), the block holding the last token is *partial* (``mask_mod``: ``kv_idx < lens[b]``) and the
  blocks past it are never visited, so a short sequence in a long cache costs only its own length.
- **GQA / MQA**: ``enable_gqa=True``; K/V are never repeated.
- **Compile time is kept out of every measurement.** ``torch.compile`` specialises on shapes
  (``dynamic=False``), so the cache capacity is rounded up to whole KV blocks and every tensor that the
  compiled call sees (the cache slabs, the block-mask tensors, the lengths) is allocated once in
  :meth:`FlexBackend.create_cache`, which then runs the compiled kernel once on them (the warm-up that
  compiles) and records how long that took in ``cache.compile_seconds``. :meth:`FlexBackend.plan`
  updates the block mask *in place*, so a decode call never meets a new shape or a new object and
  never compiles (the plugin's tests count compilations to prove it).

Because the block mask lives in the cache, only the most recent ``plan()`` of a cache is valid (as
in attnbench's step loop: plan, run every layer, commit).

Which call may allocate: ``create_cache`` (buffers, compilation), ``plan`` (the base plan's two small
tensors). ``decode`` writes the new K/V into the cache and runs the compiled kernel; ``plan``'s
block-mask update is in-place tensor work with no host-device sync.

Prefill uses attnbench's default (append, then grouped causal attention in torch): prompt lengths
vary, and a compiled prefill would compile once per length. Decode is what attnbench tunes.
"""

from __future__ import annotations

import functools
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from attnbench.core.backend import KVCache, StepPlan, Tunable, base_plan
from attnbench.core.kvcache import ContiguousBackend, ContiguousKVCache
from attnbench.core.workload import Workload

IMPLEMENTATION = "torch.compile(flex_attention)"
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: compiled entries one process may hold for flex_attention (torch's default of 8 is too few for a
#: tuning sweep over shapes); applied only while a cache compiles, never to other code.
_RECOMPILE_LIMIT = 256
#: query block of the block mask: torch's default, so the single decode query is one block
_Q_BLOCK = 128


@functools.cache
def _flex_import_error() -> str | None:
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError as err:
        return f"torch {torch.__version__} has no FlexAttention ({err})"
    return None


def _compiler_error(device_type: str) -> str | None:
    """What torch.compile lacks to compile flex_attention on ``device_type`` (None: nothing)."""
    if device_type == "cpu":
        cxx = [c for c in (os.environ.get("CXX"), "g++", "clang++") if c]
        if not any(shutil.which(c) for c in cxx):
            return f"torch.compile on CPU needs a C++ compiler; none of {', '.join(cxx)} is on PATH"
        return None
    if device_type == "cuda":
        from torch.utils._triton import has_triton

        if not torch.cuda.is_available():
            return "CUDA is not available to torch"
        if not has_triton():
            return "torch.compile on CUDA needs triton, which is not importable or has no GPU backend"
        return None
    return f"device type {device_type!r}: this backend compiles flex_attention for cpu and cuda only"


@functools.cache
def _compiled_flex() -> Callable[..., torch.Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False, fullgraph=True)


class FlexKVCache(ContiguousKVCache):
    """A heads-first contiguous cache plus the block-mask state the compiled kernel reads.

    ``lens: [B]`` int32 (the lengths ``mask_mod`` reads), ``kv_num_blocks``/``full_kv_num_blocks:
    [B, 1, 1]`` int32, ``kv_indices``/``full_kv_indices: [B, 1, 1, S // block_size]`` int32 — all
    updated in place by :meth:`FlexBackend.plan`; ``block_mask`` is built once over them.
    ``compile_seconds`` is the wall time of the compiling warm-up (not part of any measurement).
    """

    def __init__(self, *, block_size: int, **kwargs: Any) -> None:
        super().__init__(heads_first=True, **kwargs)
        from torch.nn.attention.flex_attention import BlockMask

        b, dev = self.batch, self.device
        self.block_size = block_size
        num_blocks = self.max_seq_len // block_size
        i32: dict[str, Any] = {"dtype": torch.int32, "device": dev}
        self.lens = torch.zeros(b, **i32)
        self.kv_num_blocks = torch.zeros(b, 1, 1, **i32)
        self.kv_indices = torch.zeros(b, 1, 1, num_blocks, **i32)
        self.full_kv_num_blocks = torch.zeros(b, 1, 1, **i32)
        self.full_kv_indices = torch.arange(num_blocks, **i32).expand(b, 1, 1, num_blocks).contiguous()
        lens = self.lens

        def mask_mod(
            b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            return kv_idx < lens[b]

        self.block_mask = BlockMask.from_kv_blocks(
            self.kv_num_blocks,
            self.kv_indices,
            self.full_kv_num_blocks,
            self.full_kv_indices,
            BLOCK_SIZE=(_Q_BLOCK, block_size),  # one query block, as create_block_mask would make
            mask_mod=mask_mod,
            seq_lengths=(1, self.max_seq_len),
            compute_q_blocks=False,
        )
        self.compile_seconds = float("nan")

    def set_lengths(self, lens: torch.Tensor) -> None:
        """Point the block mask at ``lens [B]`` (in place: no new tensor the compiled call could see)."""
        bs = self.block_size
        self.lens.copy_(lens)
        full = torch.div(self.lens, bs, rounding_mode="floor")  # [B] blocks with every token valid
        self.full_kv_num_blocks.copy_(full.view(-1, 1, 1))
        self.kv_num_blocks.copy_((self.lens % bs > 0).to(torch.int32).view(-1, 1, 1))  # the partial block
        self.kv_indices[:, 0, 0, 0].copy_(full.clamp(max=self.kv_indices.shape[-1] - 1))


class FlexBackend(ContiguousBackend):
    name = "flex"
    description = (
        "FlexAttention compiled by torch.compile; block mask for ragged lengths (compile time kept apart)"
    )
    tunables = (
        Tunable("block_size", (64, 128, 256), 128, "KV block of the block mask: sparsity granularity"),
    )

    def error_multiple(self, dtype: torch.dtype, *, config: Mapping[str, Any] | None = None) -> float:
        """4 in fp32, else the default 2. Compiled FlexAttention sums and exponentiates in its own
        order: in fp32, where the order is the error, a CI run's seed (2416528448, mla) made a
        ``max_abs`` error 3.6× the calibration reference's, 1.033 of the ×2 bound. Over 3,000 seeds per
        conformance case on one decode step (the suite's fresh-inputs test) one more seed failed ×2
        (mha, 1.005 of the bound; ``results/gate/gate-seeds-flex-single-x2-cpu.md``); such seeds need
        ×2.9–3.0 to stay under 0.8 of the bound. At ×4 the worst of 3,000 is 0.63 of it
        (``gate-seeds-flex-single-cpu.md``). In bf16 the worst over 300 seeds per case was 0.62 of ×2
        (``gate-seeds-flex-cpu.md``; ``python scripts/gate_seeds.py --backend flex``)."""
        return 4.0 if dtype == torch.float32 else super().error_multiple(dtype)

    def supports(self, workload: Workload) -> list[str]:
        reasons = []
        if workload.dtype not in _DTYPES:
            reasons.append(f"dtype {workload.dtype_name} not in (fp32, fp16, bf16)")
        err = _flex_import_error() or _compiler_error(torch.device(workload.device).type)
        if err:
            reasons.append(err)
        return reasons

    def implementation(self, workload: Workload) -> str:
        reasons = self.supports(workload)
        if reasons:
            return "unavailable: " + "; ".join(reasons)
        return f"{IMPLEMENTATION}[{torch.device(workload.device).type}]"

    def create_cache(
        self, workload: Workload, *, config: Mapping[str, Any], num_layers: int, max_seq_len: int
    ) -> FlexKVCache:
        """Allocate the cache (capacity rounded up to whole blocks) and compile the decode kernel.

        The compiling warm-up runs here, on the cache's own buffers; its wall time is stored in
        ``cache.compile_seconds``.
        """
        reasons = self.supports(workload)
        if reasons:
            raise ValueError(f"backend 'flex' cannot run {workload.describe()}: {'; '.join(reasons)}")
        cfg = self.resolve_config(config)
        bs = cfg["block_size"]
        capacity = -(-max(max_seq_len, 1) // bs) * bs
        cache = FlexKVCache(
            block_size=bs,
            workload=workload,
            geometry=workload.geometry(self.kv_form),
            config=cfg,
            num_layers=num_layers,
            max_seq_len=capacity,
        )
        self._compile(cache)
        return cache

    def _compile(self, cache: FlexKVCache) -> None:
        g = cache.geometry
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(cache.batch, g.num_q_heads, g.qk_head_dim, generator=gen).to(
            cache.device, cache.dtype
        )
        cache.set_lengths(
            torch.full((cache.batch,), cache.max_seq_len, dtype=torch.int32, device=cache.device)
        )
        limit = max(torch._dynamo.config.recompile_limit, _RECOMPILE_LIMIT)
        with torch._dynamo.config.patch(recompile_limit=limit, fail_on_recompile_limit_hit=True):
            start = time.perf_counter()
            self._attend(cache, 0, q)
            if cache.device.type == "cuda":
                torch.cuda.synchronize(cache.device)
            cache.compile_seconds = time.perf_counter() - start
        cache.set_lengths(torch.zeros(cache.batch, dtype=torch.int32, device=cache.device))

    def _attend(self, cache: FlexKVCache, layer: int, q: torch.Tensor) -> torch.Tensor:
        g = cache.geometry
        out = _compiled_flex()(
            q.contiguous().view(cache.batch, g.num_q_heads, 1, g.qk_head_dim),  # [B, Hq, 1, Dk]
            cache.k[layer],  # [B, Hkv, S, Dk]
            cache.v[layer],  # [B, Hkv, S, Dv]
            block_mask=cache.block_mask,
            scale=g.scale,
            enable_gqa=g.num_q_heads != g.num_kv_heads,
        )
        return out[:, :, 0]  # [B, Hq, Dv]

    def plan(self, cache: KVCache, *, num_new: Sequence[int]) -> StepPlan:
        assert isinstance(cache, FlexKVCache)
        plan = base_plan(cache, num_new)
        cache.set_lengths(plan.device_lens)
        return plan

    def attend(
        self, cache: ContiguousKVCache, plan: StepPlan, *, layer: int, q: torch.Tensor
    ) -> torch.Tensor:
        """The decode step's attention (``decode`` wrote the token first); never compiles."""
        assert isinstance(cache, FlexKVCache)
        return self._attend(cache, layer, q)
