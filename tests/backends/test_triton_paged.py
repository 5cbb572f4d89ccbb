"""The paged KV cache and the ``triton_paged`` backend (interpreted on CPU, native on CUDA)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, ClassVar

import torch

# Without CUDA the kernels run in the Triton interpreter, which must be chosen before triton is first
# imported (tests/conftest.py does the same); with CUDA they run natively on the GPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from helpers.triton_modes import run_uninterpreted

from attnbench.backends.triton_paged import (
    BLOCK_N,
    NUM_SPLITS,
    PAGE_SIZES,
    TritonPagedBackend,
)
from attnbench.core.shapes import ModelShape
from attnbench.core.workload import Workload
from attnbench.correctness.gate import check
from attnbench.kernels.paged import PagedKVCache, PagedStepPlan
from attnbench.kernels.split_kv import SplitKVPlan
from attnbench.kernels.triton_decode import auto_splits, context_bucket
from attnbench.kernels.triton_utils import triton_mode
from attnbench.testing import BackendConformance, ConformanceCase

#: where the backend's kernels run in these tests: natively on a GPU, else interpreted on the CPU
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def small_shape(*, heads: int, kv_heads: int, head_dim: int) -> ModelShape:
    name = f"test-h{heads}-kv{kv_heads}-d{head_dim}"
    return ModelShape.attention_only(name, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)


# -- the paged cache --------------------------------------------------------------------------------
@pytest.mark.parametrize("page_order", ["sequential", "random"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_paged_cache_round_trip(page_order: str, page_size: int) -> None:
    shape = small_shape(heads=4, kv_heads=2, head_dim=8)
    lens = (5, 0, 19, 16)
    w = Workload(shape, lens, torch.float32)
    cache = PagedKVCache(
        workload=w,
        geometry=w.geometry(),
        config={},
        num_layers=2,
        max_seq_len=24,
        page_size=page_size,
        page_order=page_order,  # type: ignore[arg-type]
        seed=3,
    )
    plan = cache.plan_step(lens)
    assert isinstance(plan, PagedStepPlan)
    assert plan.src is not None  # ragged prompt: only the real rows are written
    k, v = torch.randn(4, 19, 2, 8), torch.randn(4, 19, 2, 8)
    cache.write(plan, layer=1, k=k, v=v)
    cache.commit(plan)
    for step in range(3):
        plan = cache.plan_step([1] * 4)
        assert plan.src is None
        k1, v1 = torch.randn(4, 1, 2, 8), torch.randn(4, 1, 2, 8)
        cache.write(plan, layer=1, k=k1, v=v1)
        cache.commit(plan)
        k, v = _append(k, v, k1, v1, [n + step for n in lens])
    for i, n in enumerate(cache.seq_lens):
        assert n == lens[i] + 3
        gk, gv = cache.gather(1, i)
        torch.testing.assert_close(gk, k[i, :n], rtol=0, atol=0)
        torch.testing.assert_close(gv, v[i, :n], rtol=0, atol=0)
        assert not cache.gather(0, i)[0].any()  # layer 0 untouched
    used = [p for row in cache.pages for p in row]
    assert len(used) == len(set(used))  # no page shared by two sequences
    table = cache.block_table.tolist()
    for i, row in enumerate(cache.pages):
        assert table[i][: len(row)] == row
    if page_order == "random" and page_size < 16:
        assert used != sorted(used), "random page order should not hand out pages in order"


def _append(k, v, k1, v1, positions):
    width = max(max(positions) + 1, k.shape[1])
    kk = torch.zeros(k.shape[0], width, *k.shape[2:])
    vv = torch.zeros_like(kk)
    kk[:, : k.shape[1]], vv[:, : v.shape[1]] = k, v
    for i, p in enumerate(positions):
        kk[i, p], vv[i, p] = k1[i, 0], v1[i, 0]
    return kk, vv


def test_paged_cache_errors_and_reset() -> None:
    w = Workload(small_shape(heads=2, kv_heads=1, head_dim=8), (3, 3), torch.float32)
    with pytest.raises(ValueError, match="page_size = 0"):
        PagedKVCache(workload=w, geometry=w.geometry(), config={}, num_layers=1, max_seq_len=8, page_size=0)
    with pytest.raises(ValueError, match="page_order = 'shuffled'"):
        PagedKVCache(
            workload=w,
            geometry=w.geometry(),
            config={},
            num_layers=1,
            max_seq_len=8,
            page_size=4,
            page_order="shuffled",  # type: ignore[arg-type]
        )
    cache = PagedKVCache(
        workload=w, geometry=w.geometry(), config={}, num_layers=1, max_seq_len=8, page_size=4, num_pages=3
    )
    cache.plan_step([5, 3])  # 2 + 1 pages
    with pytest.raises(RuntimeError, match="out of pages"):
        cache.reserve([5, 5])
    with pytest.raises(TypeError, match="convert first"):
        plan = cache.plan_step([1, 1])
        cache.write(plan, layer=0, k=torch.randn(2, 1, 1, 8).half(), v=torch.randn(2, 1, 1, 8).half())
    cache.reset()
    assert cache.seq_lens == (0, 0) and cache.pages == [[], []] and not cache.block_table.any()


def test_paged_cache_share_v() -> None:
    w = Workload(small_shape(heads=2, kv_heads=1, head_dim=8), (4,), torch.float32)
    g = w.geometry()
    from dataclasses import replace

    g = replace(g, v_head_dim=6)
    cache = PagedKVCache(
        workload=w, geometry=g, config={}, num_layers=1, max_seq_len=8, page_size=2, share_v=True
    )
    plan = cache.plan_step([4])
    k = torch.randn(1, 4, 1, 8)
    cache.write(plan, layer=0, k=k, v=k[..., :6])
    cache.commit(plan)
    gk, gv = cache.gather(0, 0)
    assert torch.equal(gv, k[0, :, :, :6]) and torch.equal(gk, k[0])
    assert cache.bytes_per_token() == 8 * 4


# -- the triton_paged backend -----------------------------------------------------------------------

# Small shapes (the interpreter is slow), ragged lengths that are not multiples of any page size, enough
# tokens to span several pages at page_size 16 and several splits.
MLA_SMALL = dataclasses.replace(
    small_shape(heads=2, kv_heads=2, head_dim=24),
    name="test-mla-expanded",
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
)
SMALL_CASES = (
    ConformanceCase(
        "mha", small_shape(heads=2, kv_heads=2, head_dim=16), (7, 19, 1), (37, 5, 50), decode_steps=2
    ),
    ConformanceCase(
        "gqa", small_shape(heads=4, kv_heads=2, head_dim=32), (16, 3, 40), (45, 70), decode_steps=2
    ),
    ConformanceCase(
        "mqa", small_shape(heads=4, kv_heads=1, head_dim=16), (1, 24), (33, 2, 60), decode_steps=2
    ),
    # MLA's expanded form: Dk 24 ≠ Dv 16, both padded to 32 inside the kernel
    ConformanceCase("mla_expanded", MLA_SMALL, (9, 21, 2), (20, 41), decode_steps=2),
)


def _paired_configs() -> list[dict]:
    """Every page size, split count and tile size at least once, paired so the grid stays small:
    tiles both larger than a page (per-token page lookup) and within one page."""
    n = max(len(PAGE_SIZES), len(NUM_SPLITS), len(BLOCK_N))
    return [
        {"page_size": PAGE_SIZES[i % len(PAGE_SIZES)], "num_splits": NUM_SPLITS[i % len(NUM_SPLITS)],
         "block_n": BLOCK_N[i % len(BLOCK_N)]}
        for i in range(n)
    ]  # fmt: skip


CONFIGS = _paired_configs()


def test_paired_configs_cover_every_declared_choice() -> None:
    for t in TritonPagedBackend.tunables:
        assert {c[t.name] for c in CONFIGS} == set(t.choices), t.name
    assert any(c["block_n"] > c["page_size"] for c in CONFIGS)
    assert any(c["block_n"] < c["page_size"] for c in CONFIGS)


class TestTritonPagedFp32(BackendConformance):
    """Every declared page size / split count / tile size, tight fp32 tolerance."""

    backend = TritonPagedBackend
    device = DEVICE
    dtypes = ("fp32",)
    configs: ClassVar[list[dict[str, Any]]] = CONFIGS
    cases = SMALL_CASES


class TestTritonPagedBf16(BackendConformance):
    """bf16 (the dtype served in practice) at the default config."""

    backend = TritonPagedBackend
    device = DEVICE
    dtypes = ("bf16",)
    configs: ClassVar[list[dict[str, Any]]] = [TritonPagedBackend.default_config()]
    cases = SMALL_CASES


@pytest.mark.skipif(torch.cuda.is_available(), reason="without CUDA only: the interpreted mode")
def test_availability_interpreted() -> None:
    backend = TritonPagedBackend()
    w = Workload(small_shape(heads=4, kv_heads=2, head_dim=16), (8,), torch.float32, "cpu")
    assert backend.supports(w) == [] and backend.interpreted(w)
    assert backend.implementation(w) == "triton[interpreted]"
    big = Workload(small_shape(heads=2, kv_heads=1, head_dim=512), (8,), torch.float32, "cpu")
    assert any("head_dim 512" in r for r in backend.supports(big))
    with pytest.raises(
        ValueError, match="compute dtype must be one of bf16, fp16, fp32"
    ):  # refused at the workload
        Workload(small_shape(heads=2, kv_heads=1, head_dim=16), (8,), torch.float8_e4m3fn, "cpu")


_NO_INTERPRETER = """
from attnbench.backends.triton_paged import TritonPagedBackend
from attnbench.core.workload import Workload
w = Workload.uniform("tiny-gqa", batch=1, context=8, dtype="fp32")
b = TritonPagedBackend()
print(b.supports(w)); print(b.interpreted(w)); print(b.implementation(w))
try:
    b.create_cache(w, config={}, num_layers=1, max_seq_len=16)
