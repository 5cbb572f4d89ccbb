"""``cpu_decode``: the conformance suite on each variant, the build cache, the layout and the threads.

The kernel is compiled at first use with the system C compiler. Where none is found the suite's
cases skip with that reason — except under ``ATTNBENCH_REQUIRE_CPU_DECODE=1`` (CI), where a kernel
that does not build is a failure.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from helpers.cpu_kernel import SPLIT_CONFIGS, ScalarConformance, scalar

import attnbench.backends.cpu_decode as cpu_decode
from attnbench.backends.cpu_decode import CpuDecodeBackend
from attnbench.backends.cpu_decode_fp8 import CpuDecodeFp8Backend
from attnbench.backends.cpu_kernel import load_kernel
from attnbench.core.registry import load_registry
from attnbench.core.shapes import ModelShape
from attnbench.core.workload import Workload
from attnbench.correctness.gate import check
from attnbench.testing import CASES, BackendConformance

GQA = CASES[1]  # 8 query heads over 2 KV heads of 64


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def test_kernel_builds_where_required() -> None:
    kernel = load_kernel()
    if os.environ.get("ATTNBENCH_REQUIRE_CPU_DECODE") == "1":
        assert not isinstance(kernel, str), kernel
    elif isinstance(kernel, str):
        pytest.skip(kernel)


class TestCpuDecode(BackendConformance):
    """The variant the CPU runs best (on an AVX-512 BF16 CPU: c-avx512bf16 for bf16, c-avx512 else)."""

    backend = CpuDecodeBackend
    dtypes = ("bf16", "fp32", "fp16")
    configs: ClassVar[list[dict[str, Any]]] = [CpuDecodeBackend.default_config(), *SPLIT_CONFIGS]


ScalarCpuDecode = scalar(CpuDecodeBackend, "cpu_decode_scalar")


class TestCpuDecodeScalar(ScalarConformance):
    """The plain-C variant (what runs where the CPU lacks AVX-512), forced on this CPU."""

    backend = ScalarCpuDecode


def _workload(dtype: torch.dtype) -> Workload:
    return Workload(GQA.shape, (40,), dtype, "cpu")


AVX512 = {"avx512f", "avx512bw", "avx512dq", "avx512vl"}
AVX2 = {"avx2", "fma", "f16c"}


def test_implementation_names_the_variant_this_cpu_runs() -> None:
    if isinstance(load_kernel(), str):
        pytest.skip(str(load_kernel()))
    flags = _cpu_flags()
    fallback = "c-avx2" if AVX2.issubset(flags) else "c-scalar"
    bf16 = CpuDecodeBackend().implementation(_workload(torch.bfloat16))
    fp32 = CpuDecodeBackend().implementation(_workload(torch.float32))
    bf16_variant = "c-avx512bf16" if (AVX512 | {"avx512_bf16"}).issubset(flags) else fallback
    assert bf16 == f"cpu_decode.c[{bf16_variant}]"
    assert fp32 == f"cpu_decode.c[{'c-avx512' if AVX512.issubset(flags) else fallback}]"
    assert ScalarCpuDecode().implementation(_workload(torch.bfloat16)) == "cpu_decode.c[c-scalar]"


def test_avx2_runs_where_the_cpu_has_avx2_but_not_avx512() -> None:
    """The CI and developer machines: AVX2 + FMA + F16C without AVX-512 run c-avx2 in every dtype."""
    if isinstance(load_kernel(), str):
        pytest.skip(str(load_kernel()))
    flags = _cpu_flags()
    if not AVX2.issubset(flags) or AVX512 & flags:
        pytest.skip("this CPU is not one with AVX2 + FMA + F16C and without AVX-512")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert CpuDecodeBackend().implementation(_workload(dtype)) == "cpu_decode.c[c-avx2]"


class Avx2CpuDecode(CpuDecodeBackend):
    name = "cpu_decode_avx2"
    force_isa = "c-avx2"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("page_size", "splits"), [(16, 4), (64, 1), (512, 2)])
def test_avx2_and_scalar_agree_on_one_cache(dtype: torch.dtype, page_size: int, splits: int) -> None:
    """c-avx2 and c-scalar decode the same cache (ragged: tails, 16-key steps at page ends) alike."""
    kernel = load_kernel()
    if isinstance(kernel, str):
        pytest.skip(kernel)
    shape = ModelShape.attention_only("gqa-14-2", num_heads=14, num_kv_heads=2, head_dim=64)  # 4 + 3 heads
    lens = (301, 17, 64)
    w = Workload(shape, lens, dtype, "cpu")
    backend = Avx2CpuDecode()
    if backend.supports(w):
        pytest.skip("; ".join(backend.supports(w)))
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    cache = backend.create_cache(w, config={"page_size": page_size}, num_layers=1, max_seq_len=320)
    k = torch.randn(3, 301, 2, 64, generator=gen).to(dtype)
    v = torch.randn(3, 301, 2, 64, generator=gen).to(dtype)
    backend.append(cache, backend.plan(cache, num_new=lens), layer=0, k=k, v=v)
    cache.commit(backend.plan(cache, num_new=(0, 0, 0)))
    cache.seq_lens = lens
    q = torch.randn(3, 14, 64, generator=gen).to(dtype)
    nk = torch.randn(3, 2, 64, generator=gen).to(dtype)
    outs = {}
    for isa in ("c-avx2", "c-scalar"):
        cache.isa = isa  # the same pages, the other variant
        plan = backend.plan(cache, num_new=[1, 1, 1])
        plan.splits = splits
        outs[isa] = backend.decode(cache, plan, layer=0, q=q, k=nk, v=nk).float()
    # the variants differ only in fp32 summation order, then the output's rounding to its dtype
    tol = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(outs["c-avx2"], outs["c-scalar"], atol=tol, rtol=tol)
    assert outs["c-avx2"].isfinite().all()


def test_unavailable_without_a_compiler_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        cpu_decode,
        "load_kernel",
        lambda build="native": "no C compiler found (set CC, or install gcc or clang)",
    )
    backend = CpuDecodeBackend()
    assert backend.supports(_workload(torch.bfloat16)) == [
        "no C compiler found (set CC, or install gcc or clang)"
    ]
    assert backend.implementation(_workload(torch.bfloat16)).startswith("unavailable: no C compiler")


def test_refuses_what_it_cannot_run() -> None:
    backend = CpuDecodeBackend()
    odd = dataclasses.replace(GQA.shape, name="odd", head_dim=72, hidden_size=8 * 72)
    assert any("head_dim 72" in r for r in backend.supports(Workload(odd, (4,), torch.float32, "cpu")))


def test_pages_hold_the_documented_layout() -> None:
    """Token t of head h, dim d sits where the module docstring says (16-key tiles, P = 2 for bf16)."""
    if isinstance(load_kernel(), str):
        pytest.skip(str(load_kernel()))
    backend = CpuDecodeBackend()
    for dtype, pair in ((torch.bfloat16, 2), (torch.float32, 1)):
        w = Workload(GQA.shape, (37, 5), dtype, "cpu")
        cache = backend.create_cache(w, config={"page_size": 32}, num_layers=1, max_seq_len=64)
        plan = backend.plan(cache, num_new=[37, 5])
        k = torch.randn(2, 37, 2, 64).to(dtype)
        v = torch.randn(2, 37, 2, 64).to(dtype)
        backend.append(cache, plan, layer=0, k=k, v=v)
        ps, d = 32, 64
        for b, t, h in ((0, 0, 0), (0, 33, 1), (0, 36, 0), (1, 4, 1)):
            page = int(cache.block_table[b, t // ps])
            slot = t % ps
            tile = cache.pages[0, page, h, slot // 16]  # [2, 16 · d]: the tile's K, then its V
            j = slot % 16
            kp = tile[0].view(d // pair, 16, pair)[:, j, :]
            vp = tile[1].view(16 // pair, d, pair)[j // pair, :, j % pair]
            assert torch.equal(kp.reshape(d), k[b, t, h]) and torch.equal(vp, v[b, t, h])
        assert sorted(cache.block_table.flatten().tolist()) == list(range(cache.num_pages))
        assert cache.block_table.flatten().tolist() != list(range(cache.num_pages))  # permuted


def test_splits_and_threads_agree() -> None:
    """One thread or two: bit-identical output; one KV split or four: the same up to rounding order."""
    if isinstance(load_kernel(), str):
        pytest.skip(str(load_kernel()))
    gen = torch.Generator().manual_seed(0)
    lens = (300, 17)
    w = Workload(GQA.shape, lens, torch.bfloat16, "cpu")
    backend = CpuDecodeBackend()
    cache = backend.create_cache(w, config={"page_size": 16}, num_layers=1, max_seq_len=320)
    k = torch.randn(2, 300, 2, 64, generator=gen).bfloat16()
    v = torch.randn(2, 300, 2, 64, generator=gen).bfloat16()
    backend.append(cache, backend.plan(cache, num_new=lens), layer=0, k=k, v=v)
    cache.commit(backend.plan(cache, num_new=(0, 0)))
    cache.seq_lens = lens
    q = torch.randn(2, 8, 64, generator=gen).bfloat16()
    nk = torch.randn(2, 2, 64, generator=gen).bfloat16()
    before = torch.get_num_threads()
    outs, merged = {}, {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            plan = backend.plan(cache, num_new=[1, 1])
            for splits in (1, 4):
                plan.splits = splits
                cache.workspace.fill_(float("nan"))  # the splits' partial results go there, and only those
                outs[threads, splits] = backend.decode(cache, plan, layer=0, q=q, k=nk, v=nk)
                merged[threads, splits] = bool(cache.workspace.isfinite().any())
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[1, 1], outs[2, 1]) and torch.equal(outs[1, 4], outs[2, 4])
    # the split path really ran (its output may still equal the unsplit one bit for bit: where P stays
    # fp32, c-avx2 and c-scalar, the two differ by fp32 rounding, far below the output's bf16 step)
    assert merged == {(1, 1): False, (2, 1): False, (1, 4): True, (2, 4): True}
    torch.testing.assert_close(outs[1, 1].float(), outs[1, 4].float(), atol=2e-2, rtol=2e-2)


def test_gate_at_llama_geometry() -> None:
    """llama-3.1-8b's attention (32 query heads over 8 KV heads of 128), the gate at 2k context."""
    if isinstance(load_kernel(), str):
        pytest.skip(str(load_kernel()))
    w = Workload.uniform("llama-3.1-8b", batch=1, context=2048, dtype="bf16")
    result = check(CpuDecodeBackend(), w, config={"page_size": 64}, decode_steps=1, num_layers=1)
    assert result.passed and result.retrieval == 1.0, result.summary()


