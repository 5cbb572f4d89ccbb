"""``ATTNBENCH_VLLM_TIMING``: the worker's record of where a step's time goes (attention, the metadata
builder, the garbage collector), which ``scripts/vllm_attention_share.py`` reads.

Needs vLLM's CPU build (`vllm_required.py` beside it).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
from pathlib import Path
from typing import Any

import pytest
from vllm_required import require_vllm

require_vllm()

from attnbench_vllm import timing  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import (  # noqa: E402
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)


class _Layer:
    layer_name = "model.layers.0.self_attn.attn"


def test_the_record_sums_attention_builder_and_collector(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "attention.json"
    monkeypatch.setenv(timing.ENV, str(target))
    saved: dict[str, Any] = {
        "forward": CPUAttentionBackendImpl.forward,
        "do_kv_cache_update": CPUAttentionBackendImpl.do_kv_cache_update,
    }
    build, callbacks = CPUAttentionMetadataBuilder.build, list(gc.callbacks)
    try:
        timing.install(served=False)
        # vLLM's own calls, given objects they cannot use, may raise: the time is summed all the same
        with contextlib.suppress(Exception):
            CPUAttentionMetadataBuilder.build(object(), 0, None)
        with contextlib.suppress(Exception):
            CPUAttentionBackendImpl.forward(object(), _Layer(), None, None, None, None, None, None)
        gc.collect()
        first = json.loads(target.read_text())  # written after the forward of the step's last layer
        assert first["calls"] == 1 and first["attention_s"] > 0 and first["build_s"] > 0
        assert first["pid"] == os.getpid() and first["threads"] >= 1
        with contextlib.suppress(Exception):
            CPUAttentionBackendImpl.forward(object(), _Layer(), None, None, None, None, None, None)
        second = json.loads(target.read_text())
        assert second["calls"] == 2 and second["attention_s"] > first["attention_s"]
        assert second["gc_s"] > 0  # the collection between the two forwards
    finally:
        for name, fn in saved.items():
            setattr(CPUAttentionBackendImpl, name, fn)
        CPUAttentionMetadataBuilder.build = build  # type: ignore[method-assign]
        gc.callbacks[:] = callbacks
