"""The gate's building blocks on their own: the float64 reference and its metrics, the needle
positions and probe slots, what guards a timed run, and the names of the AOT specialisations."""

from __future__ import annotations

import math
import random

import pytest
import torch

from attnbench.backends.naive import NaiveBackend
from attnbench.core.workload import Workload
from attnbench.correctness.aot import covering_specializations, spec_id, specialization, spills_expected
from attnbench.correctness.needles import build_gate_inputs, needle_positions, probe_groups
from attnbench.correctness.reference import compare, reference_decode, reference_prefill
from attnbench.correctness.timed import check_workload, error_multiple_for, plausibility
from attnbench.kernels.triton_decode import DecodeSpec

W = Workload.uniform("tiny-gqa", batch=2, context=16, dtype="fp32")


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One sequence, one query head over its KV head: ``softmax(q kᵀ · scale) v`` in float64."""
    w = torch.softmax((k.double() @ q.double()) * scale, dim=0)
    return w @ v.double()


def test_reference_decode_is_grouped_softmax_attention_over_each_sequences_length() -> None:
    g = W.geometry()
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, g.num_q_heads, g.qk_head_dim, generator=gen)
    k = torch.randn(2, 6, g.num_kv_heads, g.qk_head_dim, generator=gen)
    v = torch.randn(2, 6, g.num_kv_heads, g.v_head_dim, generator=gen)
    out = reference_decode(q, k, v, [6, 3], scale=g.scale)
    assert out.dtype == torch.float64 and out.shape == (2, g.num_q_heads, g.v_head_dim)
    for b, n in ((0, 6), (1, 3)):
        for h in range(g.num_q_heads):
            kv = h // g.group_size
            want = _attention(q[b, h], k[b, :n, kv], v[b, :n, kv], g.scale)
            assert torch.allclose(out[b, h], want)


def test_reference_prefill_is_causal() -> None:
    g = W.geometry()
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, g.num_q_heads, g.qk_head_dim, generator=gen)
    k = torch.randn(1, 4, g.num_kv_heads, g.qk_head_dim, generator=gen)
    v = torch.randn(1, 4, g.num_kv_heads, g.v_head_dim, generator=gen)
    out = reference_prefill(q, k, v, [4], scale=g.scale)
    # the first token attends to itself only: its output is its own value row
    assert torch.allclose(out[0, 0, 0], v[0, 0, 0].double())
    assert torch.allclose(out[0, 3, 0], _attention(q[0, 3, 0], k[0, :, 0], v[0, :, 0], g.scale))


def test_compare_metrics() -> None:
    ref = torch.tensor([3.0, 4.0], dtype=torch.float64)
    same = compare(ref.float(), ref)
    assert same.max_abs == 0 and same.rel_l2 == 0 and same.cosine == pytest.approx(1.0)
    off = compare(torch.tensor([3.0, 5.0]), ref)
    assert off.max_abs == 1.0 and off.rel_l2 == pytest.approx(1 / 5)
    bad = compare(torch.tensor([float("nan"), 4.0]), ref)
    assert bad.nonfinite == 1 and math.isinf(bad.rel_l2)
    with pytest.raises(ValueError, match="shape"):
        compare(torch.zeros(3), ref)


def test_needle_positions_put_the_newest_and_first_tokens_first_and_never_repeat() -> None:
    got = needle_positions(10, previous=True, rng=random.Random(0))
    assert got[:3] == [(9, "newest"), (0, "first"), (8, "previous step")]
    positions = [p for p, _ in got]
    assert len(positions) == len(set(positions)) and all(0 <= p < 10 for p in positions)
    assert (1, "2^1-1") in got and (7, "2^3-1") in got
    assert needle_positions(1, previous=True, rng=random.Random(0)) == [(0, "newest")]


def test_probe_groups_pair_the_query_heads_of_each_kv_head() -> None:
    g = W.geometry()  # tiny-gqa: groups of query heads over each KV head
    groups = probe_groups(g)
    assert {kv for kv, _, _ in groups} == set(range(g.num_kv_heads))
    covered = sorted(h for _, start, end in groups for h in range(start, end))
    assert covered == list(range(g.num_q_heads))
    assert all(end - start == min(2, g.group_size) for _, start, end in groups)


def test_gate_inputs_plant_probes_within_the_history() -> None:
    g = W.geometry()
    inputs = build_gate_inputs(
        g,
        "expanded",
        context_lens=(16, 9),
        num_layers=1,
        decode_steps=2,
        dtype=torch.float32,
        device="cpu",
        generator=torch.Generator().manual_seed(0),
    )
    assert inputs.decode_steps == 2 and inputs.context_lens == (16, 9)
    assert inputs.probes and all(max(p.positions) < 16 + 2 for p in inputs.probes)
    q, k, _ = inputs.steps[0][0]
    assert q.shape == (2, g.num_q_heads, g.qk_head_dim) and k.shape == (2, g.num_kv_heads, g.qk_head_dim)


def test_check_workload_keeps_a_workload_that_fits_and_shrinks_the_batch_first() -> None:
    assert check_workload(W) == W
    big = Workload.uniform("llama-3.1-8b", batch=8, context="32k", dtype="bf16")
    small = check_workload(big, budget_bytes=2**30)
    assert small.context == big.context  # never the context
    assert small.batch < big.batch


def test_plausibility_refuses_a_step_faster_than_the_bandwidth(profile) -> None:
    assert plausibility(kv_bytes=10**9, seconds=1.0, profile=profile) == ""  # 1 GB/s of a stated 10
    why = plausibility(kv_bytes=10**9, seconds=1e-3, profile=profile)  # 1000 GB/s
    assert why.startswith("implausible:") and "read bandwidth" in why
    assert "matmul peak" in plausibility(kv_bytes=0, seconds=1.0, profile=None, flops=1e12, peak_flops=1e9)


def test_error_multiple_for_takes_the_command_lines_multiple_unless_the_backend_declares_its_own() -> None:
    naive = NaiveBackend()
    own = naive.error_multiple(torch.float32, config={})
    assert error_multiple_for(naive, torch.float32, {}, None) == own
    assert error_multiple_for(naive, torch.float32, {}, 7.0) == 7.0


def test_aot_specialisations_are_named_uniquely_and_flag_the_known_spills() -> None:
    paged = specialization(DecodeSpec(group=4, dk=128, dv=128, page_size=16, block_n=32), torch.bfloat16)
    assert spec_id(paged) == "paged-bf16-g4x16-d128x128-page16-n32-w4"
    assert not spills_expected(paged)
    fp8_fp32 = specialization(
        DecodeSpec(group=4, dk=128, dv=128, page_size=16, block_n=32, kv_fp8=True), torch.float32
    )
    assert spills_expected(fp8_fp32)
    ids = [spec_id(r) for r in covering_specializations()]
    assert len(ids) == len(set(ids)) and any(i.startswith("latent-") for i in ids)
