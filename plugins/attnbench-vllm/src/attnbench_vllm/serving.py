"""vLLM serves through attnbench's CPU decode kernel: a ``vllm.general_plugins`` entry point.

With ``ATTNBENCH_VLLM=1`` in the environment of ``vllm serve`` (or of a process that builds
``vllm.LLM``), :func:`register` — which vLLM calls in every one of its processes — registers
:class:`attnbench_vllm.cpu_attn.AttnbenchCPUBackend` under vLLM's ``CPU_ATTN`` name through vLLM's own ``register_backend``:
on a CPU, vLLM's platform always asks for ``CPU_ATTN``, so every decoder layer of the model gets it.
Unset (or ``0``), nothing is registered and vLLM runs as it ships.

Per layer, the backend runs ``cpu_decode`` (attnbench's C kernel) on vLLM's own KV tensor or hands the
layer to vLLM's ``CPU_ATTN`` implementation, decided once when the layer is built:

- **The cache.** vLLM allocates each layer's KV tensor as ``[blocks, kv_heads, block_size,
  2 · head_size]`` (its ``LBHNC`` layout), one contiguous run of ``2 · block_size · head_size`` values
  per block and KV head — exactly one page of one KV head in ``cpu_decode``'s layout
  (``[pages, Hkv, page_size / 16, 2, 16 · D]``, 16-key tiles, K then V). The same tensor is read in
  that layout; vLLM's block size is the page size.
- **Writes.** :meth:`AttnbenchCPUImpl.do_kv_cache_update` writes the step's new K/V with the kernel's
  writer, each token at its slot (``slot // block_size``, ``slot % block_size``) from vLLM's slot mapping.
- **The step.** :class:`AttnbenchCPUMetadataBuilder` turns vLLM's per-step metadata (query start
  locations, sequence lengths, block table) into one :class:`ServingPlan` shared by every layer: which
  requests decode one token and which run a prefill chunk, their block table rows and lengths as int32,
  the KV splits and a workspace. Decode rows go through the kernel in one call per layer; a prefill
  chunk attends to its cached prefix (read back from the pages) and to itself with
  :func:`attnbench.core.prefill.prefill_attention` (SDPA's flash kernel, chunked, never a T×T matrix).
- **Fallback.** A layer with a feature the kernel does not run exactly — a sliding window, attention
  sinks, logit soft-capping, ALiBi, an fp8 KV cache, encoder or cross attention, a head size that is
  not a multiple of 16 — runs vLLM's implementation, with one log line naming the feature, the layer and
  the fallback. Never a traceback, never another answer.
"""

from __future__ import annotations

import logging
import os

#: under vLLM's logger, so the lines appear in vLLM's log with its format and level
log = logging.getLogger("vllm.plugins.attnbench")

#: the one setting: ``ATTNBENCH_VLLM=1`` serves through attnbench's kernel; unset or ``0``: vLLM as it ships
SWITCH = "ATTNBENCH_VLLM"


def enabled() -> bool:
    """Whether :data:`SWITCH` asks for the plugin; a value other than ``0``/``1`` raises naming it."""
    value = os.environ.get(SWITCH, "0").strip()
    if value not in ("0", "1", ""):
        raise ValueError(
            f"{SWITCH}={value!r}: expected 1 (serve through attnbench's kernel) or 0 (vLLM's own)"
        )
    return value == "1"


def register() -> None:
    """vLLM's ``vllm.general_plugins`` entry point: register :class:`attnbench_vllm.cpu_attn.AttnbenchCPUBackend` as ``CPU_ATTN``
    where :data:`SWITCH` is ``1`` and vLLM runs on a CPU; elsewhere one log line says why not."""
    from attnbench_vllm import timing

    if not enabled():
        timing.install(served=False)
        return
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if not current_platform.is_cpu():
        log.warning(
            "%s=1: attnbench serves vLLM's CPU engine only; this vLLM runs on %s, so its own backend runs",
            SWITCH,
            current_platform.device_type,
        )
        return
    register_backend(AttentionBackendEnum.CPU_ATTN, "attnbench_vllm.cpu_attn.AttnbenchCPUBackend")
    timing.install(served=True)
    log.info("%s=1: vLLM's CPU_ATTN is attnbench's cpu_decode (vLLM's own per layer where it must)", SWITCH)
