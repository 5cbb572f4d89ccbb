"""The flex backend against attnbench's conformance suite, plus proof that compiling stays out of decode."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import pytest
import torch
from attnbench_flex.backend import FlexBackend
from torch._dynamo.utils import counters

from attnbench import Workload
from attnbench.testing import BackendConformance


class TestFlex(BackendConformance):
    backend = FlexBackend
    dtypes = ("fp32", "bf16")
    # every config compiles its own kernels (seconds each on CPU); the other block sizes are checked below
    configs: ClassVar[list[dict[str, Any]]] = [FlexBackend.default_config()]


def _compilations() -> int:
    return sum(counters["stats"].values()) + sum(counters["inductor"].values())


@pytest.mark.parametrize("block_size", [64, 256])
def test_compile_happens_in_create_cache_never_in_decode(block_size: int) -> None:
    backend = FlexBackend()
    workload = Workload.uniform("tiny-gqa", batch=3, context=40, dtype="fp32")
    g = workload.geometry()
    cache = backend.create_cache(workload, config={"block_size": block_size}, num_layers=2, max_seq_len=300)
    assert cache.max_seq_len % block_size == 0 and cache.max_seq_len >= 300
    assert math.isfinite(cache.compile_seconds) and cache.compile_seconds > 0
    before = _compilations()
    # ragged prompt, then decode steps on both layers: lengths change, shapes and objects do not
    plan = backend.plan(cache, num_new=[5, 130, 1])
    for layer in range(2):
        k = torch.randn(3, 130, g.num_kv_heads, g.qk_head_dim)
        backend.append(cache, plan, layer=layer, k=k, v=torch.randn_like(k))
    cache.commit(plan)
    for _ in range(3):
        plan = backend.plan(cache, num_new=[1, 1, 1])
        for layer in range(2):
            q = torch.randn(3, g.num_q_heads, g.qk_head_dim)
            k = torch.randn(3, g.num_kv_heads, g.qk_head_dim)
            out = backend.decode(cache, plan, layer=layer, q=q, k=k, v=torch.randn_like(k))
            assert out.shape == (3, g.num_q_heads, g.v_head_dim) and torch.isfinite(out).all()
        cache.commit(plan)
    assert _compilations() == before, "a decode call compiled: compile time would leak into a measurement"


def test_other_block_sizes_pass_the_gate() -> None:
    from attnbench.correctness.gate import check

    workload = Workload(Workload.uniform("tiny-gqa", batch=1, context=1).shape, (3, 200, 64), torch.float32)
    for block_size in (64, 256):
        result = check(FlexBackend(), workload, config={"block_size": block_size})
        assert result.passed, result.summary()


def test_unavailable_reason_names_the_device() -> None:
    workload = Workload.uniform("tiny-gqa", batch=1, context=8, dtype="fp32", device="meta")
    reasons = FlexBackend().supports(workload)
    assert reasons and "meta" in reasons[0]
    assert FlexBackend().implementation(workload).startswith("unavailable: ")


def test_report_gives_compile_time_and_decode_time_apart() -> None:
    from attnbench_flex.__main__ import report

    # the same shapes as test_compile_happens_in_create_cache_never_in_decode[64]: no extra compile
    out = report(Workload.uniform("tiny-gqa", batch=3, context=286, dtype="fp32"), block_size=64, repeats=5)
    assert out["gate_passed"], out["gate"]
    assert math.isfinite(out["compile_seconds"]) and out["compile_seconds"] > 0
    assert out["decode_step"]["repeats"] == 5 and out["decode_step"]["median_s"] > 0
    assert out["implementation"] == "torch.compile(flex_attention)[cpu]"
