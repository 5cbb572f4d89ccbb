"""The shared kernel modules on their own: fp8 quantisation, the split-KV decode family's launch
arithmetic, and one split-KV decode step over a paged cache against float64 attention."""

from __future__ import annotations

import pytest
import torch

from attnbench.core.workload import Workload
from attnbench.correctness.reference import compare, reference_decode
from attnbench.kernels.fp8_cache import (
    FP8_DTYPE,
    FP8_MAX,
    NonFiniteKVError,
    check_finite,
    dequantize,
    fp8_bits_to_fp16,
    quantize,
)
from attnbench.kernels.paged import PagedKVCache
from attnbench.kernels.split_kv import SplitKVPlan, attach_split_kv, decode_split_kv, plan_split_kv
from attnbench.kernels.triton_decode import DecodeSpec, auto_splits, context_bucket, device_programs, pow2


def test_fp8_round_trip_is_within_e4m3_precision() -> None:
    x = torch.randn(3, 4, 16, generator=torch.Generator().manual_seed(0))
    q, scale, amax = quantize(x)
    assert q.dtype == FP8_DTYPE and scale.shape == (3, 4) and torch.equal(amax, x.abs().amax(-1))
    assert torch.allclose(scale, amax / FP8_MAX)
    back = dequantize(q, scale)
    assert back.dtype == torch.float64
    assert float(((back - x.double()).abs() / amax.double()[..., None]).max()) <= 2**-4  # 3 mantissa bits


def test_fp8_rows_with_nan_are_refused_and_stored_as_zeros() -> None:
    x = torch.ones(2, 8)
    x[1, 3] = float("nan")
    q, _, amax = quantize(x)
    assert torch.equal(q[1].float(), torch.zeros(8))
    with pytest.raises(NonFiniteKVError, match="1 of 2 rows"):
        check_finite(amax, what="K")
    check_finite(amax[:1], what="K")  # finite rows pass


def test_fp8_bits_to_fp16_is_exact_for_every_finite_byte() -> None:
    q = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(torch.int8).view(FP8_DTYPE)
    finite = torch.isfinite(q.float())
    got = fp8_bits_to_fp16(q)
    assert got.dtype == torch.float16
    assert torch.equal(got[finite].float(), q.float()[finite] / 256)


def test_split_kv_launch_arithmetic() -> None:
    assert pow2(3) == 16 and pow2(17) == 32 and pow2(3, floor=1) == 4
    assert context_bucket(1, max_seq_len=4096) == 64
    assert context_bucket(100, max_seq_len=4096) == 128
    assert context_bucket(3000, max_seq_len=2048) == 2048
    assert device_programs(torch.device("cpu")) == 8
    # one program per split: doubled while under 8 programs and each split keeps 2 tiles of 16
    assert auto_splits(programs_per_split=1, max_len=1024, block_n=16, programs=8, max_splits=32) == 8
    assert auto_splits(programs_per_split=1, max_len=64, block_n=16, programs=8, max_splits=32) == 2
    assert auto_splits(programs_per_split=8, max_len=1024, block_n=16, programs=8, max_splits=32) == 1
    spec = DecodeSpec(group=4, dk=32, dv=32, page_size=16, block_n=16)
    assert spec.heads_per_program == 16 and spec.head_blocks() == 1


def test_a_split_kv_decode_step_over_pages_matches_float64_attention() -> None:
    w = Workload.uniform("tiny-gqa", batch=2, context=40, dtype="fp32")
    g = w.geometry("expanded")
    cache = PagedKVCache(
        workload=w, geometry=g, config={}, num_layers=1, max_seq_len=64, page_size=16, page_order="random"
    )
    spec = DecodeSpec(group=g.group_size, dk=g.qk_head_dim, dv=g.v_head_dim, page_size=16, block_n=16)
    mode = "native" if torch.cuda.is_available() else "interpreted"
    attach_split_kv(cache, spec=spec, mode=mode, num_splits=2, max_splits=4)
    gen = torch.Generator().manual_seed(1)
    lens = (40, 23)
    k = torch.randn(2, 41, g.num_kv_heads, g.qk_head_dim, generator=gen)
    v = torch.randn(2, 41, g.num_kv_heads, g.v_head_dim, generator=gen)
    prompt = cache.plan_step(lens)
    cache.write(prompt, layer=0, k=k[:, :40], v=v[:, :40])
    cache.commit(prompt)
    plan = plan_split_kv(cache, (1, 1))
    assert isinstance(plan, SplitKVPlan) and plan.bucket == 64 and plan.num_splits == 2
    new_k = torch.stack([k[0, 40], k[1, 23]])[:, None]
    new_v = torch.stack([v[0, 40], v[1, 23]])[:, None]
    cache.write(plan, layer=0, k=new_k, v=new_v)
    q = torch.randn(2, g.num_q_heads, g.qk_head_dim, generator=gen)
    out = decode_split_kv(cache, plan, q=q, k_pages=cache.k_pages[0], v_pages=cache.v_pages[0])
    ref = reference_decode(q, k, v, [41, 24], scale=g.scale)  # the second sequence's new token is row 23
    assert compare(out, ref).rel_l2 < 1e-5
