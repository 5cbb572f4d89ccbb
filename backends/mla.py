"""``mla`` — absorbed MLA decode over a paged latent cache (DeepSeek-V2/V3).

The cache holds, per token and layer, one row ``[c | k_pe]`` of ``kv_lora_rank + qk_rope_head_dim``
values (576 for DeepSeek-V3: 70,272 bytes per token over 61 layers in bf16), shared by all heads, in
pages of ``page_size`` tokens (:class:`attnbench.kernels.paged.PagedKVCache` with ``share_v``: the value is
the first ``kv_lora_rank`` columns of the same row, stored once). Decode takes the absorbed query
``q [B, H, rank + rope]`` (see :func:`attnbench.models.mla.latent_query`) and returns the latent output
``[B, H, rank]`` (apply :func:`attnbench.models.mla.expand_output` after). All heads share one KV head: the
MQA case, with a very wide head.

Two implementations, and ``implementation()`` says which one runs:

- ``triton`` (CUDA, or on CPU under ``TRITON_INTERPRET=1`` for testing): the split-KV family kernel
  of :mod:`attnbench.kernels.triton_decode` in its latent form (``LATENT``): program ``(b, head block,
  split)`` walks its share of the sequence through the block table in tiles of ``BLOCK_N`` tokens,
  computes ``[BLOCK_H, BLOCK_N]`` scores as ``q_lat·c + q_pe·k_pe`` (two dots, ``c`` loaded once and
  reused as the value), keeps an online softmax and a ``[BLOCK_H, rank]`` accumulator; the family's
  merge combines the splits by their log-sum-exp. Tiles are declared as data (:data:`TILES`).
- ``torch`` (everywhere): gathers the sequence's pages through the block table and runs two batched
  matmuls with a float32 softmax.

Which call does what: ``create_cache`` allocates everything once (pages, the plan's buffers, the split
partials); ``plan()`` is host work once per step that fills them in place (no device allocation).
``decode()`` writes the new row and attends with no host sync. The Triton path is **capturable**:
lengths come from the device and the split count is fixed per context bucket, so a CUDA graph of a
step replays for every step of the bucket. The torch path slices to the step's longest sequence
and allocates the gathered pages: not capturable. Prefill runs causal attention on the given latent
rows (the absorbed form).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch

from attnbench.core.backend import (
    DEFAULT_TOLERANCES,
    Backend,
    KVCache,
    Resolution,
    StepPlan,
    Tolerance,
    Tunable,
)
from attnbench.core.workload import Workload
from attnbench.kernels.paged import PagedKVCache, PagedStepPlan, cdiv
from attnbench.kernels.split_kv import SplitKVPlan, attach_split_kv, decode_split_kv, plan_split_kv
from attnbench.kernels.triton_decode import DecodeSpec
from attnbench.kernels.triton_utils import TritonMode, triton_mode


@dataclass(frozen=True)
class Tile:
    """One launch configuration of the split-KV kernel."""

    block_h: int  # query heads per program (tl.dot needs ≥ 16)
    block_n: int  # cached tokens per inner step
    num_warps: int
    num_stages: int


#: The tile configurations the kernel declares; every one is compiled for sm_80 and sm_90 in the tests.
TILES: dict[str, Tile] = {
    "h16_n32_w4": Tile(16, 32, 4, 2),
    "h16_n64_w8": Tile(16, 64, 8, 2),
    "h32_n64_w8": Tile(32, 64, 8, 2),
    "h32_n32_w8": Tile(32, 32, 8, 2),
}
SPLIT_CHOICES = (0, 1, 2, 4, 8, 16, 32)  # 0: chosen from the batch, heads and SM count
KERNELS = ("auto", "triton", "torch")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def effective_tile(name: str, dtype: torch.dtype) -> Tile:
    """The tile that runs for ``dtype``: float32 rows are twice as wide, so BLOCK_N is capped at 32 to
    stay within sm_80's shared memory (163 KiB per block)."""
    tile = TILES[name]
    if dtype == torch.float32 and tile.block_n > 32:
        return Tile(tile.block_h, 32, tile.num_warps, tile.num_stages)
    return tile


def decode_spec(tile: str, dtype: torch.dtype, *, heads: int, dk: int, dv: int, page_size: int) -> DecodeSpec:
    """The family kernel's launch shape for one tile: the latent form, all heads on one KV head."""
    t = effective_tile(tile, dtype)
    shape = DecodeSpec(heads, dk, dv, page_size, t.block_n, block_g=t.block_h, latent=True)
    return replace(shape, num_warps=t.num_warps, num_stages=t.num_stages)


