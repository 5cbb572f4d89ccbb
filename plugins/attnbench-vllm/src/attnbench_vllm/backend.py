"""``vllm_cpu`` and ``vllm_cpu_fp8`` — vLLM's CPU attention kernels on vLLM's own paged cache.

The kernels are called through vLLM's wrappers in ``vllm._custom_ops``, in the shape of vLLM's
``CPUAttentionBackendImpl`` (``vllm/v1/attention/backends/cpu_attn.py``):

- the cache of one layer is vLLM's tensor ``[num_blocks, Hkv, block_size, 2 · D]`` viewed as
  ``[num_blocks, Hkv, 2 · block_size, D]`` and split into its key and value halves; the bytes inside a
  block are laid out by ``cpu_attn_reshape_and_cache`` for the ISA variant (so a cache written for
  one variant is read by that variant only). The block table ``[B, blocks_per_seq]`` int32 is a random
  permutation of the blocks, as a serving engine's would be after a while.
- :meth:`VllmCpuBackend.plan` is vLLM's metadata builder: ``query_start_loc``, ``seq_lens``, the slot
  mapping and ``cpu_attn_get_scheduler_metadata`` (the work split over threads, with or without KV
  split), once per step, shared by every layer.
- per layer, ``decode()`` calls ``cpu_attn_reshape_and_cache`` (the new token) and
  ``cpu_attention_with_kv_cache``; ``prefill()`` does the same over the packed prompt (causal).

Tunables are vLLM's own choices: the ISA variant (``auto`` is vLLM's pick; the others only where
this CPU has them, see :mod:`attnbench_vllm.isa`), the block size and KV split on or off (vLLM's
``VLLM_CPU_ATTN_SPLIT_KV``). ``vllm_cpu_fp8`` is vLLM's fp8 (e4m3) KV cache with unit scales (vLLM's
default without calibrated scales): lossy (``lossy``), declared like the built-in ``fp8`` (``reference_kv`` and
``stored_tolerance``).

Which call may allocate: ``create_cache`` (the cache), ``plan`` (small metadata tensors);
``decode`` allocates only its output. vLLM's CPU kernels run on the host: there is no graph capture.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from attnbench.core.backend import Backend, KVCache, Resolution, StepPlan, Tolerance, Tunable, base_plan
from attnbench.core.workload import Workload
from attnbench_vllm import isa as isa_mod
from attnbench_vllm.quant import FP8_EXACT_TOLERANCE, FP8_STORED_TOLERANCE, stored_fp8

#: head sizes vLLM's CPU backend declares (``CPUAttentionBackend.get_supported_head_sizes``)
HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
BLOCK_SIZES = (32, 64, 128)  # vLLM's CPU kernels take multiples of 32; 128 is vLLM's CPU default

#: vLLM's name for the attention backend these kernels are (``AttentionBackendEnum.CPU_ATTN``)
VLLM_BACKEND_NAME = "CPU_ATTN"


@dataclass
class VllmStepPlan(StepPlan):
    """vLLM's per-step metadata (``CPUAttentionMetadata``), built once and read by every layer."""

    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32, lengths once the step's tokens are in
    slot_mapping: torch.Tensor  # [total new tokens] int64: block · block_size + offset
    token_index: torch.Tensor  # [total new tokens] int64 rows of the padded [B · T] input
    scheduler_metadata: torch.Tensor  # vLLM's opaque work split (int8)


