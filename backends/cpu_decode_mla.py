"""``cpu_decode_mla`` — the MLA latent form (DeepSeek-V2/V3, Kimi) in ``cpu_decode``'s C kernel.

The cache is the ``mla`` backend's :class:`attnbench.backends.mla.LatentCache` as it is: per token and
layer one row ``[c | k_pe]`` of ``kv_lora_rank + qk_rope_head_dim`` values (576 for DeepSeek-V3), the
value being the row's first ``kv_lora_rank`` columns, stored once, in randomly placed pages. Decode
takes the absorbed query ``q [B, H, rank + rope]`` and returns the latent output ``[B, H, rank]``,
exactly as ``mla`` does, so the conformance suite, the gate and DeepSeek's hand-written decoder run it
unchanged.

One work item per (sequence, KV split) walks its tokens once for all H heads: each latent row is read
once per step whatever the head count (128 query heads share it in DeepSeek-V3). On a CPU that form is
compute-bound (~2 · H · (576 + 512) FLOPs per 1,152 bytes read: ≈ 240 FLOPs per byte), so the kernel
runs on the CPU's matrix units, or its bf16 dot-product instruction where it has no matrix unit:

- ``c-amx`` (a CPU with AMX-BF16, the OS granting the tile data; bf16; ``rank + rope`` a multiple of 32,
  ``rank`` of 16): a step is the rest of a page (≤ 128 keys). Scores are computed transposed, ``S^T
  [keys, heads] = rows · Q^T``, with the page's rows loaded as AMX tiles as stored; the online softmax
  then runs 16 heads to a vector in fp32 with no horizontal reduction; ``P`` (rounded to bf16, as
  FlashAttention rounds it) is transposed back and ``P · V`` (the step's rows interleaved in key pairs)
  accumulates into an fp32 ``O`` that passes through the tiles once per step. The running max is
  rescaled lazily (only when a head's max grows by more than 8), so most steps never touch ``O``
  outside the tiles.
- ``c-avx512bf16`` (a CPU with AVX-512 BF16 and no AMX granted, e.g. AMD Zen 4; bf16; ``rank + rope``
  even, ``rank`` a multiple of 16): the same four stages with register tiles of ``vdpbf16ps`` in place
  of the matrix unit: scores 6 keys × 64 heads in 24 accumulators (each row pair an embedded broadcast,
  each pair vector of 16 heads a load shared by 6 keys), ``O += P · V`` 6 heads × 64 dims, loaded and
  stored once per step. On the AMD EPYC VM it runs at 0.82–0.95 of the bf16 ``torch.mm`` peak measured
  beside it (docs/benchmarks.md).
- ``c-scalar`` (plain C, any dtype, fp32 arithmetic) where those do not apply (``force_isa``; the
  tests run it on every CPU).

The three items are in the kernel's ``csrc/decode_latent.h``, called through ``cpu_decode_attend_latent``
with the attention argument struct (:class:`attnbench.backends.cpu_kernel.AttendArgs`).

Which call may allocate: ``create_cache`` (pages, workspace, step buffers); ``plan`` (host work);
``decode`` allocates only its output. Prefill is the base class's (causal attention on the latent
rows, then one write).
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from attnbench.backends.cpu_decode import kv_splits_for
from attnbench.backends.cpu_kernel import (
    ISA_CODES,
    ISA_NAMES,
    MAX_SPLITS,
    kernel_failed,
    load_kernel,
    step_args,
    with_variants,
)
from attnbench.backends.mla import LatentCache
from attnbench.core.backend import Backend, KVCache, Resolution, StepPlan, Tunable
from attnbench.core.workload import Workload
from attnbench.kernels.paged import PagedStepPlan


@dataclass
class CpuDecodeMLAPlan(PagedStepPlan):
    """The paged plan plus the kernel's step metadata (``seq_lens32``: a view of the cache's buffer)."""

    seq_lens32: torch.Tensor | None = None
    splits: int = 1
    threads: int = 1


class CpuDecodeMLACache(LatentCache):
    """``LatentCache`` (``share_v``: one row per token) plus the kernel's workspace and step buffers."""

    isa: str
    kv_splits: str | int
    workspace: torch.Tensor
    seq_lens32: torch.Tensor