except ValueError as err:
    print("refused:", err)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="without CUDA only: checks the CPU refusal")
def test_unavailable_without_the_interpreter() -> None:
    reasons, interpreted, impl, refused = run_uninterpreted(_NO_INTERPRETER)
    assert "TRITON_INTERPRET=1" in reasons and interpreted == "False"
    assert impl.startswith("unavailable") and refused.startswith("refused:")


def test_auto_splits() -> None:
    # batch 1 with 8 KV heads on a 132-SM GPU: split until the grid fills the device
    kw = {"block_n": 32, "programs": 264, "max_splits": 16}
    assert auto_splits(programs_per_split=8, max_len=32768, **kw) == 16
    # a big batch fills the device alone
    assert auto_splits(programs_per_split=64 * 8, max_len=32768, **kw) == 1
    assert auto_splits(programs_per_split=8 * 8, max_len=32768, **kw) == 8
    # short sequences are not split into less than two tiles per split
    assert auto_splits(programs_per_split=8, max_len=100, **kw) == 1
    assert auto_splits(programs_per_split=1, max_len=256, block_n=16, programs=8, max_splits=16) == 8
    # the split count is a function of the context bucket: the same for every length in it
    assert {context_bucket(n, max_seq_len=4096) for n in range(1025, 2049)} == {2048}
    assert context_bucket(5000, max_seq_len=4096) == 4096 and context_bucket(3, max_seq_len=4096) == 64


