"""``CPU_ATTN`` as attnbench serves it: vLLM's CPU attention backend classes, subclassed so that each
decoder layer runs ``cpu_decode`` on vLLM's own KV tensor (or vLLM's implementation where it must).

Imported by vLLM's attention registry when :func:`attnbench_vllm.serving.register` has registered
:class:`AttnbenchCPUBackend` (``ATTNBENCH_VLLM=1``); the module docstring of
:mod:`attnbench_vllm.serving` describes the layout, the writes, the plan and the fallback.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from vllm import _custom_ops as vllm_ops
from vllm import envs as vllm_envs
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.attention.attention import get_attention_context
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends import cpu_attn as vllm_cpu_attn
from vllm.v1.attention.backends.utils import get_layers_from_vllm_config

import attnbench
from attnbench.backends.cpu_decode import CpuDecodeBackend, kv_splits_for, read_pages
from attnbench.backends.cpu_decode_fp8 import dequantized_pages, measured_variant
from attnbench.backends.cpu_kernel import (
    DTYPE_CODES,
    FP8_SHIFT_CODE,
    ISA_CODES,
    MAX_SPLITS,
    AttendArgs,
    Kernel,
    WriteArgs,
    kernel_failed,
    kernel_isa,
    load_kernel,
)
from attnbench.core.registry import load_registry
from attnbench.core.shapes import ModelShape
from attnbench.core.workload import bucket
from attnbench_vllm.isa import KernelShape, causal_attention, scheduler_plan

#: under vLLM's logger, so the lines appear in vLLM's log with its format and level
log = logging.getLogger("vllm.plugins.attnbench")
#: the fp8 cache's variant, c-avx512bf16 with the shift conversion, as the kernel's ``isa`` and
#: ``fp8_convert`` fields (computed once: the calls below run per layer and step)
_FP8_ISA, _FP8_CONVERT = kernel_isa(FP8_SHIFT_CODE)
_BF16 = DTYPE_CODES[torch.bfloat16]


def _kernel() -> Kernel:
    kernel = load_kernel()
    if isinstance(kernel, str):
        raise RuntimeError(kernel)
    return kernel


# -- the per-step plan ---------------------------------------------------------------------------------
@dataclass
class PrefillPlan:
    """The step's prefill chunks as vLLM's own kernel takes them, over a scratch cache in vLLM's layout.

    ``rows``: the chunks' token rows (``[Np]`` int64, request by request; ``contiguous`` where they are
    one run from ``rows[0]``); ``query_start_loc`` ``[P + 1]`` and ``seq_lens`` ``[P]`` int32 of the
    sub-batch; ``block_table`` ``[P, max_blocks]`` int32 into ``scratch`` (``[blocks, Hkv, block_size,
    2 · D]``, each request's whole sequence from its first block); ``prefix_slots``: for each request with a
    cached prefix, ``(request, prefix length, slots [prefix] int64)``; ``chunk_slots`` ``[Np]`` int64: where
    the chunks' own keys go; ``scheduler_metadata``: vLLM's work split for the sub-batch.
    """

    rows: torch.Tensor
    contiguous: bool
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    prefix_slots: list[tuple[int, int, torch.Tensor]]
    chunk_slots: torch.Tensor
    #: vLLM's instruction-set name for its kernel and the scratch cache's layout (its builder's choice)
    isa: str
    scratch: torch.Tensor = field(repr=False)
    scheduler_metadata: torch.Tensor = field(repr=False)


@dataclass
class ServingPlan:
    """One step's metadata in the kernel's terms, built once per step and read by every layer.

    ``decode_rows``: the token rows (``[Nd]`` int64) of requests that decode one token;
    ``decode_block_table`` ``[Nd, max_blocks]`` and ``decode_seq_lens`` ``[Nd]`` int32 (contiguous, as the
    kernel reads them); ``prefill``: the requests that run a prefill chunk (``None`` where none does);
    ``block_table`` ``[R, max_blocks]`` int32 of every request.
    """

    num_tokens: int
    decode_rows: torch.Tensor
    decode_block_table: torch.Tensor
    decode_seq_lens: torch.Tensor
    all_decode: bool
    prefill: PrefillPlan | None
    block_table: torch.Tensor
    splits: int
    prefetch: int
    #: the step's KV writes, shared by every layer (None: each layer makes its own)
    writes: SlotWrites | None
    threads: int
    workspace: torch.Tensor = field(repr=False)


@dataclass(frozen=True, kw_only=True)
class GroupShape(KernelShape):
    """What every step of a KV-cache group shares: its attention geometry, the model's dtype, vLLM's
    instruction-set name for its own kernel (the prefill's and its scratch layout) and vLLM's block
    size. As a :class:`KernelShape` it is the prefill's: vLLM's kernel over the scratch cache, which
    holds the model's dtype (``kv_cache_dtype`` ``"auto"`` whatever vLLM's cache holds)."""

    block_size: int


def build_plan(
    *,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    num_tokens: int,
    shape: GroupShape,
    step_params: Callable[[int, int], tuple[str | int, int]] | None = None,
    slot_mapping: torch.Tensor | None = None,
) -> ServingPlan:
    """The :class:`ServingPlan` of a step from vLLM's per-request tensors (host work, once per step);
    ``step_params(batch, context)`` gives the decode's KV splits and prefetch distance (default: ``auto``
    and 2, ``cpu_decode``'s defaults)."""
    starts = query_start_loc.to("cpu", torch.int64)
    lens = seq_lens.to("cpu", torch.int64)
    q_lens = starts[1:] - starts[:-1]
    table = block_table.to("cpu", torch.int32).contiguous()
    decode = torch.nonzero(q_lens == 1).flatten()
    threads = torch.get_num_threads()
    n_dec = int(decode.numel())
    max_len = int(lens[decode].max()) if n_dec else 1
    kv_splits, prefetch = step_params(max(1, n_dec), max_len) if step_params else ("auto", 2)
    g = shape
    splits = kv_splits_for(kv_splits, work=max(1, n_dec * g.num_kv_heads), threads=threads, max_len=max_len)
    all_decode = n_dec == len(q_lens) and n_dec == num_tokens
    group = g.num_heads // g.num_kv_heads
    prefill_reqs = torch.nonzero(q_lens > 1).flatten().tolist()
    return ServingPlan(
        num_tokens=num_tokens,
        decode_rows=starts[decode],
        decode_block_table=table if all_decode else table[decode].contiguous(),
        decode_seq_lens=lens[decode].to(torch.int32).contiguous(),
        all_decode=all_decode,
        prefill=_prefill_plan(prefill_reqs, starts, q_lens, lens, shape) if prefill_reqs else None,
        block_table=table,
        splits=splits,
        prefetch=prefetch,
        writes=SlotWrites.of(slot_mapping, g.block_size) if slot_mapping is not None else None,
        threads=threads,
        workspace=torch.empty(max(1, n_dec) * g.num_kv_heads * MAX_SPLITS * group * (g.head_dim + 2)),
    )


def _prefill_plan(
    reqs: list[int],
    starts: torch.Tensor,
    q_lens: torch.Tensor,
    lens: torch.Tensor,
    shape: GroupShape,
) -> PrefillPlan:
    block_size = shape.block_size
    rows, chunk_slots, prefix_slots, table_rows = [], [], [], []
    qsl, seq = [0], []
    first_block = 0
    for r in reqs:
        q_len, seq_len, start = int(q_lens[r]), int(lens[r]), int(starts[r])
        prefix = seq_len - q_len
        n_blocks = -(-seq_len // block_size)
        base = first_block * block_size
        rows.append(torch.arange(start, start + q_len))
        chunk_slots.append(torch.arange(base + prefix, base + seq_len))
        if prefix:
            prefix_slots.append((r, prefix, torch.arange(base, base + prefix)))
        table_rows.append(torch.arange(first_block, first_block + n_blocks, dtype=torch.int32))
        qsl.append(qsl[-1] + q_len)
        seq.append(seq_len)
        first_block += n_blocks
    width = max(t.numel() for t in table_rows)
    table = torch.zeros(len(reqs), width, dtype=torch.int32)
    for i, t in enumerate(table_rows):
        table[i, : t.numel()] = t
    row_index = torch.cat(rows)
    query_start_loc = torch.tensor(qsl, dtype=torch.int32)
    seq_lens = torch.tensor(seq, dtype=torch.int32)
    return PrefillPlan(
        rows=row_index,
        contiguous=bool(row_index[-1] - row_index[0] + 1 == row_index.numel()),
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_table=table,
        prefix_slots=prefix_slots,
        chunk_slots=torch.cat(chunk_slots),
        isa=shape.isa,
        # zeros: vLLM's kernel masks the slots past a sequence's end but multiplies them (0 · NaN = NaN)
        scratch=torch.zeros(
            first_block, shape.num_kv_heads, block_size, 2 * shape.head_dim, dtype=shape.dtype
        ),
        scheduler_metadata=scheduler_plan(
            shape,
            seq_lens=seq_lens,
            query_start_loc=query_start_loc,
            kv_split=vllm_envs.VLLM_CPU_ATTN_SPLIT_KV,
        ),
    )


# -- the choice at engine start -----------------------------------------------------------------------
@dataclass(frozen=True)
class Decision:
    """What :func:`choose` decided for a KV-cache group: whether ``cpu_decode`` serves it, and why."""

    serves: bool
    #: the reason a served layer runs vLLM's own kernel instead (empty where ``serves``)
    why_not: str
    #: ``attnbench.select``'s explanation, or why it could not answer
    explanation: str
    #: the page size the chosen ``cpu_decode`` config wants (vLLM's ``--block-size``), where it serves
    page_size: int | None = None


#: what each vLLM attention form can be served by: attnbench's kernel, or vLLM's own (its attnbench backend)
CANDIDATES = ("cpu_decode", "vllm_cpu")


def _shape(num_heads: int, num_kv_heads: int, head_size: int, num_layers: int) -> ModelShape:
    return ModelShape.attention_only(
        f"vllm-h{num_heads}-kv{num_kv_heads}-d{head_size}",
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_size,
        num_layers=num_layers,
        source="vLLM's model config (attnbench-vllm)",
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]


def _registry(names: tuple[str, ...]) -> Any:
    registry = load_registry()
    entries = {name: registry.entries[name] for name in names if name in registry.entries}
    return dataclasses.replace(registry, entries=entries)


def choose(
    *, num_heads: int, num_kv_heads: int, head_size: int, num_layers: int, dtype: torch.dtype, context: int
) -> Decision:
    """Ask ``attnbench.select()`` which of ``cpu_decode`` and vLLM's own kernel (``vllm_cpu``) is faster for
    this geometry and dtype on this CPU, at batch 1 and the engine's longest context: from the tuned
    table where one covers it (``attnbench tune`` with both as candidates), else the fitted or roofline
    fallback (the explanation says which: the roofline cannot tell two kernels that read the same
    bytes apart, and breaks the tie to ``cpu_decode``). Where ``select()`` fails, vLLM's own kernel
    runs, with the reason."""
    try:
        choice = attnbench.select(
            model=_shape(num_heads, num_kv_heads, head_size, num_layers),
            batch=1,
            context=context,
            dtype=_dtype_name(dtype),
            device="cpu",
            registry=_registry(CANDIDATES),
        )
    except Exception as exc:  # any failure of the choice: vLLM's own kernel, said in one line
        why = f"attnbench.select() could not choose ({type(exc).__name__}: {exc})"
        return Decision(False, why, f"{why}: vLLM's CPU_ATTN runs every layer")
    if choice.backend == "cpu_decode":
        return Decision(True, "", choice.explain(), int(choice.config.get("page_size", 128)))
    return Decision(False, f"attnbench.select() chose {choice.backend} for this geometry", choice.explain())


class StepParams:
    """Per step, the ``cpu_decode`` parameters (KV splits, prefetch distance) for the step's decode batch
    and longest context, from the tuned dispatch map through ``attnbench.select()`` restricted to
    ``cpu_decode`` (its defaults where no table covers the geometry, or where ``select()`` fails). Asked
    once per step by the metadata builder and remembered per (batch, context) bucket (powers of two, the
    tuning key's buckets): ``select()`` runs a handful of times in an engine's life, the first at engine
    start (:meth:`warm`)."""

    def __init__(self, shape: ModelShape, dtype: torch.dtype) -> None:
        self.shape = shape
        self.dtype = _dtype_name(dtype)
        self.registry = _registry(("cpu_decode",))
        self.remembered: dict[tuple[int, int], tuple[str | int, int]] = {}

    def warm(self, context: int) -> None:
        """Ask for batch 1 at ``context`` now (engine start), not in the first decode step."""
        self(1, context)

    def __call__(self, batch: int, context: int) -> tuple[str | int, int]:
        key = (bucket(batch), bucket(context))
        params = self.remembered.get(key)
        if params is None:
            try:
                config = attnbench.select(
                    model=self.shape, batch=batch, context=key[1], dtype=self.dtype, device="cpu",
                    registry=self.registry,
                ).config  # fmt: skip
                params = (config.get("kv_splits", "auto"), int(config.get("prefetch", 2)))
            except Exception:  # the defaults, as without a table: the step must run
                params = ("auto", 2)
            self.remembered[key] = params
        return params


# -- vLLM's backend classes ----------------------------------------------------------------------------------
@dataclass
class AttnbenchCPUMetadata(vllm_cpu_attn.CPUAttentionMetadata):
    plan: ServingPlan | None = None


class AttnbenchCPUMetadataBuilder(vllm_cpu_attn.CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: Any) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        layers = get_layers_from_vllm_config(vllm_config, Attention, layer_names)
        dtype = cast(torch.dtype, self.dtype)  # resolved to a torch dtype by vLLM
        decision = choose(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_dim,
            num_layers=len(layers),
            dtype=dtype,
            context=vllm_config.model_config.max_model_len,
        )
        log.info("attnbench (ATTNBENCH_VLLM=1) at engine start:\n%s", decision.explanation)
        if decision.serves and decision.page_size != self.block_size:
            log.warning(
                "attnbench: the chosen cpu_decode config pages %d tokens; this engine's --block-size is %d, "
                "which cpu_decode runs as its page size (start vLLM with --block-size %d for the tuned one)",
                decision.page_size,
                self.block_size,
                decision.page_size,
            )
        self.group_shape = GroupShape(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=dtype,
            isa=self.isa,
            block_size=self.block_size,
        )
        self.step_params = StepParams(
            _shape(self.num_heads, self.num_kv_heads, self.head_dim, len(layers)), dtype
        )
        if decision.serves:
            self.step_params.warm(vllm_config.model_config.max_model_len)
        served = 0
        for layer in layers.values():
            if isinstance(layer.impl, AttnbenchCPUImpl):
                layer.impl.delegated = decision.why_not
                served += not layer.impl.refusal and not layer.impl.delegated
        #: whether any layer of this group runs cpu_decode (else no plan is built: vLLM's own runs them all)
        self.serves = served > 0
        fp8 = self.kv_cache_dtype in FP8_KV_DTYPES
        log.info(
            "attnbench (ATTNBENCH_VLLM=1): %d of %d attention layers on %s, %s, %d query / %d KV "
            "heads of %d, vLLM's block size %d as the page size (the others, if any, on vLLM's CPU_ATTN: "
            "each says why)",
            served,
            len(layers),
            "cpu_decode_fp8.c[c-avx512bf16, e4m3 K/V with a float32 scale per token and KV head]"
            if fp8
            else f"cpu_decode.c[{_variant(_kernel(), dtype)}]",
            str(dtype).removeprefix("torch."),
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.block_size,
        )

    def build(self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False) -> Any:
        md = super().build(common_prefix_len, common_attn_metadata, fast_build)
        plan = None
        if self.serves and md.causal is True and md.encoder_cache is None and md.dynamic_causal is None:
            plan = build_plan(
                query_start_loc=common_attn_metadata.query_start_loc_cpu,
                seq_lens=md.seq_lens,
                block_table=md.block_table,
                num_tokens=md.num_actual_tokens,
                shape=self.group_shape,
                step_params=self.step_params,
                slot_mapping=common_attn_metadata.slot_mapping,
            )
        fields = {f: getattr(md, f) for f in md.__dataclass_fields__}
        return AttnbenchCPUMetadata(**fields, plan=plan)


class AttnbenchCPUImpl(vllm_cpu_attn.CPUAttentionBackendImpl):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.refusal = _refusal(self)
        #: set at engine start where attnbench.select() chose vLLM's own kernel for this geometry (why)
        self.delegated = ""
        self.warned = False
        #: fp8 caches: the layer's float32 K and V scales per token and KV head ``[blocks, Hkv,
        #: block_size]``, beside vLLM's KV tensor (which holds the e4m3 bytes); made at the first write
        self.fp8 = bool(self.is_fp8_kv_cache) and not self.refusal
        self.scales: tuple[torch.Tensor, torch.Tensor] | None = None

    def scales_for(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's fp8 scales (zeros at first: a slot is read only after it is written)."""
        if self.scales is None or self.scales[0].shape[0] != kv_cache.shape[0]:
            shape = kv_cache.shape[:3]
            self.scales = torch.zeros(shape, dtype=torch.float32), torch.zeros(shape, dtype=torch.float32)
        return self.scales

    def _falls_back(self, layer: Any) -> bool:
        if self.refusal and not self.warned:
            name = getattr(layer, "layer_name", "?")
            log.warning(
                "attnbench: layer %s has %s, which cpu_decode does not run exactly: vLLM's CPU_ATTN runs it",
                name,
                self.refusal,
            )
            self.warned = True
        return bool(self.refusal or self.delegated)

    def do_kv_cache_update(self, layer: Any, key: Any, value: Any, kv_cache: Any, slot_mapping: Any) -> None:
        if self._falls_back(layer):
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        scales = self.scales_for(kv_cache) if self.fp8 else None
        write_slots(kv_cache, key, value, slot_mapping, scales, _step_writes(layer))
        return None

    def forward(self, layer: Any, query: Any, key: Any, value: Any, kv_cache: Any, attn_metadata: Any, output: Any, output_scale: Any = None, output_block_scale: Any = None) -> Any:  # fmt: skip
        plan = getattr(attn_metadata, "plan", None)
        if self._falls_back(layer) or plan is None or output_scale is not None:
            return super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
            )
        attend(self, plan, query, key, value, kv_cache, output)
        return output


def _step_writes(layer: Any) -> SlotWrites | None:
    """The step's :class:`SlotWrites` from the plan in vLLM's forward context for ``layer`` (None where
    there is none: the writer then makes them from the slot mapping it is given)."""
    try:
        md = get_attention_context(layer.layer_name)[0]
    except Exception:  # no forward context (vLLM's warm-up), or another vLLM's
        return None
    plan = getattr(md, "plan", None)
    return plan.writes if plan is not None else None


class AttnbenchCPUBackend(vllm_cpu_attn.CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type:
        return AttnbenchCPUImpl

    @staticmethod
    def get_builder_cls() -> type:
        return AttnbenchCPUMetadataBuilder


#: vLLM's ``--kv-cache-dtype`` values ``cpu_decode_fp8`` serves (e4m3 bytes; its own scales, see below)
FP8_KV_DTYPES = ("fp8", "fp8_e4m3")


def _refusal(impl: Any) -> str:
    """What of a layer ``cpu_decode`` does not run exactly ("" where it runs the layer)."""
    if impl.attn_type != AttentionType.DECODER:
        return f"{impl.attn_type} attention"
    if impl.sliding_window != -1:
        return f"a sliding window of {impl.sliding_window}"
    if impl.sinks is not None:
        return "attention sinks"
    if impl.logits_soft_cap:
        return f"logit soft-capping at {impl.logits_soft_cap}"
    if impl.alibi_slopes is not None:
        return "ALiBi"
    if impl.is_fp8_kv_cache:
        if impl.kv_cache_dtype not in FP8_KV_DTYPES:
            return f"an {impl.kv_cache_dtype} KV cache (cpu_decode_fp8 stores e4m3: --kv-cache-dtype fp8 or fp8_e4m3)"
        if measured_variant(_kernel()) is None:
            return "an fp8 KV cache on a CPU without AVX512_BF16 and AVX512_VBMI (cpu_decode_fp8's vector variant)"
        if impl.head_size % 32:
            return f"an fp8 KV cache with head size {impl.head_size} (cpu_decode_fp8 takes multiples of 32)"
    if impl.head_size % 16 or impl.head_size > 1024:
        return f"head size {impl.head_size} (cpu_decode takes multiples of 16 up to 1024)"
    if impl.num_heads // impl.num_kv_heads > 64:
        return f"a GQA group of {impl.num_heads // impl.num_kv_heads} query heads per KV head (cpu_decode: up to 64)"
    return ""


# -- the per-layer work ------------------------------------------------------------------------------------
def _pointers(kv_cache: torch.Tensor) -> tuple[int, int]:
    """The kernel's ``kc`` and ``vc`` for a layer's KV tensor: its first K tile and first V tile."""
    d = kv_cache.shape[-1] // 2
    return kv_cache.data_ptr(), kv_cache.data_ptr() + 16 * d * kv_cache.element_size()


@dataclass
class SlotWrites:
    """Where a step's new tokens go, in the writer's terms, from vLLM's slot mapping (``-1``: padding,
    skipped): ``rows`` (``None`` where every row is written) and, per written token, its block
    (``table`` ``[count, 1]``) and position in it (``positions``) as int32, each token a one-token
    sequence. Made once per step in the plan (every layer reuses it) or per call where no plan has it."""

    slot_ptr: int
    num_slots: int
    rows: torch.Tensor | None
    table: torch.Tensor
    positions: torch.Tensor
    ones: torch.Tensor

    @classmethod
    def of(cls, slot_mapping: torch.Tensor, block_size: int) -> SlotWrites:
        slots = slot_mapping.to(torch.int64)
        valid = slots >= 0
        rows = None if bool(valid.all()) else torch.nonzero(valid).flatten()
        if rows is not None:
            slots = slots[rows]
        count = int(slots.numel())
        return cls(
            slot_ptr=slot_mapping.data_ptr(),
            num_slots=int(slot_mapping.numel()),
            rows=rows,
            table=(slots // block_size).to(torch.int32).view(count, 1).contiguous(),
            positions=(slots % block_size).to(torch.int32).contiguous(),
            ones=torch.ones(count, dtype=torch.int32),
        )

    def matches(self, slot_mapping: torch.Tensor) -> bool:
        """Whether these are ``slot_mapping``'s writes (the same tensor memory, within the same step)."""
        return slot_mapping.data_ptr() == self.slot_ptr and int(slot_mapping.numel()) == self.num_slots


def write_slots(
    kv_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    writes: SlotWrites | None = None,
) -> None:
    """``key``/``value`` ``[N, Hkv, D]`` into the layer's pages at vLLM's slots (``-1``: padding, skipped),
    with the kernel's writer (``writes``: the step's, where the plan made them for ``slot_mapping``).
    With ``scales`` (an fp8 cache), the fp8 writer quantises each token and KV head to e4m3 with its own
    scale (``amax / 448``), as ``cpu_decode_fp8`` stores them."""
    _, hkv, ps, two_d = kv_cache.shape
    d = two_d // 2
    n = slot_mapping.shape[0]
    if writes is None or not writes.matches(slot_mapping):
        writes = SlotWrites.of(slot_mapping[:n], ps)
    count = int(writes.ones.numel())
    if count == 0:
        return
    key, value = key[:n], value[:n]
    if writes.rows is not None:
        key, value = key.index_select(0, writes.rows), value.index_select(0, writes.rows)
    kernel = _kernel()
    kc, vc = _pointers(kv_cache)
    dtype = torch.bfloat16 if scales is not None else kv_cache.dtype  # what the writer reads k/v as
    k, v = (t.to(dtype).contiguous().view(count, 1, hkv, d) for t in (key, value))
    fields = dict(
        k_cache=kc,
        v_cache=vc,
        k=k.data_ptr(),
        v=v.data_ptr(),
        block_table=writes.table.data_ptr(),
        positions=writes.positions.data_ptr(),
        num_new=writes.ones.data_ptr(),
        num_seqs=count,
        max_new=1,
        num_kv_heads=hkv,
        head_dim=d,
        page_size=ps,
        max_pages=1,
    )
    if scales is not None:
        args = WriteArgs(
            **fields, k_scales=scales[0].data_ptr(), v_scales=scales[1].data_ptr(), dtype=_BF16, isa=_FP8_ISA
        )
        rc = kernel.lib.cpu_decode_write_fp8(ctypes.byref(args))
        if rc != 0:
            raise kernel_failed("cpu_decode_fp8 (vLLM)", rc, "kernel's writer")
        return
    pair = 2 if kv_cache.dtype == torch.bfloat16 else 1
    args = WriteArgs(**fields, pair=pair, elem_size=kv_cache.element_size())
    rc = kernel.lib.cpu_decode_write(ctypes.byref(args))
    if rc != 0:
        raise kernel_failed("cpu_decode (vLLM)", rc, "kernel's writer")


def read_prefix(
    kv_cache: torch.Tensor,
    blocks: torch.Tensor,
    length: int,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``k``/``v`` ``[length, Hkv, D]`` of one sequence back from vLLM's KV tensor, read in ``cpu_decode``'s
    layout (``blocks``: its block-table row); an fp8 cache (``scales`` given) dequantised as stored, in
    ``dtype``."""
    n_blocks, hkv, ps, two_d = kv_cache.shape
    pages = kv_cache.view(n_blocks, hkv, ps // 16, 2, 16 * (two_d // 2))
    if scales is not None:
        k, v = dequantized_pages(pages.view(torch.uint8), scales[0], scales[1], blocks, length)
        return k.to(dtype or torch.bfloat16), v.to(dtype or torch.bfloat16)
    return read_pages(pages, blocks, length, pair=2 if kv_cache.dtype == torch.bfloat16 else 1)


def attend(
    impl: Any, plan: ServingPlan, query: Any, key: Any, value: Any, kv_cache: Any, output: Any
) -> None:
    """One layer's attention for the step: decode rows through the kernel, prefill chunks through
    :func:`prefill_chunks` over their cached prefix and themselves."""
    n, hq, hkv, d = plan.num_tokens, impl.num_heads, impl.num_kv_heads, impl.head_size
    out = output[:n].view(n, hq, d)
    if plan.decode_rows.numel():
        q = query[:n] if plan.all_decode else query[:n].index_select(0, plan.decode_rows)
        q = q.contiguous()
        res = out if plan.all_decode and out.is_contiguous() else torch.empty_like(q)
        kernel = _kernel()
        kc, vc = _pointers(kv_cache)
        fields = dict(
            q=q.data_ptr(),
            k_cache=kc,
            v_cache=vc,
            block_table=plan.decode_block_table.data_ptr(),
            seq_lens=plan.decode_seq_lens.data_ptr(),
            out=res.data_ptr(),
            workspace=plan.workspace.data_ptr(),
            num_seqs=q.shape[0],
            num_q_heads=hq,
            num_kv_heads=hkv,
            head_dim=d,
            page_size=kv_cache.shape[2],
            max_pages=plan.decode_block_table.shape[1],
            splits=plan.splits,
            dtype=DTYPE_CODES[q.dtype],
            threads=plan.threads,
            prefetch=plan.prefetch,
            scale=impl.scale,
        )
        if impl.fp8:
            ks, vs = impl.scales_for(kv_cache)
            args = AttendArgs(
                **fields,
                k_scales=ks.data_ptr(),
                v_scales=vs.data_ptr(),
                isa=_FP8_ISA,
                fp8_convert=_FP8_CONVERT,
            )
            rc = kernel.lib.cpu_decode_attend_fp8(ctypes.byref(args))
        else:
            args = AttendArgs(**fields, isa=ISA_CODES[_variant(kernel, q.dtype)])
            rc = kernel.lib.cpu_decode_attend(ctypes.byref(args))
        if rc != 0:
            raise kernel_failed("cpu_decode (vLLM)", rc)
        if res is not out:
            out.index_copy_(0, plan.decode_rows, res)
    if plan.prefill is not None:
        prefill_chunks(impl, plan, plan.prefill, query, key, value, kv_cache, out)


def prefill_chunks(
    impl: Any, plan: ServingPlan, pf: PrefillPlan, query: Any, key: Any, value: Any, kv_cache: Any, out: Any
) -> None:
    """The step's prefill chunks through vLLM's own CPU attention kernel, the fastest prefill attention
    on a CPU that the plugin can call (it beats SDPA's flash kernel in bf16 with and without a cached
    prefix): each request's cached prefix (read back from the layer's pages, O(prefix)) and the chunk's
    own keys are written into the step's scratch cache in vLLM's layout, and the chunks' queries attend
    there, causally."""
    n = plan.num_tokens
    first, count = int(pf.rows[0]), int(pf.rows.numel())
    if pf.contiguous:
        q, k, v = (t[first : first + count] for t in (query, key, value))
    else:
        q, k, v = (t[:n].index_select(0, pf.rows) for t in (query, key, value))
    blocks, hkv, ps, two_d = pf.scratch.shape
    key_cache, value_cache = pf.scratch.view(blocks, hkv, 2 * ps, two_d // 2).chunk(2, dim=2)
    for req, length, slots in pf.prefix_slots:
        scales = impl.scales_for(kv_cache) if impl.fp8 else None
        pk, pv = read_prefix(kv_cache, plan.block_table[req], length, scales, pf.scratch.dtype)
        vllm_ops.cpu_attn_reshape_and_cache(pk, pv, key_cache, value_cache, slots, pf.isa)
    vllm_ops.cpu_attn_reshape_and_cache(
        k.to(pf.scratch.dtype), v.to(pf.scratch.dtype), key_cache, value_cache, pf.chunk_slots, pf.isa
    )
    res = out[first : first + count] if pf.contiguous else torch.empty_like(q)
    causal_attention(
        q,
        key_cache,
        value_cache,
        res,
        query_start_loc=pf.query_start_loc,
        seq_lens=pf.seq_lens,
        scale=impl.scale,
        block_table=pf.block_table,
        plan=pf.scheduler_metadata,
    )
    if not pf.contiguous:
        out.index_copy_(0, pf.rows, res)


@functools.cache
def _variant(kernel: Kernel, dtype: torch.dtype) -> str:
    """The variant ``cpu_decode`` runs for ``dtype`` on this CPU (what its backend picks)."""
    return CpuDecodeBackend().variant_for(dtype)