class CpuDecodeMLABackend(Backend):
    name = "cpu_decode_mla"
    description = (
        "MLA latent decode in attnbench's CPU kernel (C: AMX tiles or AVX-512 BF16 for bf16 / scalar), all heads"
        " per row read"
    )
    kv_form = "latent"
    tunables = (
        Tunable("page_size", (16, 32, 64, 128), 64, "tokens per cache page (a step reads up to one page)"),
        Tunable(
            "kv_splits", ("auto", 1, 2, 4, 8), "auto", "KV splits per sequence (auto: only when B < threads)"
        ),
        Tunable(
            "isa",
            ("auto", "c-avx512bf16", "c-amx"),
            "auto",
            "the kernel variant (auto: AMX tiles where granted and the row is a multiple of 32, else AVX-512 BF16)",
        ),
    )
    #: run this variant instead of the best the CPU has ("c-scalar" in tests); None: the best
    force_isa: ClassVar[str | None] = None
    #: the build of the kernel this backend loads (``cpu_kernel.BUILDS``; tests use "amx-emulated")
    kernel_build: ClassVar[str] = "native"

    def _variant(
        self, workload: Workload, config: Mapping[str, Any] | None = None
    ) -> tuple[str | None, list[str]]:
        """The variant that runs ``workload`` here with ``config`` (``isa``: auto, AMX where granted and the
        row takes its tiles, else AVX-512 BF16; or the variant named), or None with the reasons."""
        isa = str((config or {}).get("isa", "auto"))
        auto, reasons = self._auto_variant(workload)
        if isa == "auto" or auto is None or self.force_isa is not None:
            return auto, reasons
        kernel = load_kernel(self.kernel_build)
        assert not isinstance(kernel, str)
        if isa == "c-amx" and kernel.fp8_level < 2:
            return None, ["isa c-amx needs AMX-BF16 tiles granted by the OS; this CPU has none"]
        if isa == "c-amx" and workload.geometry("latent").qk_head_dim % 32:
            row = workload.geometry("latent").qk_head_dim
            return None, [
                f"isa c-amx takes latent rows that are a multiple of 32 (AMX tiles); this one is {row}"
            ]
        return isa, []

    def _auto_variant(self, workload: Workload) -> tuple[str | None, list[str]]:
        """The variant ``isa = auto`` runs (AMX where granted, else AVX-512 BF16), or None with the reasons."""
        kernel = load_kernel(self.kernel_build)
        if isinstance(kernel, str):
            return None, [kernel]
        if self.force_isa is not None:
            return self.force_isa, []
        g = workload.geometry("latent")
        if workload.dtype != torch.bfloat16:
            return None, [
                f"the latent kernel computes in bf16 (AMX or AVX-512 BF16); dtype {workload.dtype_name}"
            ]
        if kernel.isa < ISA_CODES["c-avx512bf16"]:
            return None, [
                "the latent kernel needs AVX-512 BF16 (vdpbf16ps) or AMX-BF16; this CPU runs "
                f"{ISA_NAMES[kernel.isa]}"
            ]
        if g.qk_head_dim % 2 or g.v_head_dim % 16:
            return None, [f"latent row {g.qk_head_dim} must be even and rank {g.v_head_dim} a multiple of 16"]
        amx = kernel.fp8_level >= 2 and g.qk_head_dim % 32 == 0  # AMX tiles take 32 dims at a time
        return ("c-amx" if amx else "c-avx512bf16"), []

    def resolve(self, workload: Workload, config: Mapping[str, Any] | None = None) -> Resolution:
        reasons: list[str] = []
        if not workload.shape.is_mla:
            reasons.append(
                f"model {workload.shape.name!r} is not MLA (no kv_lora_rank); the latent kernel needs it"
            )
        reasons += workload.cpu_reasons("the cpu_decode kernel runs")
        variant = None
        if not reasons:
            g = workload.geometry("latent")
            if g.v_head_dim > g.qk_head_dim:
                reasons.append(f"rank {g.v_head_dim} > latent row {g.qk_head_dim}")
            variant, why = self._variant(workload, self.resolve_config(config))
            reasons += why
        tunables = tuple(t for t in self.tunables if t.name != "kv_splits" or torch.get_num_threads() > 1)
        tunables = self._isa_tunable(workload, tunables) if not reasons else tunables
        return self.resolution(
            workload,
            config,
            reasons=reasons,
            implementation=f"cpu_decode.c[{variant}, MLA latent]",
            tunables=tunables,
        )

    def _isa_tunable(self, workload: Workload, tunables: tuple[Tunable, ...]) -> tuple[Tunable, ...]:
        """``isa`` offering ``auto`` and each other variant that runs ``workload`` here (none: no ``isa``),
        so that a tune measures every variant this CPU runs rather than assume the matrix unit wins."""
        auto, _ = self._variant(workload)
        others = tuple(
            v for v in ("c-avx512bf16", "c-amx") if v != auto and self._variant(workload, {"isa": v})[0] == v
        )
        return with_variants(tunables, others=others)

    def error_multiple(self, dtype: torch.dtype, *, config: Mapping[str, Any] | None = None) -> float:
        """The default, 2: P is rounded to bf16 for P·V (as the bf16 cpu_decode kernel rounds it), the
        scores and the softmax stay in fp32; the scalar variant is fp32 throughout."""
        return super().error_multiple(dtype, config=config)

    # -- the cache and the step --------------------------------------------------------------------
    def create_cache(
        self, workload: Workload, *, config: Mapping[str, Any], num_layers: int, max_seq_len: int
    ) -> CpuDecodeMLACache:
        res = self.resolve(workload, config).require()
        cfg = dict(res.config)
        g = workload.geometry("latent")
        cache = CpuDecodeMLACache(
            **self.cache_fields(workload, cfg, num_layers, max_seq_len),
            page_size=cfg["page_size"],
            page_order="random",
            share_v=True,
        )
        variant, _ = self._variant(workload, cfg)
        assert variant is not None
        cache.implementation = "cpu"
        cache.isa = variant
        cache.kv_splits = cfg["kv_splits"]
        cache.workspace = torch.empty(cache.batch * MAX_SPLITS * g.num_q_heads * (g.v_head_dim + 2))
        cache.seq_lens32 = torch.zeros(cache.batch, dtype=torch.int32)
        return cache

    def plan(self, cache: KVCache, *, num_new: Sequence[int]) -> CpuDecodeMLAPlan:
        assert isinstance(cache, CpuDecodeMLACache)
        base = cache.plan_step(num_new)
        cache.seq_lens32.copy_(torch.tensor(base.seq_lens_after, dtype=torch.int32))
        threads = torch.get_num_threads()
        splits = kv_splits_for(
            cache.kv_splits, work=cache.batch, threads=threads, max_len=max(base.seq_lens_after)
        )
        return base.extend(CpuDecodeMLAPlan, seq_lens32=cache.seq_lens32, splits=splits, threads=threads)

    def decode(
        self, cache: KVCache, plan: StepPlan, *, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """``q [B, H, rank + rope]`` (absorbed), ``k [B, 1, rank + rope]`` → latent output ``[B, H, rank]``."""
        assert isinstance(cache, CpuDecodeMLACache) and isinstance(plan, CpuDecodeMLAPlan)
        cache.write(plan, layer=layer, k=k[:, None], v=v[:, None])
        g = cache.geometry
        q = q.contiguous()
        if q.dtype != cache.dtype:
            raise TypeError(f"backend {self.name!r}: q dtype {q.dtype}; the cache holds {cache.dtype}")
        out = torch.empty(q.shape[0], g.num_q_heads, g.v_head_dim, dtype=q.dtype)
        kernel = load_kernel(self.kernel_build)
        assert not isinstance(kernel, str) and plan.seq_lens32 is not None
        args = step_args(
            cache,
            plan,
            q,
            out,
            k_cache=cache.k_pages[layer].data_ptr(),
            v_head_dim=g.v_head_dim,
            isa=ISA_CODES[cache.isa],
        )
        rc = kernel.lib.cpu_decode_attend_latent(ctypes.byref(args))
        if rc != 0:
            raise kernel_failed(self.name, rc)
        return out


__all__ = ["CpuDecodeMLABackend", "CpuDecodeMLACache", "CpuDecodeMLAPlan"]
