"""vLLM's KV tensor in 2 MiB pages, as ``attnbench bench`` and ``tune`` measure the kernel.

vLLM allocates its KV cache with ``torch.zeros`` and fills it, so on a kernel whose transparent huge
pages are ``madvise`` (the common default) the whole cache sits in 4 KiB pages, and every page of a
layer's K/V that ``cpu_decode`` streams costs a TLB walk that attnbench's own measurement (2 MiB pages)
does not pay: 1-2 ms a step at batch 1 x 32k on the developers' CPU, measured without the engine
(``results/engines/attention-gemv-mix-epyc-avx512.md``). At the first write to a layer's cache the
plugin asks the kernel for huge pages over it (:func:`advise`: the cache, still all zeros, is dropped
and faults back in 2 MiB pages as it fills — collapsing it instead, ``MADV_COLLAPSE``, cost 2.5 s a
GiB here). It is advice: where the kernel refuses (THP ``never``, no free huge pages) the cache stays
as it was and one log line says so — the same bytes either way. ``ATTNBENCH_VLLM_HUGEPAGES=0``
switches it off.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time

import torch

log = logging.getLogger("vllm.plugins.attnbench")

HUGE = 2 << 20
MADV_HUGEPAGE = 14
MADV_DONTNEED = 4
ENV = "ATTNBENCH_VLLM_HUGEPAGES"
#: the storages (their addresses) advised in this process
_seen: set[int] = set()


def enabled() -> bool:
    """Whether the plugin asks for huge pages (``ATTNBENCH_VLLM_HUGEPAGES``: unset or ``1`` on, ``0`` off;
    anything else is refused naming the value)."""
    value = os.environ.get(ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(
            f"{ENV}={value!r}: expected 1 (2 MiB pages for vLLM's KV tensor, the default) or 0 (off)"
        )
    return value == "1"


def huge_range(address: int, nbytes: int) -> tuple[int, int]:
    """The whole 2 MiB pages inside ``[address, address + nbytes)`` as (start, length); length 0 if none."""
    start = -(-address // HUGE) * HUGE
    end = (address + nbytes) // HUGE * HUGE
    return start, max(0, end - start)


def _madvise(start: int, length: int, advice: int) -> int:
    """0, or the errno the kernel answered."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return 0 if libc.madvise(start, length, advice) == 0 else ctypes.get_errno()


def advise(kv_cache: torch.Tensor, name: str) -> str:
    """Ask for 2 MiB pages over the storage behind ``kv_cache`` (vLLM views every layer's cache in one
    backing allocation), once per storage in this process; what was done, also said in one log line.

    Where every byte of the storage is still zero (as ``torch.zeros`` left it: nothing written yet,
    checked, never assumed), its 4 KiB pages are dropped (``MADV_DONTNEED``, which reads back as zeros:
    the same contents) under ``MADV_HUGEPAGE``, so the cache faults back in 2 MiB pages as it fills.
    Where something is already written, only ``MADV_HUGEPAGE`` (the kernel's background collapse);
    never a byte changed."""
    storage = kv_cache.untyped_storage()
    base = storage.data_ptr()
    if base in _seen:
        return "seen"
    _seen.add(base)
    start, length = huge_range(base, storage.nbytes())
    if length == 0:
        return "small"
    began = time.perf_counter()
    whole = torch.empty(0, dtype=torch.uint8).set_(storage)
    empty = not bool(whole[start - base : start - base + length].view(torch.int64).any())
    for advice in (MADV_HUGEPAGE, MADV_DONTNEED) if empty else (MADV_HUGEPAGE,):
        err = _madvise(start, length, advice)
        if err:
            log.info(
                "attnbench: madvise(%d) on the KV cache (%d MiB, first written by layer %s) refused (%s): "
                "it stays in the pages it has (set %s=0 to stop asking)",
                advice,
                length >> 20,
                name,
                os.strerror(err),
                ENV,
            )
            return "refused"
    done = (
        "will fill in 2 MiB pages (it was empty)"
        if empty
        else f"was written before layer {name}'s first write: 2 MiB pages asked for, the rest left to the kernel"
    )
    log.info(
        "attnbench: the KV cache (%d MiB) %s; %.3f s (%s=0 to stop)",
        length >> 20,
        done,
        time.perf_counter() - began,
        ENV,
    )
    return "dropped" if empty else "advised"
