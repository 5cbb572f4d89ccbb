"""The paged KV cache and the ``triton_paged`` backend (interpreted on CPU, native on CUDA)."""

from __future__ import annotations

import os

# The Triton interpreter must be chosen before any kernel is defined (tests/conftest.py should set it too).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from attnbench.paged import PagedKVCache, PagedStepPlan
from attnbench.shapes import ModelShape
from attnbench.workload import Workload


def small_shape(*, heads: int, kv_heads: int, head_dim: int) -> ModelShape:
    return ModelShape(
        name=f"test-h{heads}-kv{kv_heads}-d{head_dim}",
        num_layers=2,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=heads * head_dim,
        intermediate_size=64,
        vocab_size=64,
        num_params=10_000,
    )


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
