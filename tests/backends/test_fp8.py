"""The ``fp8`` backend: quantisation, the cache, both attention paths, and AOT compilation of its kernels.

The Triton kernel runs here on CPU tensors in the interpreter, so ``TRITON_INTERPRET=1`` is set before
anything imports triton (tests/conftest.py sets it too).
"""

from __future__ import annotations

import os
from typing import ClassVar

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from attnbench.backends.fp8 import BLOCK_N, EXACT_TOLERANCE, FP8Backend
from attnbench.core.shapes import load_shape
from attnbench.core.workload import Workload
from attnbench.correctness.aot import merge_specialization, specialization
from attnbench.correctness.gate import check
from attnbench.kernels.fp8_cache import (
    FP8_MAX,
    FP8KVCache,
    NonFiniteKVError,
    dequantize,
    fp8_bits_to_fp16,
    quantize,
)
from attnbench.kernels.triton_decode import DecodeSpec
from attnbench.kernels.triton_utils import aot_compile_many
from attnbench.testing import CASES, BackendConformance


class FP8TritonBackend(FP8Backend):
    """The same backend with its Triton kernel forced (interpreted on the CPU)."""

    kernel = "triton"


# -- conformance: torch path (what runs on the CPU) and the Triton kernel (interpreted) -----------------
class TestFP8(BackendConformance):
    backend = FP8Backend
    dtypes = ("fp32", "bf16")
    # torch path: num_splits/block_n do not apply; every page size is covered by the gate test below
    configs: ClassVar[list[dict]] = [{}, {"page_size": 16, "scale": "tensor"}, {"page_size": 256}]


#: where the Triton kernel runs in these tests: natively on CUDA, else interpreted on the CPU
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class TestFP8Triton(BackendConformance):
    backend = FP8TritonBackend
    device = TRITON_DEVICE
    dtypes = ("bf16",)  # fp32 (IEEE dots): test_torch_and_triton_paths_agree; the interpreter is slow
    configs: ClassVar[list[dict]] = [
        {},  # page 64, auto splits, block 32
        {"page_size": 16, "num_splits": 1, "block_n": 64, "scale": "tensor"},  # tile spans 4 pages, direct
        {"page_size": 32, "num_splits": 4, "block_n": 32},
    ]


# -- quantisation -------------------------------------------------------------------------------------
def test_byte_trick_is_exact_for_every_finite_fp8_value() -> None:
    q = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    finite = torch.isfinite(q.float())
    assert int(finite.sum()) == 254  # 0x7F and 0xFF are NaN
    got = fp8_bits_to_fp16(q).double() * 256
    torch.testing.assert_close(got[finite], q.double()[finite], rtol=0, atol=0)
    buf = torch.empty(256, dtype=torch.int16)
    assert fp8_bits_to_fp16(q, out=buf).data_ptr() == buf.data_ptr()


