"""Decode steps that replay as CUDA graphs: plans live in buffers the cache owns, filled in place.

For every capturable backend (its Triton path: interpreted on the CPU, native on CUDA), three decode
steps at a fixed batch: each tensor field of the plan keeps its storage and holds what a plan built
from scratch holds. On CUDA, a graph of a whole step captured at step 1 replays at steps 2–5 (one of
them crossing a page boundary) with the eager outputs.
"""

from __future__ import annotations

import copy
import os
from dataclasses import fields
from typing import Any

import torch

if not torch.cuda.is_available():  # as tests/conftest.py: the interpreter, chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from attnbench.backends.fp8 import FP8Backend
from attnbench.backends.mla import MLABackend
from attnbench.backends.naive import NaiveBackend
from attnbench.backends.triton_paged import TritonPagedBackend
from attnbench.core.backend import Backend, StepPlan
from attnbench.core.registry import load_registry
from attnbench.core.shapes import load_shape
from attnbench.core.workload import Workload
from attnbench.kernels.paged import PagedKVCache
from attnbench.testing import CASES

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class FP8TritonBackend(FP8Backend):
    """fp8 with its Triton path forced (the capturable one; interpreted on the CPU)."""

    kernel = "triton"


#: (backend, config, shape): the capturable path of every capturable built-in backend
CAPTURABLE: list[tuple[type[Backend], dict[str, Any], str]] = [
    (TritonPagedBackend, {"page_size": 16, "num_splits": 0}, "gqa"),
    (FP8TritonBackend, {"page_size": 16, "num_splits": 2}, "gqa"),
    (MLABackend, {"page_size": 16, "kernel": "triton", "num_splits": 0}, "tiny-mla"),
]
IDS = ["triton_paged", "fp8", "mla"]


def _workload(shape: str, lens: tuple[int, ...], dtype: torch.dtype = torch.float32) -> Workload:
    model = load_shape(shape) if shape == "tiny-mla" else next(c.shape for c in CASES if c.id == shape)
    return Workload(model, lens, dtype, DEVICE)


def _inputs(backend: Backend, w: Workload, gen: torch.Generator, *, t: int | None = None) -> dict:
    g = w.geometry(backend.kv_form)
    b = w.batch
    lead = (b,) if t is None else (b, t)
    kw = {"dtype": w.dtype}
    q = torch.randn(*lead, g.num_q_heads, g.qk_head_dim, generator=gen, **kw)
    k = torch.randn(*lead, g.num_kv_heads, g.qk_head_dim, generator=gen, **kw)
    v = (
        k[..., : g.v_head_dim].clone()
        if backend.kv_form == "latent"
        else torch.randn(*lead, g.num_kv_heads, g.v_head_dim, generator=gen, **kw)
    )
    return {"q": q.to(w.device), "k": k.to(w.device), "v": v.to(w.device)}


def _prefilled(backend: Backend, config: dict, shape: str, lens: tuple[int, ...], layers: int = 2):
    w = _workload(shape, lens)
    cache = backend.create_cache(w, config=config, num_layers=layers, max_seq_len=64)
    plan = backend.plan(cache, num_new=list(lens))
    gen = torch.Generator().manual_seed(0)
    for layer in range(layers):
        x = _inputs(backend, w, gen, t=max(lens))
        backend.append(cache, plan, layer=layer, k=x["k"], v=x["v"])
    cache.commit(plan)
    return w, cache, gen


def _tensor_fields(plan: StepPlan) -> dict[str, tuple[torch.Tensor, bool]]:
    """Every tensor field of a plan, with whether it is scratch (storage kept, contents undefined)."""
    return {
        f.name: (getattr(plan, f.name), bool(f.metadata.get("scratch")))
        for f in fields(plan)
        if isinstance(getattr(plan, f.name), torch.Tensor)
    }


def test_every_capturable_builtin_is_tested_and_naive_is_not_capturable() -> None:
    registry = load_registry(env={"ATTNBENCH_DISABLE_PLUGIN_AUTOLOAD": "1"})
    capturable = {e.name for e in registry if getattr(e.cls, "capturable", False)}
    assert capturable == {cls.name for cls, _, _ in CAPTURABLE}
    assert NaiveBackend.capturable is False