@dataclass
class MLATorchPlan(PagedStepPlan):
    """The torch path's plan: the step's pages and padding mask, prefix views of the cache's buffers."""

    pages: torch.Tensor | None = None  # [B, P] int64: the first P block-table columns
    pad: torch.Tensor | None = None  # [B, 1, P * page_size] bool: True past each sequence's length


class LatentCache(PagedKVCache):
    """The paged latent cache (``share_v``) plus what the chosen implementation needs, declared."""

    implementation: str  # "triton" or "torch"
    page_index: torch.Tensor  # torch path: [B * pages_per_seq] int64
    pad_buffer: torch.Tensor  # torch path: [B * max_seq_len] bool
    columns: torch.Tensor  # torch path: arange(max_seq_len)


class MLABackend(Backend):
    name = "mla"
    description = "MLA absorbed decode over a paged latent cache (Triton split-KV on CUDA, torch elsewhere)"
    kv_form = "latent"
    #: the Triton path's decode steps replay as CUDA graphs (the torch path's do not)
    capturable: ClassVar[bool] = True
    tunables: ClassVar[tuple[Tunable, ...]] = (
        Tunable("page_size", (16, 32, 64, 128), 64, "tokens per cache page"),
        Tunable(
            "kernel", KERNELS, "auto", "auto: triton where it runs (CUDA, or the interpreter), else torch"
        ),
        Tunable("num_splits", SPLIT_CHOICES, 0, "split-KV programs per sequence (triton); 0 = from SM count"),
        Tunable("tile", tuple(TILES), "h16_n32_w4", "triton tile: heads × tokens per step, warps"),
    )

    # -- what it can do --------------------------------------------------------------------------
    def tolerance(self, dtype: torch.dtype) -> Tolerance:
        """The defaults. The latent rows are 576 wide, so logits are ~1.7× those of a 192-wide head; the
        torch path computes ``q·rowsᵀ`` in fp32 (in bf16 it rounded the largest scores by ±0.014 after
        scaling and failed the gate at DeepSeek-V3's geometry: rel_l2 0.0136 against 0.0112), P is
        rounded to bf16 for P·V as flash attention does."""
        return DEFAULT_TOLERANCES[dtype]

    def error_multiple(self, dtype: torch.dtype, *, config: Mapping[str, Any] | None = None) -> float:
        """In bf16/fp16: 6, for both paths: P rounded to the cache dtype for the P·V dot, as
        FlashAttention does (the Triton kernel ~3× measured; the torch path, whose scores are fp32,
        1.38–1.41× in rel_l2 and at most 0.164 of its then ×10 bound over 5 seeds at DeepSeek-V3's
        latent geometry, 1k–32k, scripts/gate_matrix.py). The torch path had ×10 while it rounded its
        scores to bf16 (4–8× on needle probes). fp32: the default 2."""
        if dtype not in (torch.float16, torch.bfloat16):
            return super().error_multiple(dtype)
        return 6.0

    def _kernel(self, workload: Workload, config: Mapping[str, Any]) -> tuple[str, list[str]]:
        """The implementation ``config`` selects on ``workload``'s device, and why it cannot run."""
        choice = config.get("kernel", "auto")
        mode, why = triton_mode(workload.device)
        if choice == "triton" and mode is None:
            return "triton", [f"kernel = 'triton' cannot run on {workload.device}: {why}"]
        if choice == "auto":  # float32 on a GPU: torch (the fp32 kernel uses exact, slow FMA dots)
            native_fp32 = mode == "native" and workload.dtype == torch.float32
            return ("triton" if mode is not None and not native_fp32 else "torch"), []
        return choice, []

    def resolve(self, workload: Workload, config: Mapping[str, Any] | None = None) -> Resolution:
        cfg = self.resolve_config(config)
        reasons = []
        if not workload.shape.is_mla:
            reasons.append(
                f"model {workload.shape.name!r} is not MLA (no kv_lora_rank); mla needs the latent form"
            )
        if workload.dtype not in DTYPES:
            reasons.append(f"dtype {workload.dtype_name} not in (fp32, fp16, bf16)")
        kernel, why = self._kernel(workload, cfg)
        reasons += why
        mode = triton_mode(workload.device)[0]
        if kernel == "torch":
            impl, tunables = "torch.matmul (paged gather)", self.tunables[:1]
        else:
            impl = f"triton split-KV ({mode})"
            tunables = (
                self.tunables[0],
                replace(self.tunables[1], choices=("triton", "torch"), default="triton"),
            )
            tunables += self.tunables[2:]
        return self.resolution(
            workload,
            cfg,
            reasons=reasons,
            implementation=impl,
            interpreted=kernel == "triton" and mode == "interpreted",
            tunables=tunables,
        )

    # -- the cache and the step ------------------------------------------------------------------
    def create_cache(
        self, workload: Workload, *, config: Mapping[str, Any], num_layers: int, max_seq_len: int
    ) -> LatentCache:
        """Allocates the pages and every per-step buffer, once (the only call that allocates)."""
        res = self.resolve(workload, config).require()
        cfg = dict(res.config)
        cache = LatentCache(
            **self.cache_fields(workload, cfg, num_layers, max_seq_len),
            page_size=cfg["page_size"],
            page_order="random",  # a fragmented pool, as in a long-running server
            share_v=True,
        )
        cache.implementation = self._kernel(workload, cfg)[0]
        g, dev = cache.geometry, cache.device
        if cache.implementation == "triton":
            spec = decode_spec(
                cfg["tile"], workload.dtype, heads=g.num_q_heads, dk=g.qk_head_dim, dv=g.v_head_dim,
                page_size=cache.page_size,
            )  # fmt: skip
            mode: TritonMode = "interpreted" if res.interpreted else "native"
            attach_split_kv(
                cache, spec=spec, mode=mode, num_splits=cfg["num_splits"], max_splits=max(SPLIT_CHOICES)
            )
        else:
            cache.page_index = torch.zeros(cache.batch * cache.pages_per_seq, dtype=torch.int64, device=dev)
            cache.pad_buffer = torch.zeros(
                cache.batch * cache.pages_per_seq * cache.page_size, dtype=torch.bool, device=dev
            )
            cache.columns = torch.arange(cache.pages_per_seq * cache.page_size, device=dev)
        return cache

    def plan(self, cache: KVCache, *, num_new: Sequence[int]) -> PagedStepPlan:
        """Host work once per step, into the cache's buffers. The Triton path's plan is capturable;
        the torch path's views are sized by this step's longest sequence (not capturable)."""
        assert isinstance(cache, LatentCache)
        if cache.implementation == "triton":
            return plan_split_kv(cache, num_new)
        plan = cache.plan_step(num_new)
        pages = cdiv(max(plan.seq_lens_after), cache.page_size)
        b, s = cache.batch, pages * cache.page_size
        index = cache.page_index[: b * pages].view(b, pages)
        index.copy_(cache.block_table[:, :pages])
        pad = cache.pad_buffer[: b * s].view(b, 1, s)
        torch.ge(cache.columns[None, :s], plan.device_lens[:, None], out=pad[:, 0])
        return plan.extend(MLATorchPlan, pages=index, pad=pad)

    def decode(
        self, cache: KVCache, plan: StepPlan, *, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """``q [B, H, rank + rope]`` (absorbed), ``k [B, 1, rank + rope]`` → latent output ``[B, H, rank]``."""
        assert isinstance(cache, LatentCache)
        cache.write(plan, layer=layer, k=k[:, None], v=v[:, None])
        if isinstance(plan, SplitKVPlan):
            return decode_split_kv(cache, plan, q=q, k_pages=cache.k_pages[layer], v_pages=None)
        assert isinstance(plan, MLATorchPlan) and plan.pages is not None and plan.pad is not None
        g = cache.geometry
        b = q.shape[0]
        rows = cache.k_pages[layer][plan.pages].view(b, -1, g.qk_head_dim)  # [B, S_pad, D]
        # fp32 scores: a bf16 matmul would round them before the softmax, and 576-wide latent rows give
        # logits large enough for that rounding to fail the gate (rel_l2 0.0136 against a bound of
        # 0.0112 at DeepSeek-V3's geometry, batch 1 × 8k)
        scores = torch.matmul(q.float(), rows.transpose(1, 2).float()) * g.scale  # [B, H, S_pad]
        scores = scores.masked_fill(plan.pad, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(rows.dtype)
        return torch.matmul(probs, rows[..., : g.v_head_dim])  # [B, H, rank]


__all__ = ["TILES", "LatentCache", "MLABackend", "MLATorchPlan", "Tile", "decode_spec", "effective_tile"]