def test_token_head_scales_map_each_row_amax_to_448() -> None:
    x = torch.randn(3, 5, 2, 64) * torch.rand(3, 5, 2, 1) * 100
    q, scale, amax = quantize(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (3, 5, 2)
    torch.testing.assert_close(q.float().abs().amax(-1), torch.full((3, 5, 2), FP8_MAX))
    rel = (dequantize(q, scale) - x.double()).abs() / amax.double()[..., None]
    assert float(rel.max()) <= 2**-4 * 1.01  # half an ulp of a 3-bit mantissa, relative to the row's amax


def test_all_zero_rows_are_safe() -> None:
    x = torch.zeros(2, 3, 16)
    x[1, 2] = torch.randn(16)
    q, scale, _ = quantize(x)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    back = dequantize(q, scale)
    assert (back[0] == 0).all() and (back[1, :2] == 0).all()
    assert torch.isfinite(back).all()


def test_static_scale_saturates_instead_of_nan() -> None:
    x = torch.tensor([[1.0, -1000.0, 5000.0, 0.5]])
    q, scale, _ = quantize(x, granularity="tensor", static_scale=1.0)
    assert scale.dim() == 0
    assert q.float().tolist() == [[1.0, -448.0, 448.0, 0.5]]
    with pytest.raises(ValueError, match="static_scale"):
        quantize(x, granularity="tensor", static_scale=0.0)
    with pytest.raises(ValueError, match="granularity 'row'"):
        quantize(x, granularity="row")


# -- the cache ----------------------------------------------------------------------------------------
def _cache(backend: FP8Backend, lens: tuple[int, ...], *, config: dict | None = None, max_seq_len: int = 64):
    w = Workload(load_shape("tiny-gqa"), lens, torch.bfloat16, "cpu")
    cache = backend.create_cache(w, config=config or {"page_size": 16}, num_layers=2, max_seq_len=max_seq_len)
    return w, cache


def test_bytes_per_token_counts_scales_next_to_bf16() -> None:
    shape = load_shape("llama-3.1-8b")
    w = Workload(shape, (1,), torch.bfloat16, "cpu")
    per_token = FP8Backend().create_cache(w, config={}, num_layers=32, max_seq_len=16)
    per_tensor = FP8Backend().create_cache(w, config={"scale": "tensor"}, num_layers=32, max_seq_len=16)
    bf16 = shape.kv_bytes_per_token("bf16")
    assert bf16 == 131072
    assert per_token.bytes_per_token() == 32 * 8 * (2 * 128 + 2 * 4) == 67584  # 0.516 of bf16
    assert per_tensor.bytes_per_token() == 32 * 8 * 2 * 128 == 65536  # 0.5 of bf16
    assert per_token.nbytes() > per_tensor.nbytes()


def test_append_stores_quantised_rows_with_their_scales() -> None:
    backend = FP8Backend()
    _, cache = _cache(backend, (20, 5))
    assert isinstance(cache, FP8KVCache)
    plan = backend.plan(cache, num_new=[20, 5])
    k = torch.randn(2, 20, 2, 16).bfloat16()
    v = torch.randn(2, 20, 2, 16).bfloat16()
    backend.append(cache, plan, layer=1, k=k, v=v)
    cache.commit(plan)
    ref_k, ref_v = backend.reference_kv(k, v, config=cache.config)
    for seq, n in enumerate((20, 5)):
        got_k, got_v = cache.dequantized(1, seq)
        assert torch.equal(got_k, ref_k[seq, :n]) and torch.equal(got_v, ref_v[seq, :n])


def test_prefill_rejects_nan_and_inf_before_storing() -> None:
    backend = FP8Backend()
    _, cache = _cache(backend, (6, 4))
    plan = backend.plan(cache, num_new=[6, 4])
    k = torch.randn(2, 6, 2, 16).bfloat16()
    v = torch.randn(2, 6, 2, 16).bfloat16()
    k_bad = k.clone()
    k_bad[1, 5, 0, 3] = float("nan")  # a padded row of sequence 1 (4 tokens): ignored
    backend.append(cache, plan, layer=0, k=k_bad, v=v)
    v_bad = v.clone()
    v_bad[0, 2, 1, 0] = float("inf")
    before = cache.v_pages.clone()
    with pytest.raises(NonFiniteKVError, match="NaN or inf"):
        backend.append(cache, plan, layer=1, k=k, v=v_bad)
    assert torch.equal(cache.v_pages.view(torch.uint8), before.view(torch.uint8))  # nothing written


def test_decode_flags_nan_without_a_sync_and_commit_raises() -> None:
    backend = FP8Backend()
    _, cache = _cache(backend, (3, 3))
    plan = backend.plan(cache, num_new=[3, 3])
    for layer in range(2):
        backend.append(cache, plan, layer=layer, k=torch.randn(2, 3, 2, 16), v=torch.randn(2, 3, 2, 16))
    cache.commit(plan)
    plan = backend.plan(cache, num_new=[1, 1])
    q = torch.randn(2, 4, 16)
    k = torch.randn(2, 2, 16)
    k[0, 1, 0] = float("nan")
    out = backend.decode(cache, plan, layer=0, q=q, k=k, v=torch.randn(2, 2, 16))
    backend.decode(cache, plan, layer=1, q=q, k=torch.randn(2, 2, 16), v=torch.randn(2, 2, 16))
    assert torch.isfinite(out).all()  # the refused row was stored as zeros, not NaN bytes
    assert cache.nonfinite.tolist() == [True, False]
    with pytest.raises(NonFiniteKVError, match=r"layer\(s\) \[0\]"):
        cache.commit(plan)
    assert torch.isfinite(cache.k_pages.float()).all()


# -- availability and the declared space ---------------------------------------------------------------
def test_paths_and_reasons() -> None:
    w = Workload(load_shape("tiny-gqa"), (8,), torch.bfloat16, "cpu")
    assert FP8Backend().implementation(w).startswith("torch") and not FP8Backend().interpreted(w)
    if not torch.cuda.is_available():
        assert FP8TritonBackend().interpreted(w)  # conftest sets TRITON_INTERPRET=1 before triton loads
    meta = Workload(load_shape("tiny-gqa"), (8,), torch.bfloat16, "meta")
    assert "'meta'" in FP8TritonBackend().supports(meta)[0]
    assert "'meta'" in FP8Backend().supports(meta)[0]
    # fp8 is the cache's format, never the compute dtype: such a workload cannot even be built
    with pytest.raises(ValueError, match="compute dtype must be one of bf16, fp16, fp32"):
        Workload(load_shape("tiny-gqa"), (8,), "fp8", "cpu")


def test_scale_granularity_is_declared_but_never_tuned() -> None:
    w = Workload(load_shape("tiny-gqa"), (8,), torch.bfloat16, "cpu")
    assert "scale" in {t.name for t in FP8Backend.tunables}
    assert [t.name for t in FP8Backend().tunables_for(w)] == ["page_size"]
    assert [t.name for t in FP8TritonBackend().tunables_for(w)] == ["page_size", "num_splits", "block_n"]


@pytest.mark.parametrize("page_size", [16, 32, 64, 128, 256])
def test_every_page_size_passes_the_gate(page_size: int) -> None:
    w = Workload(CASES[1].shape, (300, 1, 77), torch.bfloat16, "cpu")
    r = check(FP8Backend(), w, config={"page_size": page_size})
    assert r.passed, r.summary()
    assert r.stored_error is not None and r.stored_error.rel_l2 < r.error.rel_l2 / 5


def test_torch_and_triton_paths_agree() -> None:
    """Both paths read the same bytes (fp32 workload): they differ by float32 rounding only."""
    w = Workload(CASES[1].shape, (45, 130), torch.float32, TRITON_DEVICE)
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 130, 2, 64, generator=gen), torch.randn(2, 130, 2, 64, generator=gen)
    q, k1, v1 = (torch.randn(*s, generator=gen) for s in ((2, 8, 64), (2, 2, 64), (2, 2, 64)))
    outs = []
    for cls in (FP8Backend, FP8TritonBackend):
        backend = cls()
        cache = backend.create_cache(
            w, config={"page_size": 16, "num_splits": 2}, num_layers=1, max_seq_len=140
        )
        plan = backend.plan(cache, num_new=[45, 130])
        backend.append(cache, plan, layer=0, k=k.to(w.device), v=v.to(w.device))
        cache.commit(plan)
        plan = backend.plan(cache, num_new=[1, 1])
        args = {"q": q.to(w.device), "k": k1.to(w.device), "v": v1.to(w.device)}
        outs.append(backend.decode(cache, plan, layer=0, **args).cpu())
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_declared_exact_bound_is_not_vacuous() -> None:
    """The fp8 bound against exact attention must still reject an output that is O(1) wrong (a dropped
    needle moves it by ~0.3); the kernel's own arithmetic is held to the calibrated stored-K/V bound."""
    assert EXACT_TOLERANCE.rel_l2 <= 0.2 and EXACT_TOLERANCE.min_cosine >= 0.98