@pytest.mark.parametrize(("cls", "config", "shape"), CAPTURABLE, ids=IDS)
def test_plan_fields_keep_their_storage_and_match_a_fresh_plan(cls: type, config: dict, shape: str) -> None:
    backend = cls()
    lens = (14, 31)  # over 3 steps: 15..17 and 32..34 — both sequences cross a page boundary (16, 32)
    w, cache, gen = _prefilled(backend, config, shape, lens)
    assert isinstance(cache, PagedKVCache)
    first: dict[str, int] = {}
    for step in range(3):
        fresh_cache = copy.deepcopy(cache)  # the same state, its own storage
        plan = backend.plan(cache, num_new=[1] * w.batch)
        fresh = backend.plan(fresh_cache, num_new=[1] * w.batch)
        tensors = _tensor_fields(plan)
        assert {"device_lens", "device_positions", "block_table", "slots", "part_o", "part_lse"} <= set(
            tensors
        )
        if step == 0:
            first = {name: t.data_ptr() for name, (t, _) in tensors.items()}
        for name, (tensor, scratch) in tensors.items():
            assert tensor.data_ptr() == first[name], f"step {step}: {name} moved to new storage"
            other = getattr(fresh, name)
            assert other.data_ptr() != tensor.data_ptr()  # the fresh plan really is another one
            assert tensor.shape == other.shape and tensor.dtype == other.dtype, name
            if not scratch:
                assert torch.equal(tensor, other), f"step {step}: {name} differs from a fresh plan"
        # and both say what the host state says
        assert plan.device_lens.tolist() == list(plan.seq_lens_after)
        assert plan.device_positions.tolist() == list(plan.positions)
        assert plan.slots.tolist() == [cache.slot(i, p) for i, p in enumerate(plan.positions)]
        for i, pages in enumerate(cache.pages):
            assert plan.block_table[i, : len(pages)].tolist() == pages
        assert plan.num_splits == fresh.num_splits and plan.bucket == fresh.bucket
        for layer in range(cache.num_layers):
            out = backend.decode(cache, plan, layer=layer, **_inputs(backend, w, gen))
            assert torch.isfinite(out).all()
        cache.commit(plan)
    assert cache.seq_lens == tuple(n + 3 for n in lens)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: graph capture and replay")
@pytest.mark.parametrize(("cls", "config", "shape"), CAPTURABLE, ids=IDS)
def test_a_graph_captured_at_step_1_replays_at_steps_2_to_5(cls: type, config: dict, shape: str) -> None:
    backend = cls()
    lens = (14, 3)  # sequence 0 goes 15 → 19 over five steps: across the page boundary at 16
    w, cache, gen = _prefilled(backend, config, shape, lens)
    layers = range(cache.num_layers)
    static = [_inputs(backend, w, gen) for _ in layers]  # the graph's inputs, refilled every step

    plan = backend.plan(cache, num_new=[1] * w.batch)
    warm = copy.deepcopy(cache)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile the kernels outside the capture, on a copy of the cache
        for layer in layers:
            backend.decode(warm, plan, layer=layer, **static[layer])
    torch.cuda.current_stream().wait_stream(side)
    twin = copy.deepcopy(cache)  # eager runs on a twin in the same state
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [backend.decode(cache, plan, layer=layer, **static[layer]) for layer in layers]
    captured_splits, captured_bucket = plan.num_splits, plan.bucket

    for step in range(1, 6):
        if step > 1:
            twin = copy.deepcopy(cache)
            plan = backend.plan(cache, num_new=[1] * w.batch)  # refills the buffers the graph reads
            assert (plan.num_splits, plan.bucket) == (captured_splits, captured_bucket)
            for layer in layers:
                for name, value in _inputs(backend, w, gen).items():
                    static[layer][name].copy_(value)
        graph.replay()
        twin_plan = backend.plan(twin, num_new=[1] * w.batch)
        eager = [backend.decode(twin, twin_plan, layer=layer, **static[layer]) for layer in layers]
        torch.cuda.synchronize()
        for layer in layers:
            torch.testing.assert_close(outs[layer], eager[layer], rtol=0, atol=0)
        cache.commit(plan)
    assert cache.seq_lens[0] == 19 and cache.pages[0] != [] and len(cache.pages[0]) == 2
