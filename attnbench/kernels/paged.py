"""A paged KV cache: a pool of fixed-size pages per layer and a block table per sequence.

Any backend that reads K/V through a block table can own one of these (``triton_paged``, fp8, MLA).
The layout is flash-attn's / vLLM's paged ("NHD") layout, so ``flash_attn_with_kvcache(block_table=...)``
could read it too::

    k_pages:     [L, num_pages, page_size, Hkv, Dk]
    v_pages:     [L, num_pages, page_size, Hkv, Dv]   (latent form: a view of k_pages[..., :Dv])
    block_table: [B, max_pages_per_seq] int32, on the cache's device

Token ``t`` of sequence ``i`` lives in page ``block_table[i, t // page_size]`` at row
``t % page_size``; its flat *slot* is ``page * page_size + t % page_size``, an index into
``k_pages[layer].view(-1, Hkv, Dk)``. Entries of the block table past a sequence's last page are 0
and must never be read unmasked.

Pages are handed out from a free list in the order chosen at construction: ``"sequential"`` (page
``j`` of sequence ``i`` is page ``i * pages_per_seq + j`` when the batch grows in lockstep) or
``"random"`` (a seeded random permutation of the pool, so that neighbouring tokens of a sequence sit
in far-apart pages, as in a long-running server; tests use it to catch kernels that assume order).

Which call does what::

    cache = PagedKVCache(workload=w, geometry=g, config=cfg, num_layers=L, max_seq_len=S,
                         page_size=16, page_order="random", seed=0)  # allocates the pool
    plan = cache.plan_step(num_new)              # host work, once per step: reserves pages, updates
                                                 # the device block table, builds the slot mapping
    cache.write(plan, layer=l, k=k, v=v)         # per layer: one index_copy_, no host sync (capturable)
    cache.commit(plan)                           # after the last layer

``plan_step`` fills buffers the cache allocated once (lengths, slots, the block table) in place: one
small host-to-device copy each, no device allocation, so the plan a CUDA graph was captured with
stays valid for later steps; ``write`` allocates nothing on the host and does no host-device sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from attnbench.core.backend import KVCache, StepPlan, base_plan

if TYPE_CHECKING:
    from attnbench.kernels.split_kv import SplitKV

__all__ = ["PAGE_ORDERS", "PagedKVCache", "PagedStepPlan", "cdiv"]

PAGE_ORDERS = ("sequential", "random")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PagedStepPlan(StepPlan):
    """A :class:`StepPlan` plus what a paged cache needs to write the step's new tokens.

    ``block_table`` is the cache's device table ``[B, max_pages_per_seq]`` (int32) as of this step.
    ``slots`` ``[N]`` (int64) is the flat slot of each new token, in the order of ``src``;
    ``src`` ``[N]`` (int64) indexes the new tokens in the flattened right-padded ``[B * T]`` input,
    or is ``None`` when every row is full (``num_new`` uniform, e.g. decode: ``N = B * T``). All three
    are the cache's buffers (``slots``/``src``: views of their first ``N`` entries), filled in place.
    """

    block_table: torch.Tensor | None = None
    slots: torch.Tensor | None = None
    src: torch.Tensor | None = None


class PagedKVCache(KVCache):
    """Pages of ``page_size`` tokens for K and V, a block table and a length per sequence.

    Args:
        page_size: tokens per page (any positive integer; kernels usually want a power of two).
        num_pages: pages in the pool; default ``batch * ceil(max_seq_len / page_size)`` (exactly
            enough for every sequence to reach ``max_seq_len``).
        page_order: ``"sequential"`` or ``"random"`` (a permutation drawn from ``seed``).
        seed: seed of the random page order.
        kv_dtype: storage dtype of the pages (default: the workload's dtype). Writers must convert
            (e.g. quantise) before :meth:`write`; it does not cast.
        share_v: store only K and make ``v_pages`` the view ``k_pages[..., :Dv]`` (MLA latent form,
            where V is the first ``Dv`` columns of K). Off by default.
    """

    def __init__(
        self,
        *,
        page_size: int,
        num_pages: int | None = None,
        page_order: Literal["sequential", "random"] = "sequential",
        seed: int = 0,
        kv_dtype: torch.dtype | None = None,
        share_v: bool = False,
        **base: Any,
    ) -> None:
        super().__init__(**base)
        geometry, num_layers, max_seq_len = self.geometry, self.num_layers, self.max_seq_len
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
            raise ValueError(f"paged cache: page_size = {page_size!r} must be an integer > 0")
        if page_order not in PAGE_ORDERS:
            raise ValueError(f"paged cache: page_order = {page_order!r} not in {PAGE_ORDERS}")
        if share_v and geometry.v_head_dim > geometry.qk_head_dim:
            raise ValueError(
                f"paged cache: share_v needs v_head_dim ({geometry.v_head_dim}) "
                f"≤ qk_head_dim ({geometry.qk_head_dim})"
            )
        g = geometry
        self.page_size = page_size
        self.pages_per_seq = cdiv(max_seq_len, page_size)
        self.num_pages = self.batch * self.pages_per_seq if num_pages is None else int(num_pages)
        if self.num_pages <= 0:
            raise ValueError(f"paged cache: num_pages = {num_pages!r} must be > 0")
        self.page_order = page_order
        self.seed = seed
        self.share_v = share_v
        self.kv_dtype = kv_dtype or self.dtype
        kw: dict[str, Any] = {"dtype": self.kv_dtype, "device": self.device}
        # zeros, not empty: a reader that multiplies a masked row by a zero weight must not meet NaN
        self.k_pages = torch.zeros(num_layers, self.num_pages, page_size, g.num_kv_heads, g.qk_head_dim, **kw)
        if share_v:
            self.v_pages = self.k_pages[..., : g.v_head_dim]
        else:
            self.v_pages = torch.zeros(
                num_layers, self.num_pages, page_size, g.num_kv_heads, g.v_head_dim, **kw
            )
        self.block_table = torch.zeros(self.batch, self.pages_per_seq, dtype=torch.int32, device=self.device)
        # the plan's slot mapping, for up to every token of every sequence (a prompt), allocated once
        idx: dict[str, Any] = {"dtype": torch.int64, "device": self.device}
        self.slot_buffer = torch.zeros(self.batch * max_seq_len, **idx)
        self.src_buffer = torch.zeros(self.batch * max_seq_len, **idx)
        #: split-KV kernel state (launch shape, partial buffers) of a Triton-family reader, else None
        self.split_kv: SplitKV | None = None
        self._init_pages()

    # -- page allocation (host side) -------------------------------------------------------------
    def _init_pages(self) -> None:
        if self.page_order == "random":
            gen = torch.Generator().manual_seed(self.seed)
            order = torch.randperm(self.num_pages, generator=gen).tolist()
        else:
            order = list(range(self.num_pages))
        self._free: list[int] = order[::-1]  # pop() from the end hands out order[0] first
        self.pages: list[list[int]] = [[] for _ in range(self.batch)]  # host copy of the block table
        self.block_table.zero_()

    def reset(self) -> None:
        """Empty every sequence and return all pages to the pool (in the initial order)."""
        super().reset()
        self._init_pages()

    def reserve(self, seq_lens: Sequence[int]) -> bool:
        """Give each sequence enough pages for ``seq_lens[i]`` tokens. True if any page was added.

        Host work; raises a clear error when the pool runs out. The device table is updated too.
        """
        changed = False
        for i, n in enumerate(seq_lens):
            need = cdiv(int(n), self.page_size)
            if need > self.pages_per_seq:
                raise ValueError(
                    f"paged cache: sequence {i} needs {need} pages for {n} tokens; max_seq_len "
                    f"{self.max_seq_len} allows {self.pages_per_seq}"
                )
            while len(self.pages[i]) < need:
                if not self._free:
                    raise RuntimeError(
                        f"paged cache: out of pages (pool of {self.num_pages} pages "
                        f"of {self.page_size} tokens)"
                    )
                self.pages[i].append(self._free.pop())
                changed = True
        if changed:
            table = torch.zeros(self.batch, self.pages_per_seq, dtype=torch.int32)
            for i, row in enumerate(self.pages):
                table[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
            self.block_table.copy_(table)
        return changed

    def slot(self, seq: int, token: int) -> int:
        """Flat slot of ``token`` of sequence ``seq`` (host lookup; for tests and debugging)."""
        return self.pages[seq][token // self.page_size] * self.page_size + token % self.page_size

    # -- the step --------------------------------------------------------------------------------
    def plan_step(self, num_new: Sequence[int]) -> PagedStepPlan:
        """Reserve pages for this step's new tokens and build their slot mapping (host work)."""
        base = base_plan(self, num_new)
        self.reserve(base.seq_lens_after)
        t = base.max_new
        uniform = len(set(base.num_new)) == 1
        if sum(base.num_new) <= 64:  # decode and small steps: a host loop is cheaper than tensor ops
            slots = [
                self.slot(i, p + j)
                for i, (p, n) in enumerate(zip(base.positions, base.num_new, strict=True))
                for j in range(n)
            ]
            src = [i * t + j for i, n in enumerate(base.num_new) for j in range(n)]
            n = len(slots)
            self.slot_buffer[:n].copy_(torch.tensor(slots, dtype=torch.int64))
            if not uniform:
                self.src_buffer[:n].copy_(torch.tensor(src, dtype=torch.int64))
        else:  # a prompt: vectorised over its tokens
            counts = torch.tensor(base.num_new)
            seq = torch.repeat_interleave(torch.arange(self.batch), counts)  # [N]: each token's sequence
            offset = torch.arange(int(counts.sum())) - torch.repeat_interleave(
                counts.cumsum(0) - counts, counts
            )
            token = torch.tensor(base.positions)[seq] + offset
            host_table = torch.zeros(self.batch, self.pages_per_seq, dtype=torch.int64)
            for i, row in enumerate(self.pages):
                host_table[i, : len(row)] = torch.tensor(row, dtype=torch.int64)
            n = token.numel()
            slot = host_table[seq, token // self.page_size] * self.page_size + token % self.page_size
            self.slot_buffer[:n].copy_(slot)
            if not uniform:
                self.src_buffer[:n].copy_(seq * t + offset)
        return base.extend(
            PagedStepPlan,
            block_table=self.block_table,
            slots=self.slot_buffer[:n],
            src=None if uniform else self.src_buffer[:n],
        )

    def write(self, plan: StepPlan, *, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k [B, T, Hkv, Dk]`` and ``v [B, T, Hkv, Dv]`` (right-padded) in their pages.

        ``k``/``v`` must already be in ``kv_dtype``. With ``share_v`` only ``k`` is stored. No host
        sync, no host allocation: capturable once ``plan`` exists.
        """
        if not isinstance(plan, PagedStepPlan) or plan.slots is None:
            raise TypeError("paged cache: write() needs the PagedStepPlan from plan_step()")
        if k.dtype != self.kv_dtype:
            raise TypeError(f"paged cache: k has dtype {k.dtype}; pages hold {self.kv_dtype} (convert first)")
        g = self.geometry
        kf = k.reshape(-1, g.num_kv_heads, g.qk_head_dim)
        if plan.src is not None:
            kf = kf.index_select(0, plan.src)
        self.k_pages[layer].view(-1, g.num_kv_heads, g.qk_head_dim).index_copy_(0, plan.slots, kf)
        if not self.share_v:
            vf = v.reshape(-1, g.num_kv_heads, g.v_head_dim)
            if plan.src is not None:
                vf = vf.index_select(0, plan.src)
            self.v_pages[layer].view(-1, g.num_kv_heads, g.v_head_dim).index_copy_(0, plan.slots, vf)

    # -- reading back (host loops: tests and torch fallbacks, not hot paths) ---------------------
    def gather(self, layer: int, seq: int, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous ``k [S, Hkv, Dk]``, ``v [S, Hkv, Dv]`` of one sequence's first ``length`` tokens."""
        n = self.seq_lens[seq] if length is None else length
        pages = torch.tensor(
            self.pages[seq][: cdiv(n, self.page_size)], dtype=torch.int64, device=self.device
        )
        k = self.k_pages[layer].index_select(0, pages).flatten(0, 1)[:n]
        v = self.v_pages[layer].index_select(0, pages).flatten(0, 1)[:n]
        return k, v

    def read(self, layer: int, seq: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``k [length, Hkv, Dk]``, ``v [length, Hkv, Dv]`` of sequence ``seq`` in the compute dtype."""
        k, v = self.gather(layer, seq, length)
        return k.to(self.dtype), v.to(self.dtype)

    def bytes_per_token(self) -> int:
        g = self.geometry
        dims = g.qk_head_dim if self.share_v else g.qk_head_dim + g.v_head_dim
        return g.num_kv_heads * dims * self.kv_dtype.itemsize * self.num_layers

    def nbytes(self) -> int:
        v = 0 if self.share_v else self.v_pages.nbytes
        return self.k_pages.nbytes + v + self.block_table.nbytes