# -- ahead-of-time compilation for NVIDIA targets -------------------------------------------------------
#: the family kernel with fp8 pages, for Llama-3.1-8B's geometry: every tile (one split or several is a
#: run-time flag of the same binary); the merge
SPECS = [specialization(DecodeSpec(4, 128, 128, 64, n, kv_fp8=True), torch.bfloat16) for n in BLOCK_N]
SPECS += [merge_specialization(128, torch.bfloat16)]


def _spec_id(spec: dict) -> str:
    c = spec["constexprs"]
    if "BLOCK_N" in c:
        return f"decode-n{c['BLOCK_N']}"
    return "merge"


def test_aot_covers_every_declared_tile() -> None:
    assert {s["constexprs"]["BLOCK_N"] for s in SPECS if "BLOCK_N" in s["constexprs"]} == set(BLOCK_N)


@pytest.fixture(scope="module")
def compiled() -> dict[tuple[int, str], object]:
    """Every specialisation for sm_80 and sm_90, compiled once (in one child process when interpreted)."""
    requests = [{**spec, "arch": arch} for arch in (80, 90) for spec in SPECS]
    results = aot_compile_many(requests)
    return {(r["arch"], _spec_id(r)): res for r, res in zip(requests, results, strict=True)}


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("spec", SPECS, ids=_spec_id)
def test_kernels_compile_ahead_of_time(compiled: dict, arch: int, spec: dict) -> None:
    r = compiled[(arch, _spec_id(spec))]
    if isinstance(r, Exception):
        raise r
    assert r.cubin and f".target sm_{arch}" in r.ptx
    if r.sass is None:
        return  # compiled; cuobjdump not shipped here, so registers/spills are not read
    assert r.local_bytes == 0, f"register spills: {r.summary()}"
    if "BLOCK_N" in spec["constexprs"]:
        # the fp8 bytes arrive in 16-byte pieces (plain or asynchronous copies), not byte by byte
        wide = r.global_loads().get("LDG.E.128", 0) + (r.sass_count("LDGSTS.E.BYPASS.128") or 0)
        assert wide >= 1, r.summary()
        assert not r.sass_count("LDG.E.U8"), r.summary()