@pytest.mark.parametrize(
    ("backend", "dtype"),
    [
        (CpuDecodeBackend(), torch.bfloat16),
        (CpuDecodeBackend(), torch.float32),
        (CpuDecodeFp8Backend(), torch.bfloat16),
    ],
    ids=["bf16", "fp32", "fp8"],
)
def test_prefetch_is_result_neutral(backend: CpuDecodeBackend, dtype: torch.dtype) -> None:
    """``result_neutral = ("prefetch",)`` lets tune reuse one prefetch distance's gate verdict for the
    others: every distance must give the same bits (ragged lengths, page ends, 1 and 4 KV splits)."""
    if isinstance(load_kernel(), str):
        pytest.skip(str(load_kernel()))
    assert backend.result_neutral == ("prefetch",)
    (distances,) = [t.choices for t in backend.tunables if t.name == "prefetch"]
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    lens = (301, 17, 64)
    w = Workload(GQA.shape, lens, dtype, "cpu")
    cache = backend.create_cache(w, config={"page_size": 32}, num_layers=1, max_seq_len=320)
    k, v = (torch.randn(3, 301, 2, 64, generator=gen).to(dtype) for _ in range(2))
    backend.append(cache, backend.plan(cache, num_new=lens), layer=0, k=k, v=v)
    cache.commit(backend.plan(cache, num_new=(0, 0, 0)))
    cache.seq_lens = lens
    q = torch.randn(3, 8, 64, generator=gen).to(dtype)
    nk = torch.randn(3, 2, 64, generator=gen).to(dtype)
    for splits in (1, 4):
        outs = []
        for distance in distances:
            cache.prefetch = distance
            plan = backend.plan(cache, num_new=[1, 1, 1])
            plan.splits = splits
            outs.append(backend.decode(cache, plan, layer=0, q=q, k=nk, v=nk))
        assert all(torch.equal(outs[0], o) for o in outs[1:]), (splits, distances)


