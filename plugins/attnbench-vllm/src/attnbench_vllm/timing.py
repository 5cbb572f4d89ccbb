"""How long vLLM's attention layers take inside the engine, for ``scripts/vllm_attention_share.py``.

With ``ATTNBENCH_VLLM_TIMING=FILE`` in the environment of a vLLM engine, :func:`install` (called by the
plugin's entry point in every vLLM process, the model's worker included) puts a timer around the
attention layers' ``forward`` and KV-cache write — attnbench's implementation where ``ATTNBENCH_VLLM=1``,
vLLM's ``CPU_ATTN`` otherwise — and after the model's last attention layer of each step writes to FILE,
as one JSON object: the cumulative seconds (``attention_s``), the calls, the worker's torch threads and
CPU affinity. Two more sums tell where the rest of a step goes: the attention metadata builder's
``build`` (``build_s``: vLLM's per-step metadata, and on attnbench's path its plan) and Python's garbage
collector (``gc_s``, from ``gc.callbacks``). Unset, nothing is installed.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

#: under vLLM's logger, so the line appears in vLLM's log
log = logging.getLogger("vllm.plugins.attnbench")
#: the setting: a file the worker writes its cumulative attention time to, once per step
ENV = "ATTNBENCH_VLLM_TIMING"


def install(served: bool) -> None:
    path = os.environ.get(ENV)
    if not path:
        return
    impl: type
    builder: type
    if served:
        from attnbench_vllm.cpu_attn import AttnbenchCPUImpl, AttnbenchCPUMetadataBuilder

        impl, builder = AttnbenchCPUImpl, AttnbenchCPUMetadataBuilder
    else:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl, CPUAttentionMetadataBuilder

        impl, builder = CPUAttentionBackendImpl, CPUAttentionMetadataBuilder
    state: dict[str, Any] = {
        "attention_s": 0.0, "build_s": 0.0, "gc_s": 0.0, "calls": 0, "last": -1, "failed": False, "gc_t0": 0.0,
    }  # fmt: skip
    target = Path(path)

    def dump() -> None:
        import torch

        record = {
            "attention_s": state["attention_s"],
            "build_s": state["build_s"],
            "gc_s": state["gc_s"],
            "calls": state["calls"],
            "threads": torch.get_num_threads(),
            "affinity": sorted(os.sched_getaffinity(0)),
            "pid": os.getpid(),
        }
        tmp = target.with_name(target.name + f".{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(record))
            os.replace(tmp, target)
        except OSError as exc:  # a timer never stops the engine: one line, then no more writes
            if not state.get("failed"):
                log.warning(
                    "%s=%s: cannot write the attention timing (%s); timing goes on unwritten", ENV, path, exc
                )
            state["failed"] = True

    def layer_index(layer: Any) -> int:
        m = re.search(r"\.(\d+)\.", getattr(layer, "layer_name", ""))
        return int(m.group(1)) if m else -1

    for name in ("forward", "do_kv_cache_update"):
        inner = getattr(impl, name)

        def timed(
            self: Any, layer: Any, *args: Any, __inner: Any = inner, __name: str = name, **kwargs: Any
        ) -> Any:
            t0 = time.perf_counter()
            try:
                return __inner(self, layer, *args, **kwargs)
            finally:
                state["attention_s"] += time.perf_counter() - t0
                state["calls"] += 1
                if __name == "forward":
                    index = layer_index(layer)
                    if index >= state["last"]:  # the last attention layer of the step: the step is done
                        state["last"] = index
                        if not state["failed"]:
                            dump()

        setattr(impl, name, timed)

    inner_build = builder.build

    def timed_build(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner_build(self, *args, **kwargs)
        finally:
            state["build_s"] += time.perf_counter() - t0

    builder.build = timed_build  # type: ignore[method-assign]

    def collected(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            state["gc_t0"] = time.perf_counter()
        else:
            state["gc_s"] += time.perf_counter() - state["gc_t0"]

    gc.callbacks.append(collected)
