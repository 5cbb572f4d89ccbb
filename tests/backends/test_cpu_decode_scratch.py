"""The ``cpu_decode`` kernel when its scratch memory is refused: every entry point returns an error that
the backends raise as :class:`MemoryError` (never a write through a null pointer), nothing is left
half-done, and the next step is exact.

``cpu_decode_fail_alloc(n)`` makes the kernel's n-th scratch allocation from now fail once, so each
path is taken on purpose, on the variant this CPU runs and on the plain-C one."""

from __future__ import annotations

import pytest
import torch
from helpers.cpu_kernel import require_kernel, scalar

from attnbench.backends.cpu_decode import CpuDecodeBackend
from attnbench.backends.cpu_decode_fp8 import CpuDecodeFp8Backend
from attnbench.backends.cpu_decode_mla import CpuDecodeMLABackend
from attnbench.core.backend import Backend
from attnbench.core.shapes import ModelShape, load_shape
from attnbench.core.workload import Workload

GQA = ModelShape.attention_only("gqa-8-2", num_heads=8, num_kv_heads=2, head_dim=64)
LENS = (40, 23)

BACKENDS: list[tuple[type[Backend], ModelShape, dict[str, int]]] = [
    (CpuDecodeBackend, GQA, {"page_size": 16}),
    (scalar(CpuDecodeBackend, "cpu_decode_scalar"), GQA, {"page_size": 16, "kv_splits": 4}),
    (CpuDecodeFp8Backend, GQA, {"page_size": 16}),
    (scalar(CpuDecodeFp8Backend, "cpu_decode_fp8_scalar"), GQA, {"page_size": 16}),
    (CpuDecodeMLABackend, load_shape("tiny-mla"), {"page_size": 16}),
    (scalar(CpuDecodeMLABackend, "cpu_decode_mla_scalar"), load_shape("tiny-mla"), {"page_size": 16}),
]


def _step(backend: Backend, shape: ModelShape, config: dict[str, int], fail_at: int | None) -> torch.Tensor:
    """Prefill ``LENS`` and decode one token (the same inputs every call); with ``fail_at``, the decode
    is tried first with that allocation refused and must raise MemoryError, then run again."""
    kernel = require_kernel()
    w = Workload(shape, LENS, torch.bfloat16, "cpu")
    reasons = backend.supports(w)
    if reasons:
        pytest.skip(f"{backend.name} does not run here: {'; '.join(reasons)}")
    form = "latent" if shape.is_mla else "expanded"
    g = w.geometry(form)
    gen = torch.Generator().manual_seed(7)
    k = torch.randn(len(LENS), max(LENS), g.num_kv_heads, g.qk_head_dim, generator=gen).bfloat16()
    v = k[..., : g.v_head_dim] if shape.is_mla else torch.randn(k.shape, generator=gen).bfloat16()
    q = torch.randn(len(LENS), g.num_q_heads, g.qk_head_dim, generator=gen).bfloat16()
    nk = torch.randn(len(LENS), g.num_kv_heads, g.qk_head_dim, generator=gen).bfloat16()
    nv = nk[..., : g.v_head_dim] if shape.is_mla else torch.randn(nk.shape, generator=gen).bfloat16()
    cache = backend.create_cache(w, config=config, num_layers=1, max_seq_len=max(LENS) + 4)
    backend.append(cache, backend.plan(cache, num_new=LENS), layer=0, k=k, v=v)
    cache.commit(backend.plan(cache, num_new=(0,) * len(LENS)))
    cache.seq_lens = LENS
    plan = backend.plan(cache, num_new=[1] * len(LENS))
    if fail_at is not None:
        kernel.lib.cpu_decode_fail_alloc(fail_at)
        try:
            with pytest.raises(MemoryError, match=r"could not allocate its scratch memory"):
                backend.decode(cache, plan, layer=0, q=q, k=nk, v=nv)
        finally:
            kernel.lib.cpu_decode_fail_alloc(-1)
    return backend.decode(cache, plan, layer=0, q=q, k=nk, v=nv)


@pytest.mark.parametrize(
    ("backend", "shape", "config"),
    BACKENDS,
    ids=[f"{b.name}-{'-'.join(f'{k}{v}' for k, v in c.items())}" for b, _, c in BACKENDS],
)
def test_a_refused_scratch_allocation_raises_memory_error_then_the_step_is_exact(
    backend: type[Backend], shape: ModelShape, config: dict[str, int], one_thread: None
) -> None:
    clean = _step(backend(), shape, config, None)
    assert torch.isfinite(clean.float()).all()
    # the first allocation of the step: the fp8 writer's row buffer, else the attention's own
    assert torch.equal(_step(backend(), shape, config, 0), clean)


def test_the_fp8_attention_after_its_writer_is_refused_too(one_thread: None) -> None:
    """cpu_decode_fp8's writer takes one allocation; the second is the attention's."""
    clean = _step(CpuDecodeFp8Backend(), GQA, {"page_size": 16}, None)
    assert torch.equal(_step(CpuDecodeFp8Backend(), GQA, {"page_size": 16}, 1), clean)


def test_two_threads_report_a_refusal_in_either_thread() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        clean = _step(CpuDecodeBackend(), GQA, {"page_size": 16}, None)
        for at in (0, 1):  # each of the two threads takes its own scratch: either one may be refused
            assert torch.equal(_step(CpuDecodeBackend(), GQA, {"page_size": 16}, at), clean)
    finally:
        torch.set_num_threads(before)
