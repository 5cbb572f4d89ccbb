"""``cpu_decode`` — the project's own paged decode-attention kernel for CPUs (C, AVX-512 or AVX2, OpenMP).

The kernel is the C source tree ``csrc/`` beside this file (this backend's items in
``csrc/decode_paged.h``, its writer in ``csrc/writers.h``), compiled at first use with the system C
compiler and called through :mod:`ctypes` with the tensors' ``data_ptr()`` in an argument struct: no
torch C++ headers, a build of seconds, cached per source, compiler and flags
(:mod:`attnbench.backends.cpu_kernel`, which lists the tree, defines the structs and also holds the
``amx-emulated`` build the tests run the AMX items on, and the AddressSanitizer builds).

The cache (P = 2 for bf16, else 1)::

    pages: [L, pages, Hkv, page_size / 16, 2, 16 · D]   # 16-key tiles: the tile's K, then its V
        K of a tile: [D / P, 16, P]   (VNNI order)
        V of a tile: [16 / P, D, P]
    block_table: [B, pages_per_seq] int32, a seeded random permutation of the pool

One page of one KV head is one contiguous run (its tiles, each K then V), so the kernel reads one
stream per item, page by page, and prefetches tiles ahead (in a random page) while it computes on
this one; one core reads that from DRAM faster than separate K and V pages. For
bf16, one 64-byte row of a K tile is 16 keys × 2 dims and one of V is 16 dims × 2 keys: the operands
of ``vdpbf16ps``, so neither q·k nor p·v needs a shuffle or a horizontal sum. Each K/V row is loaded
once for up to four query heads of its GQA group. Softmax is online, in fp32, over 32 keys at a
time for bf16 (two tiles of one page; 16 for fp32, fp16 and on 16-token pages); p·v
accumulates in fp32 (for bf16 the probabilities are rounded to bf16 for ``vdpbf16ps``, as flash
attention rounds P to the input dtype; the denominator sums the rounded values).

Without AVX-512 (``c-avx2``: AVX2, FMA and F16C) the same layout is read with 32-byte loads: one of a
bf16 K row is 8 keys × 2 dims and one of V 8 dims × 2 keys, each bf16 widened to fp32 by its place
in a 32-bit lane (a shift left by 16 for the low one, a mask for the high one), then fused
multiply-adds in fp32; fp16 is widened with ``vcvtph2ps``. Each K/V row is loaded once for up to four
query heads, softmax runs over 32 keys of a page at a time in every dtype, and the probabilities stay in fp32
for p·v (as in ``c-scalar``; no bf16 rounding of P).

Work is split over (sequence, KV head, KV split) with OpenMP, on ``torch.get_num_threads()`` threads
as of :meth:`plan` (``bench``/``tune --threads`` set it). ``kv_splits = "auto"`` splits each sequence
only when batch × KV heads is smaller than the thread count, and a merge combines the splits.

Variants (:meth:`CpuDecodeBackend.implementation` names the one that runs): ``c-avx512bf16`` (bf16 on
a CPU with AVX512_BF16), ``c-avx512`` (fp32 and fp16 on AVX-512: fused multiply-adds in fp32, fp16
widened on load), ``c-avx2`` (any dtype on a CPU with AVX2 + FMA + F16C, where those do not apply:
no AVX-512, or bf16 without AVX512_BF16) and ``c-scalar`` (plain C, any dtype, where the CPU lacks
even AVX2). Unavailable, with the reason, where no C compiler builds the file.

Which call may allocate: ``create_cache`` (the pages, workspace and step buffers); ``plan`` (host
work: small host tensors, copied into the cache's step buffers, which the plan then names);
``decode`` allocates only its output. ``prefill`` is the base class's: the prompt's attention is
torch SDPA's flash kernel (:func:`attnbench.core.prefill.prefill_attention`), its K/V go through ``append``
(the kernel's writer, one call per layer); a prompt after a cached prefix reads the prefix back with
:meth:`CpuDecodeCache.read`. Everything runs on the host: there is no graph capture.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from attnbench.backends.cpu_kernel import (
    ISA_CODES,
    ISA_NAMES,
    MAX_SPLITS,
    SOURCE_DIR,
    Kernel,
    WriteArgs,
    kernel_failed,
    kernel_isa,
    load_kernel,
    step_args,
)
from attnbench.core.backend import Backend, KVCache, StepPlan, Tunable, base_plan
from attnbench.core.device import empty_huge
from attnbench.core.workload import Workload

#: 256 and 512 read a KV head's page in longer runs: at one thread the fp8 kernel ran 5-26 % faster on 512
#: than on 128 (the bf16 one within ±5 %; results/cpu/bench/fp8-t1-pages-epyc-avx512, docs/benchmarks.md)
PAGE_SIZES = (16, 32, 64, 128, 256, 512)
#: the dtypes a variant takes where it does not take all three
_ISA_DTYPES = {"c-avx512": (torch.float32, torch.float16), "c-avx512bf16": (torch.bfloat16,)}


@dataclass
class CpuDecodePlan(StepPlan):
    """The step's metadata: views of the cache's step buffers (written by ``plan``) and the split.

    ``positions32``/``num_new32``/``seq_lens32`` are ``[B]`` int32 views of buffers the cache owns.
    """

    positions32: torch.Tensor | None = None
    num_new32: torch.Tensor | None = None
    seq_lens32: torch.Tensor | None = None
    splits: int = 1
    threads: int = 1


class CpuDecodeCache(KVCache):
    """Pages in the kernel's layout (module docstring), a block table, a workspace and step buffers."""

    #: the element type of the pages (the compute dtype here; ``uint8`` for the fp8 sibling's)
    @property
    def page_dtype(self) -> torch.dtype:
        return self.dtype

    @property
    def isa_code(self) -> int:
        """The variant's code (a key of ``ISA_NAMES``; the fp8 sibling's may be ``FP8_SHIFT_CODE``)."""
        return ISA_CODES[self.isa]

    def __init__(
        self, *, isa: str, page_size: int, kv_splits: str | int, prefetch: int, seed: int = 0, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        g = self.geometry
        self.isa = isa  # the variant that runs
        self.page_size = page_size
        self.kv_splits = kv_splits
        self.prefetch = prefetch
        self.pair = 2 if self.dtype == torch.bfloat16 else 1
        self.pages_per_seq = max(1, math.ceil(self.max_seq_len / page_size))
        self.num_pages = self.batch * self.pages_per_seq
        d = g.qk_head_dim
        # zeros: rows past a sequence's length are masked, but must never be NaN (0 · NaN)
        # in 2 MiB pages where the OS grants them (empty_huge): the kernel reads them in a random page order
        shape = (self.num_layers, self.num_pages, g.num_kv_heads, page_size // 16, 2, 16 * d)
        self.pages = empty_huge(shape, self.page_dtype).zero_()
        gen = torch.Generator().manual_seed(seed)
        order = torch.randperm(self.num_pages, generator=gen, dtype=torch.int64).to(torch.int32)
        self.block_table = order.view(self.batch, self.pages_per_seq).contiguous()
        self.workspace = torch.empty(
            self.batch * g.num_kv_heads * MAX_SPLITS * g.group_size * (d + 2), dtype=torch.float32
        )
        self.positions32 = torch.zeros(self.batch, dtype=torch.int32)
        self.num_new32 = torch.zeros(self.batch, dtype=torch.int32)
        self.seq_lens32 = torch.zeros(self.batch, dtype=torch.int32)
        # the kernel's k_cache and v_cache: the layer's first K tile and its first V tile (16 · D elements
        # on), as fields of its argument structs (AttendArgs, WriteArgs)
        self.layer_ptrs: list[dict[str, int]] = [
            {"k_cache": self.pages[i].data_ptr(), "v_cache": self.pages[i, 0, 0, 0, 1].data_ptr()}
            for i in range(self.num_layers)
        ]

    def writer_args(self) -> dict[str, int]:
        """The writer's fields of this cache form (``WriteArgs``): the tile's pair and the element size."""
        return {"pair": self.pair, "elem_size": self.dtype.itemsize}

    def nbytes(self) -> int:
        return self.pages.nbytes + self.block_table.nbytes

    def read(self, layer: int, seq: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``k``/``v`` ``[length, Hkv, D]`` of sequence ``seq``: its pages' tiles back in token order."""
        return read_pages(self.pages[layer], self.block_table[seq], length, pair=self.pair)


def read_pages(
    pages: torch.Tensor, blocks: torch.Tensor, length: int, *, pair: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``k``/``v`` ``[length, Hkv, D]`` of one sequence from a layer's pages in the kernel's layout
    (``pages [n, Hkv, page_size / 16, 2, 16 · D]``; ``blocks``: the sequence's block-table row; ``pair``:
    P, 2 for bf16 tiles): its tiles back in token order. The vLLM integration reads vLLM's own KV tensor
    with it, viewed in this layout."""
    _, hkv, tiles_per_page, _, row = pages.shape
    d = row // 16
    tiles = pages.index_select(0, blocks[: math.ceil(length / (16 * tiles_per_page))].long())
    n_pages = tiles.shape[0]
    # K tile [D/P, 16, P] -> [16, D]; V tile [16/P, D, P] -> [16, D]
    k = tiles[:, :, :, 0].reshape(n_pages, hkv, tiles_per_page, d // pair, 16, pair)
    k = k.permute(0, 2, 4, 1, 3, 5).reshape(-1, hkv, d)
    v = tiles[:, :, :, 1].reshape(n_pages, hkv, tiles_per_page, 16 // pair, d, pair)
    v = v.permute(0, 2, 3, 5, 1, 4).reshape(-1, hkv, d)
    return k[:length], v[:length]


def _auto_splits(workload: Workload) -> int:
    """The KV splits ``kv_splits = "auto"`` runs ``workload`` with on this process's threads."""
    work = workload.batch * workload.geometry("expanded").num_kv_heads
    return kv_splits_for(
        "auto", work=work, threads=torch.get_num_threads(), max_len=max(workload.context_lens)
    )


def kv_splits_for(kv_splits: str | int, *, work: int, threads: int, max_len: int) -> int:
    """The KV splits per sequence for the tunable ``kv_splits`` (``auto``: only when the ``work`` items,
    batch × KV heads, are fewer than the threads, and at most one split per 8 tiles of ``max_len``)."""
    if kv_splits != "auto":
        return int(kv_splits)
    if work >= threads:
        return 1
    tiles = math.ceil(max_len / 16)
    return max(1, min(MAX_SPLITS, math.ceil(threads / work), tiles // 8))


class CpuDecodeBackend(Backend):
    name = "cpu_decode"
    description = (
        "attnbench's own paged decode kernel for CPUs (C, AVX-512 BF16 / AVX-512 / AVX2 / scalar, OpenMP)"
    )
    tunables: ClassVar[tuple[Tunable, ...]] = (
        Tunable("page_size", PAGE_SIZES, 128, "tokens per cache page (a multiple of the 16-key tile)"),
        Tunable(
            "kv_splits", ("auto", 1, 4), "auto", "KV splits per sequence (auto: only when B·Hkv < threads)"
        ),
        Tunable(
            "prefetch", (0, 2, 4, 8), 2, "16-key tiles ahead prefetched into L2 (0: hardware prefetch only)"
        ),
    )
    #: how far ahead the kernel prefetches changes no bit of its output (tested): tune gates one
    #: prefetch distance of each config and reuses the verdict for the others
    result_neutral: ClassVar[tuple[str, ...]] = ("prefetch",)
    #: the pages depend on the page size only (the fp8 sibling's per-token scales too): tune fills one
    #: cache per page size and times the KV splits and prefetch distances on it (reconfigure_cache)
    cache_neutral: ClassVar[tuple[str, ...]] = ("kv_splits", "prefetch")
    #: run this variant instead of the best the CPU has (tests use "c-scalar"); None: the best
    force_isa: ClassVar[str | None] = None
    #: the build of the kernel this backend loads (a key of ``BUILDS``; tests use "amx-emulated")
    kernel_build: ClassVar[str] = "native"
    #: the C kernel's source tree: part of the code hash (a tuned row goes stale when the kernel changes)
    code_files: ClassVar[tuple[str, ...]] = tuple(str(p) for p in sorted(SOURCE_DIR.glob("*.[ch]")))
    #: the fp8 sibling's differences: its cache, its head_dim multiple and what its messages add
    cache_class: ClassVar[type[CpuDecodeCache]] = CpuDecodeCache
    head_dim_multiple: ClassVar[int] = 16
    head_dim_note: ClassVar[str] = ""
    implementation_note: ClassVar[str] = ""
    cache_dtype_phrase: ClassVar[str] = "the cache holds"
    #: the kernel's writer and attention for this cache (their structs: ``_write``, ``decode``)
    kernel_functions: ClassVar[tuple[str, str]] = ("cpu_decode_write", "cpu_decode_attend")

    # -- what it can do --------------------------------------------------------------------------
    def supports(self, workload: Workload) -> list[str]:
        g = workload.geometry(self.kv_form)
        reasons = workload.cpu_reasons("the cpu_decode kernel runs")
        if g.qk_head_dim != g.v_head_dim:
            reasons.append(f"key and value head dims differ ({g.qk_head_dim} vs {g.v_head_dim})")
        elif g.qk_head_dim % self.head_dim_multiple or g.qk_head_dim > 1024:
            reasons.append(
                f"head_dim {g.qk_head_dim} must be a multiple of {self.head_dim_multiple} up to 1024"
                + self.head_dim_note
            )
        if g.group_size > 64:
            reasons.append(f"GQA group of {g.group_size} query heads per KV head > 64")
        if reasons:
            return reasons
        kernel = load_kernel(self.kernel_build)
        if isinstance(kernel, str):
            return [kernel]
        return self._variant_reasons(workload, kernel)

    def _variant_reasons(self, workload: Workload, kernel: Kernel) -> list[str]:
        """Why the variant for ``workload`` cannot run on this CPU (the shape already passed)."""
        isa = self._isa(workload.dtype, kernel)
        if ISA_CODES[isa] > kernel.isa:
            return [f"variant {isa} needs an ISA this CPU lacks (it has {ISA_NAMES[kernel.isa]})"]
        if workload.dtype not in _ISA_DTYPES.get(isa, (workload.dtype,)):
            return [f"variant {isa} does not take dtype {workload.dtype_name}"]
        return []

    def _isa(self, dtype: torch.dtype, kernel: Kernel) -> str:
        """The forced variant, else the best one this CPU runs for ``dtype``."""
        if self.force_isa is not None:
            return self.force_isa
        for code in range(kernel.isa, 0, -1):
            if dtype in _ISA_DTYPES.get(ISA_NAMES[code], (dtype,)):
                return ISA_NAMES[code]
        return "c-scalar"

    def variant_for(self, dtype: torch.dtype) -> str:
        """The variant this backend runs for ``dtype`` on this CPU (the kernel loaded)."""
        kernel = load_kernel(self.kernel_build)
        if isinstance(kernel, str):
            raise RuntimeError(kernel)
        return self._isa(dtype, kernel)

    def _variant(self, workload: Workload, config: Mapping[str, Any] | None = None) -> str | None:
        """The variant a cache for ``workload`` (and ``config``) runs (the kernel loaded)."""
        kernel = load_kernel(self.kernel_build)
        assert not isinstance(kernel, str)
        return self._isa(workload.dtype, kernel)

    def implementation(self, workload: Workload) -> str:
        """``cpu_decode.c[<variant>]`` with the variant that runs for this dtype on this CPU."""
        reasons = self.supports(workload)
        if reasons:
            return "unavailable: " + "; ".join(reasons)
        return f"cpu_decode.c[{self._variant(workload)}{self.implementation_note}]"

    def error_multiple(self, dtype: torch.dtype, *, config: Mapping[str, Any] | None = None) -> float:
        """The default, 2, in every dtype. Measured with the gate over 10 seeds per cell (llama-3.1-8b's
        geometry at 1k and 8k, the gate's small geometry at 32k and 128k; the default config, a
        16-token page with four KV splits, and a 32-token page without prefetch): bf16 rounds P to bf16
        for ``vdpbf16ps`` and stays within 1.3–1.5× the calibration error (worst share of the bound
        0.59); fp16 is at 1.00× (the output's rounding dominates); fp32, whose p·v joins the running
        sum once per 16 or 32 keys, within 1.8× in rel_l2 and 3.7× in max_abs at 32k, where the bound's
        fp32 accumulation allowance dominates (worst share 0.54). Those figures are the AVX-512
        variants'; ``c-avx2`` keeps P in fp32 (no bf16 rounding) and passes the same suite and gate."""
        return super().error_multiple(dtype, config=config)

    def tunables_for(self, workload: Workload) -> tuple[Tunable, ...]:
        """What the tuner searches: ``page_size`` without 16, ``prefetch``, and ``kv_splits`` above one thread.

        A 16-token page holds a single tile, so the bf16 loop cannot step 32 keys at a time there (it
        does twice the softmax reductions and accumulator traffic per key); 16 stays a valid config
        (the tests use it: every tile then sits at a page boundary). At one thread ``auto`` never
        splits, and a forced split only adds a merge.
        """
        out = []
        for t in self.tunables:
            if t.name == "page_size":
                out.append(t.narrowed(c for c in t.choices if c != 16))
            elif t.name == "kv_splits" and torch.get_num_threads() > 1:  # not a value ``auto`` means here
                auto = _auto_splits(workload)
                out.append(t.narrowed(c for c in t.choices if c == "auto" or int(c) != auto))
            elif t.name != "kv_splits":
                out.append(t)
        return tuple(out)

    def canonical_config(self, workload: Workload, config: Mapping[str, Any]) -> dict[str, Any]:
        """``kv_splits = N`` where ``auto`` splits into N here is ``auto`` (one computation: the tuner
        times it once; at batch 1 × 4k two instances of it measured 0.96 and 1.20 ms side by side)."""
        cfg = self.resolve_config(config)
        if cfg["kv_splits"] != "auto" and int(cfg["kv_splits"]) == _auto_splits(workload):
            cfg["kv_splits"] = "auto"
        return cfg

    # -- the cache and the step ------------------------------------------------------------------
    def create_cache(
        self, workload: Workload, *, config: Mapping[str, Any], num_layers: int, max_seq_len: int
    ) -> CpuDecodeCache:
        cfg = self.resolve_config(config)
        reasons = self.supports(workload)
        if reasons:
            raise ValueError(f"backend {self.name!r} cannot run {workload.describe()}: {'; '.join(reasons)}")
        isa = self._variant(workload, cfg)
        assert isa is not None
        return self.cache_class(
            isa=isa,
            page_size=int(cfg["page_size"]),
            kv_splits=cfg["kv_splits"],
            prefetch=int(cfg["prefetch"]),
            **self.cache_fields(workload, cfg, num_layers, max_seq_len),
        )

    def reconfigure_cache(self, cache: KVCache, config: Mapping[str, Any]) -> None:
        """The KV splits and prefetch distance of ``config`` for the next steps on ``cache``."""
        assert isinstance(cache, CpuDecodeCache)
        cfg = self.resolve_config(config)
        cache.kv_splits, cache.prefetch = cfg["kv_splits"], int(cfg["prefetch"])
        cache.config = dict(cfg)

    def plan(self, cache: KVCache, *, num_new: Sequence[int]) -> CpuDecodePlan:
        assert isinstance(cache, CpuDecodeCache)
        base = base_plan(cache, num_new)
        cache.positions32.copy_(torch.tensor(base.positions, dtype=torch.int32))
        cache.num_new32.copy_(torch.tensor(base.num_new, dtype=torch.int32))
        cache.seq_lens32.copy_(torch.tensor(base.seq_lens_after, dtype=torch.int32))
        threads = torch.get_num_threads()
        g = cache.geometry
        splits = kv_splits_for(
            cache.kv_splits,
            work=cache.batch * g.num_kv_heads,
            threads=threads,
            max_len=max(base.seq_lens_after),
        )
        return base.extend(
            CpuDecodePlan,
            positions32=cache.positions32,
            num_new32=cache.num_new32,
            seq_lens32=cache.seq_lens32,
            splits=splits,
            threads=threads,
        )

    def _write(
        self, cache: CpuDecodeCache, plan: CpuDecodePlan, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """``k``/``v`` ``[B, T, Hkv, D]`` (right-padded) into ``layer``'s pages at the plan's positions."""
        if k.dtype != cache.dtype or v.dtype != cache.dtype:
            raise TypeError(
                f"backend {self.name!r}: k/v dtype {k.dtype}/{v.dtype}; {self.cache_dtype_phrase} {cache.dtype}"
            )
        k, v = k.contiguous(), v.contiguous()
        g = cache.geometry
        kernel = load_kernel(self.kernel_build)
        assert not isinstance(kernel, str) and plan.positions32 is not None and plan.num_new32 is not None
        args = WriteArgs(
            **cache.layer_ptrs[layer],
            k=k.data_ptr(),
            v=v.data_ptr(),
            block_table=cache.block_table.data_ptr(),
            positions=plan.positions32.data_ptr(),
            num_new=plan.num_new32.data_ptr(),
            num_seqs=cache.batch,
            max_new=k.shape[1],
            num_kv_heads=g.num_kv_heads,
            head_dim=g.qk_head_dim,
            page_size=cache.page_size,
            max_pages=cache.pages_per_seq,
            **cache.writer_args(),
        )
        rc = getattr(kernel.lib, self.kernel_functions[0])(ctypes.byref(args))
        if rc != 0:
            self._refused_write(rc, layer)

    def _refused_write(self, rc: int, layer: int) -> None:
        """Raise for the writer's non-zero return code ``rc``."""
        raise kernel_failed(self.name, rc, "kernel's writer")

    def append(self, cache: KVCache, plan: StepPlan, *, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        assert isinstance(cache, CpuDecodeCache) and isinstance(plan, CpuDecodePlan)
        self._write(cache, plan, layer, k, v)

    def decode(
        self, cache: KVCache, plan: StepPlan, *, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """``q [B, Hq, D]``, ``k``/``v`` ``[B, Hkv, D]`` → ``[B, Hq, D]``; no host work besides the call."""
        assert isinstance(cache, CpuDecodeCache) and isinstance(plan, CpuDecodePlan)
        self._write(cache, plan, layer, k[:, None], v[:, None])
        q = q.contiguous()
        if q.dtype != cache.dtype:
            raise TypeError(
                f"backend {self.name!r}: q dtype {q.dtype}; {self.cache_dtype_phrase} {cache.dtype}"
            )
        out = torch.empty_like(q)
        kernel = load_kernel(self.kernel_build)
        assert not isinstance(kernel, str) and plan.seq_lens32 is not None
        g = cache.geometry
        isa, fp8_convert = kernel_isa(cache.isa_code)
        args = step_args(
            cache,
            plan,
            q,
            out,
            **cache.layer_ptrs[layer],
            num_kv_heads=g.num_kv_heads,
            isa=isa,
            fp8_convert=fp8_convert,
            prefetch=cache.prefetch,
        )
        rc = getattr(kernel.lib, self.kernel_functions[1])(ctypes.byref(args))
        if rc != 0:
            raise kernel_failed(self.name, rc)
        return out