def test_plan_is_per_step_and_pages_are_permuted() -> None:
    backend = TritonPagedBackend()
    w = Workload(small_shape(heads=4, kv_heads=2, head_dim=16), (40, 3), torch.float32, DEVICE)
    cfg = backend.resolve_config({"page_size": 16, "num_splits": 4})
    cache = backend.create_cache(w, config=cfg, num_layers=2, max_seq_len=64)
    plan = backend.plan(cache, num_new=[40, 3])
    pages = [p for row in cache.pages for p in row]
    assert pages != sorted(pages) or len(pages) < 3
    assert isinstance(plan, SplitKVPlan) and plan.num_splits == 4 and plan.part_o.shape == (2, 4, 4, 16)
    one = backend.plan(cache, num_new=[1, 1])
    assert one.num_splits == 4 and cache.split_kv.mode == triton_mode(DEVICE)[0]
    assert one.part_o.data_ptr() == plan.part_o.data_ptr()  # the cache's buffers, not the step's


def test_gate_single_token_and_empty_splits() -> None:
    """Sequences of 1 token (after the new one), and 16 splits over a few tokens (most splits empty)."""
    backend = TritonPagedBackend()
    w = Workload(small_shape(heads=4, kv_heads=2, head_dim=16), (0, 1, 17), torch.float32, DEVICE)
    for cfg in ({"num_splits": 16, "block_n": 16}, {"num_splits": 1, "page_size": 256, "block_n": 64}):
        result = check(backend, w, config=cfg)
        assert result.passed, result.summary()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: host-sync detection and graph capture")
def test_decode_has_no_host_sync_and_captures_in_a_cuda_graph() -> None:
    backend = TritonPagedBackend()
    w = Workload(small_shape(heads=8, kv_heads=2, head_dim=64), (100, 7, 300), torch.bfloat16, "cuda")
    cache = backend.create_cache(
        w, config=backend.resolve_config({"num_splits": 4}), num_layers=2, max_seq_len=512
    )
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to("cuda", torch.bfloat16)

    plan = backend.plan(cache, num_new=list(w.context_lens))
    for layer in range(2):
        backend.append(cache, plan, layer=layer, k=randn(3, 300, 2, 64), v=randn(3, 300, 2, 64))
    cache.commit(plan)
    plan = backend.plan(cache, num_new=[1, 1, 1])
    q, k, v = randn(3, 8, 64), randn(3, 2, 64), randn(3, 2, 64)
    eager = backend.decode(cache, plan, layer=0, q=q, k=k, v=v)  # also compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host-device sync inside decode() raises
    try:
        backend.decode(cache, plan, layer=1, q=q, k=k, v=v)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        backend.decode(cache, plan, layer=0, q=q, k=k, v=v)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = backend.decode(cache, plan, layer=0, q=q, k=k, v=v)  # rewrites the same slot: idempotent
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, eager, rtol=0, atol=0)