class VllmKVCache(KVCache):
    """vLLM's paged cache: ``kv: [L, num_blocks, Hkv, block_size, 2 · D]`` plus a block table."""

    def __init__(self, *, isa: str, kv_cache_dtype: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        g = self.geometry
        self.isa = isa  # the variant that runs (never "auto")
        self.kv_cache_dtype = kv_cache_dtype  # vLLM's name: "auto" (= compute dtype) or "fp8_e4m3"
        #: what every step's scheduler plan is made for
        self.kernel_shape = isa_mod.KernelShape(
            num_heads=g.num_q_heads,
            num_kv_heads=g.num_kv_heads,
            head_dim=g.qk_head_dim,
            dtype=self.dtype,
            isa=isa,
            kv_cache_dtype=kv_cache_dtype,
        )
        self.block_size = int(self.config["block_size"])
        self.blocks_per_seq = math.ceil(max(self.max_seq_len, 1) / self.block_size)
        num_blocks = self.batch * self.blocks_per_seq
        store = torch.uint8 if kv_cache_dtype != "auto" else self.dtype
        # zeros: blocks past a sequence's length are masked by the kernel, never read as garbage
        self.kv = torch.zeros(
            self.num_layers, num_blocks, g.num_kv_heads, self.block_size, 2 * g.qk_head_dim, dtype=store
        )
        # [num_blocks, Hkv, block_size, D] halves of every layer (vLLM's view + chunk)
        self.halves = [
            layer.view(num_blocks, g.num_kv_heads, 2 * self.block_size, g.qk_head_dim).chunk(2, dim=2)
            for layer in self.kv
        ]
        self.block_table = torch.randperm(num_blocks, dtype=torch.int32).view(self.batch, self.blocks_per_seq)

    def bytes_per_token(self) -> int:
        g = self.geometry
        return g.num_kv_heads * 2 * g.qk_head_dim * self.kv.element_size() * self.num_layers

    def nbytes(self) -> int:
        return self.kv.nbytes


class VllmCpuBackend(Backend):
    name = "vllm_cpu"
    description = "vLLM's CPU attention kernels (cpu_attention_with_kv_cache) on vLLM's paged cache"
    tunables = (
        Tunable("isa", ("auto", *isa_mod.ISAS), "auto", "vLLM's CPU kernel variant (auto: vLLM's choice)"),
        Tunable("block_size", BLOCK_SIZES, 128, "tokens per cache block"),
        Tunable(
            "kv_split", (True, False), True, "split long sequences over threads (VLLM_CPU_ATTN_SPLIT_KV)"
        ),
    )
    #: vLLM's KV-cache dtype string for this backend's cache
    kv_cache_dtype: ClassVar[str] = "auto"
    #: how the choice maps to vLLM's settings (read by ``attnbench.select``; see docs/engines.md)
    engine: ClassVar[str] = "vllm"

    # -- what it can do --------------------------------------------------------------------------
    @property
    def fp8(self) -> bool:
        return self.kv_cache_dtype != "auto"

    def kv_bytes_per_token(self, workload: Workload, *, config: Mapping[str, Any]) -> int:
        """K and V (``2 · head_dim`` per KV head) in the compute dtype, or one byte each for fp8."""
        g = workload.geometry(self.kv_form)
        size = 1 if self.fp8 else workload.dtype.itemsize
        return g.num_kv_heads * 2 * g.qk_head_dim * size * workload.shape.num_layers

    def supports(self, workload: Workload) -> list[str]:
        g = workload.geometry(self.kv_form)
        reasons = workload.cpu_reasons("vLLM's CPU kernels run")
        if g.qk_head_dim != g.v_head_dim:
            reasons.append(
                f"key and value head dims differ ({g.qk_head_dim} vs {g.v_head_dim}); vLLM's CPU kernel needs one head_dim"
            )
        elif g.qk_head_dim not in HEAD_SIZES:
            reasons.append(f"head_dim {g.qk_head_dim} not in vLLM's CPU head sizes {HEAD_SIZES}")
        if reasons:
            return reasons
        err = isa_mod.vllm_error()
        if err:
            return [err]
        isa = isa_mod.resolve_isa("auto", dtype=workload.dtype, head_dim=g.qk_head_dim)
        return isa_mod.isa_reasons(isa, dtype=workload.dtype, head_dim=g.qk_head_dim, fp8=self.fp8)

    def error_multiple(self, dtype: torch.dtype, *, config: Mapping[str, Any] | None = None) -> float:
        """fp32: 6× the calibration error. vLLM's vector kernels compute ``exp`` with a polynomial
        approximation and accumulate in blocks, a few fp32 ulp (about 4× the calibration reference,
        ~1e-6 relative) on the gate's inputs; bf16 and fp16 are at the default."""
        return 6.0 if dtype == torch.float32 else super().error_multiple(dtype, config=config)

    def _isa(self, workload: Workload, config: Mapping[str, Any]) -> str:
        g = workload.geometry(self.kv_form)
        return isa_mod.resolve_isa(config["isa"], dtype=workload.dtype, head_dim=g.qk_head_dim)

    def implementation(self, workload: Workload) -> str:
        """The kernel and the ISA variant ``isa=auto`` (the default) runs on this CPU.

        A config with an explicit ``isa`` runs that variant (``create_cache`` refuses one this CPU
        lacks); ``cache.isa`` is the variant a cache runs, whichever way it was chosen.
        """
        reasons = self.supports(workload)
        if reasons:
            return "unavailable: " + "; ".join(reasons)
        isa = self._isa(workload, self.default_config())
        cache = "" if not self.fp8 else f", {self.kv_cache_dtype} cache"
        return f"vllm {isa_mod.vllm_version()} cpu_attention_with_kv_cache[auto: {isa_mod.describe_isa(isa)}{cache}]"

    def resolve(self, workload: Workload, config: Mapping[str, Any] | None = None) -> Resolution:
        """The base answer, refused where the config's explicit ``isa`` cannot run here (``amx`` on a
        CPU without AMX tiles or in fp32, ``vec16`` with an fp8 cache, ...): the same reasons
        :meth:`create_cache` would raise with."""
        res = super().resolve(workload, config)
        if not res.runnable:
            return res
        g = workload.geometry(self.kv_form)
        reasons = isa_mod.isa_reasons(
            self._isa(workload, res.config), dtype=workload.dtype, head_dim=g.qk_head_dim, fp8=self.fp8
        )
        return res.refused(*reasons, implementation="unavailable: " + "; ".join(reasons)) if reasons else res

    def tunables_for(self, workload: Workload) -> tuple[Tunable, ...]:
        """``isa`` offers ``auto`` plus the variants this CPU has that ``auto`` does not already pick."""
        g = workload.geometry(self.kv_form)
        auto = isa_mod.resolve_isa("auto", dtype=workload.dtype, head_dim=g.qk_head_dim)
        others = [
            i
            for i in isa_mod.available_isas(dtype=workload.dtype, head_dim=g.qk_head_dim, fp8=self.fp8)
            if i != auto
        ]
        isa = self.tunables[0].narrowed(("auto", *others))
        return (isa, *self.tunables[1:])

    def engine_setting(self, config: Mapping[str, Any]) -> str:
        """The vLLM settings that run this kernel, with the backend name checked against vLLM's enum."""
        cfg = self.resolve_config(config)
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        names = [e.name for e in AttentionBackendEnum]
        if VLLM_BACKEND_NAME not in names:
            raise LookupError(
                f"vllm {isa_mod.vllm_version()} has no attention backend {VLLM_BACKEND_NAME!r}; it has {', '.join(names)}"
            )
        parts = [
            f"vllm {isa_mod.vllm_version()}: --attention-backend {VLLM_BACKEND_NAME}",
            f"--block-size {cfg['block_size']}",
            f"VLLM_CPU_ATTN_SPLIT_KV={int(cfg['kv_split'])}",
        ]
        if self.fp8:
            parts.append("--kv-cache-dtype fp8")
        if cfg["isa"] != "auto":
            parts.append(
                f"(isa {cfg['isa']} is vLLM's pick only where it matches its rule; vLLM has no isa setting)"
            )
        return " ".join(parts)

    # -- the cache and the step ------------------------------------------------------------------
    def create_cache(
        self, workload: Workload, *, config: Mapping[str, Any], num_layers: int, max_seq_len: int
    ) -> VllmKVCache:
        cfg = self.resolve_config(config)
        g = workload.geometry(self.kv_form)
        isa = self._isa(workload, cfg)
        reasons = self.supports(workload) + isa_mod.isa_reasons(
            isa, dtype=workload.dtype, head_dim=g.qk_head_dim, fp8=self.fp8
        )
        if reasons:
            raise ValueError(
                f"backend {self.name!r} cannot run {workload.describe()} with {cfg}: {'; '.join(reasons)}"
            )
        return VllmKVCache(
            isa=isa,
            kv_cache_dtype=self.kv_cache_dtype,
            **self.cache_fields(workload, cfg, num_layers, max_seq_len),
        )

    def plan(self, cache: KVCache, *, num_new: Sequence[int]) -> VllmStepPlan:
        assert isinstance(cache, VllmKVCache)
        base = base_plan(cache, num_new)
        bs, t = cache.block_size, base.max_new
        new = torch.tensor(base.num_new, dtype=torch.int32)
        query_start_loc = torch.zeros(cache.batch + 1, dtype=torch.int32)
        torch.cumsum(new, 0, out=query_start_loc[1:])
        rows, pos = [], []
        for i, (p, n) in enumerate(zip(base.positions, base.num_new, strict=True)):
            rows.append(torch.arange(i * t, i * t + n))
            pos.append(torch.arange(p, p + n))
        seq = torch.cat([torch.full((n,), i) for i, n in enumerate(base.num_new)])
        positions = torch.cat(pos)
        slot_mapping = cache.block_table[seq, positions // bs].long() * bs + positions % bs
        seq_lens = base.device_lens.to(torch.int32)
        metadata = isa_mod.scheduler_plan(
            cache.kernel_shape,
            seq_lens=seq_lens,
            query_start_loc=query_start_loc,
            kv_split=bool(cache.config["kv_split"]),
        )
        return base.extend(
            VllmStepPlan,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            slot_mapping=slot_mapping,
            token_index=torch.cat(rows),
            scheduler_metadata=metadata,
        )

    def _write(
        self, cache: VllmKVCache, plan: VllmStepPlan, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """``k``/``v`` ``[tokens, Hkv, D]`` (packed) into ``layer`` at ``plan.slot_mapping``."""
        key_cache, value_cache = cache.halves[layer]
        isa_mod.vllm_ops().cpu_attn_reshape_and_cache(
            k.contiguous(),
            v.contiguous(),
            key_cache,
            value_cache,
            plan.slot_mapping,
            cache.isa,
            kv_cache_dtype=cache.kv_cache_dtype,
        )

    def _attend(self, cache: VllmKVCache, plan: VllmStepPlan, layer: int, q: torch.Tensor) -> torch.Tensor:
        """``q [tokens, Hq, D]`` (packed) → ``[tokens, Hq, D]``, causal over each sequence's cache."""
        key_cache, value_cache = cache.halves[layer]
        out = torch.empty_like(q)
        isa_mod.causal_attention(
            q,
            key_cache,
            value_cache,
            out,
            query_start_loc=plan.query_start_loc,
            seq_lens=plan.seq_lens,
            scale=cache.geometry.scale,
            block_table=cache.block_table,
            plan=plan.scheduler_metadata,
            kv_cache_dtype=cache.kv_cache_dtype,
        )
        return out

    def append(self, cache: KVCache, plan: StepPlan, *, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        assert isinstance(cache, VllmKVCache) and isinstance(plan, VllmStepPlan)
        pack = plan.token_index
        self._write(cache, plan, layer, k.flatten(0, 1)[pack], v.flatten(0, 1)[pack])

    def prefill(
        self, cache: KVCache, plan: StepPlan, *, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """``q [B, T, Hq, D]`` → ``[B, T, Hq, D]`` through vLLM's kernel (causal, packed prompts).

        A prompt after a cached prefix is vLLM's chunked prefill: the plan's ``seq_lens`` count the
        prefix, so each new row attends to the prefix (as stored) and to the prompt up to itself.
        """
        assert isinstance(cache, VllmKVCache) and isinstance(plan, VllmStepPlan)
        self.append(cache, plan, layer=layer, k=k, v=v)
        b, t = q.shape[:2]
        packed = self._attend(cache, plan, layer, q.flatten(0, 1)[plan.token_index].contiguous())
        out = q.new_zeros(b * t, *q.shape[2:])
        out[plan.token_index] = packed
        return out.view_as(q)

    def decode(
        self, cache: KVCache, plan: StepPlan, *, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """``q [B, Hq, D]``, ``k``/``v`` ``[B, Hkv, D]`` → ``[B, Hq, D]``; no host work."""
        assert isinstance(cache, VllmKVCache) and isinstance(plan, VllmStepPlan)
        self._write(cache, plan, layer, k, v)
        return self._attend(cache, plan, layer, q.contiguous())


class VllmCpuFP8Backend(VllmCpuBackend):
    name = "vllm_cpu_fp8"
    description = "vLLM's CPU attention kernels over vLLM's fp8 (e4m3) KV cache, unit scales (lossy)"
    kv_cache_dtype = "fp8_e4m3"
    lossy = "fp8 e4m3 K/V (vLLM's CPU cache, truncated, unit scales)"

    def tolerance(self, dtype: torch.dtype) -> Tolerance:
        return FP8_EXACT_TOLERANCE

    def stored_tolerance(self, dtype: torch.dtype) -> Tolerance:
        return FP8_STORED_TOLERANCE[dtype]

    def reference_kv(self, k: torch.Tensor, v: torch.Tensor, *, config: Mapping[str, Any]) -> tuple:
        """``k``/``v`` as vLLM's CPU cache stores them (see :func:`attnbench_vllm.quant.stored_fp8`)."""
        return stored_fp8(k, scale=1.0), stored_fp8(v, scale=1.0)