def test_only_the_backends_tested_for_it_declare_result_neutral_tunables() -> None:
    """A declaration lets tune skip gates: each built-in one needs a test like the one above."""
    declared = {e.name: e.cls.result_neutral for e in load_registry() if e.cls.result_neutral}
    assert declared == {"cpu_decode": ("prefetch",), "cpu_decode_fp8": ("prefetch",)}


@pytest.mark.parametrize(
    ("backend", "dtype"),
    [(CpuDecodeBackend(), torch.bfloat16), (CpuDecodeFp8Backend(), torch.bfloat16)],
    ids=["bf16", "fp8"],
)
def test_kv_splits_and_prefetch_are_cache_neutral(backend: CpuDecodeBackend, dtype: torch.dtype) -> None:
    """``cache_neutral = ("kv_splits", "prefetch")`` lets tune time those on a cache made for another
    value: a cache reconfigured to a config gives the same bits as one made for it, at every step."""
    if isinstance(load_kernel(), str):
        pytest.skip(str(load_kernel()))
    assert backend.cache_neutral == ("kv_splits", "prefetch")
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    lens = (301, 17, 64)
    w = Workload(GQA.shape, lens, dtype, "cpu")
    k, v = (torch.randn(3, 301, 2, 64, generator=gen).to(dtype) for _ in range(2))
    steps = [[torch.randn(3, h, 64, generator=gen).to(dtype) for h in (8, 2, 2)] for _ in range(3)]

    def run(cache: Any) -> list[torch.Tensor]:
        backend.append(cache, backend.plan(cache, num_new=lens), layer=0, k=k, v=v)
        cache.commit(backend.plan(cache, num_new=(0, 0, 0)))
        cache.seq_lens = lens
        outs = []
        for q, nk, nv in steps:
            plan = backend.plan(cache, num_new=[1, 1, 1])
            outs.append(backend.decode(cache, plan, layer=0, q=q, k=nk, v=nv))
            cache.commit(plan)
        return outs

    made = {"page_size": 32, "kv_splits": 1, "prefetch": 0}
    for target in ({"page_size": 32, "kv_splits": 4, "prefetch": 8}, {"page_size": 32, "kv_splits": "auto"}):
        reused = backend.create_cache(w, config=made, num_layers=1, max_seq_len=320)
        backend.reconfigure_cache(reused, target)
        own = backend.create_cache(w, config=target, num_layers=1, max_seq_len=320)
        assert reused.config == own.config
        assert all(torch.equal(a, b) for a, b in zip(run(reused), run(own), strict=True)), target


def test_only_the_backends_tested_for_it_declare_cache_neutral_tunables() -> None:
    """A declaration lets tune time a config on another's cache: each built-in one needs a test like
    the one above."""
    declared = {e.name: e.cls.cache_neutral for e in load_registry() if e.cls.cache_neutral}
    assert declared == {"cpu_decode": ("kv_splits", "prefetch"), "cpu_decode_fp8": ("kv_splits", "prefetch")}


@pytest.fixture
def two_threads():  # type: ignore[no-untyped-def]
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("two_threads")
def test_a_forced_kv_split_that_auto_runs_anyway_is_auto_and_searched_once() -> None:
    """At batch × KV heads ≥ the threads ``auto`` runs one split: ``kv_splits=1`` is the same computation,
    so the tuner's space holds ``auto`` and 4 (not 1), and a table's ``kv_splits=1`` maps to ``auto``; where
    ``auto`` splits (one sequence, one KV head, two threads), 1 is a computation of its own."""
    from attnbench.core.shapes import load_shape
    from attnbench.tuning import backend_refs, build_space
    from attnbench.tuning.space import Candidate

    backend = CpuDecodeBackend()
    llama = Workload.uniform("llama-3.1-8b", batch=1, context=4096, dtype="bf16")  # 1 × 8 KV heads ≥ 2
    (splits,) = (t for t in backend.tunables_for(llama) if t.name == "kv_splits")
    assert splits.choices == ("auto", 4)
    assert backend.canonical_config(llama, {"kv_splits": 1, "page_size": 512})["kv_splits"] == "auto"
    assert backend.canonical_config(llama, {"kv_splits": 4})["kv_splits"] == 4
    space = build_space(llama, backend_refs(only=["cpu_decode"]))
    one = Candidate("cpu_decode", {"kv_splits": 1, "page_size": 512, "prefetch": 4})
    assert space.canonical(one) in space.candidates()
    assert one not in space.candidates()
    shape = dataclasses.replace(load_shape("tiny-gqa"), num_kv_heads=1, num_heads=4)
    lone = Workload(shape, (4096,), "bf16")  # one sequence, one KV head: auto splits it
    (splits,) = (t for t in backend.tunables_for(lone) if t.name == "kv_splits")
    assert 1 in splits.choices and backend.canonical_config(lone, {"kv_splits": 1})["kv_splits"] == 1
