"""``cpu_decode_mla``: the conformance suite on each variant (MLA shapes whose latent rows the bf16
variants take), the variants against each other and the ``mla`` torch path, and DeepSeek-V3's
hand-written decoder.

The variant the CPU runs is AMX where the CPU has AMX-BF16 and the OS grants it, else AVX-512 BF16
where the CPU has it (elsewhere its cases skip with that reason); both bf16 variants are checked against
the plain-C one and the torch path wherever the CPU runs them (the AVX-512 BF16 one is forced on an AMX
CPU); the plain-C variant is forced and runs on every CPU. Under ``ATTNBENCH_REQUIRE_CPU_DECODE=1`` a
kernel that does not build fails.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, ClassVar

import pytest
import torch
from helpers.cpu_kernel import amx_emulated, require_amx_emulation, require_kernel, scalar

from attnbench.backends.cpu_decode_mla import CpuDecodeMLABackend
from attnbench.backends.cpu_kernel import ISA_CODES, ISA_NAMES
from attnbench.backends.mla import MLABackend
from attnbench.core.shapes import load_shape
from attnbench.core.workload import Workload
from attnbench.correctness.gate import check
from attnbench.testing import CASES, BackendConformance, ConformanceCase

TINY_MLA = load_shape("tiny-mla")
#: tiny-mla with a latent row of 96 (rank 64 + rope 32: the bf16 variants' tiles), 20 heads (a partial block)
MLA96 = dataclasses.replace(
    TINY_MLA, name="tiny-mla-96", num_heads=20, kv_lora_rank=64, qk_rope_head_dim=32, head_dim=48
)
#: a latent row of 64 with rank 48 (Dv % 32 == 16: the last V chunk is half a vector) and 16 heads
MLA64 = dataclasses.replace(
    TINY_MLA, name="tiny-mla-64", num_heads=16, kv_lora_rank=48, qk_rope_head_dim=16, head_dim=32
)
BF16_CASES = (
    *(c for c in CASES if c.shape.is_mla),
    ConformanceCase("mla-96", MLA96, (9, 21, 2), (64, 131)),
    ConformanceCase("mla-64", MLA64, (33, 1), (130, 7)),
)
BF16_LONG = (ConformanceCase("long-mla-96", MLA96, (), (5003, 777), decode_steps=2),)


class TestCpuDecodeMLA(BackendConformance):
    """The variant the CPU runs: c-amx (bf16) where AMX is granted, else c-avx512bf16 where the CPU has
    AVX-512 BF16; elsewhere every case says why."""

    backend = CpuDecodeMLABackend
    dtypes = ("bf16",)
    cases = BF16_CASES
    long_cases = BF16_LONG
    configs: ClassVar[list[dict[str, Any]]] = [
        CpuDecodeMLABackend.default_config(),
        {"page_size": 16, "kv_splits": 4},
        {"page_size": 128, "kv_splits": 1},
    ]

    def test_supports_some_case(self) -> None:
        """With a bf16 variant on this CPU, the conformance rule; without one, no case runs and each one
        says why."""
        if require_kernel().isa >= ISA_CODES["c-avx512bf16"]:
            return super().test_supports_some_case()
        for c in self._cases():
            res = CpuDecodeMLABackend().resolve(Workload(c.shape, c.prompt_lens, torch.bfloat16, self.device))
            assert not res.runnable and any("AVX-512 BF16" in r for r in res.reasons), (c.id, res.reasons)
        return None


ScalarCpuDecodeMLA = scalar(CpuDecodeMLABackend, "cpu_decode_mla_scalar")


class TestCpuDecodeMLAScalar(BackendConformance):
    """The plain-C latent variant, forced: every CPU, every dtype."""

    backend = ScalarCpuDecodeMLA
    dtypes = ("fp32", "bf16")
    cases = BF16_CASES[:2]
    long_cases = ()
    configs: ClassVar[list[dict[str, Any]]] = [{"page_size": 16, "kv_splits": 2}]


EmulatedAmxCpuDecodeMLA = amx_emulated(CpuDecodeMLABackend, "cpu_decode_mla_amx_emulated")


class TestCpuDecodeMLAAmxEmulated(BackendConformance):
    """The AMX latent item on the emulated tiles (every CPU with AVX-512 BF16 + VBMI; elsewhere its cases
    skip with that reason)."""

    backend = EmulatedAmxCpuDecodeMLA
    dtypes = ("bf16",)
    cases = BF16_CASES[-2:]  # latent rows of 96 and 64: AMX tiles take 32 dims at a time (tiny-mla's is 24)
    long_cases = ()
    configs: ClassVar[list[dict[str, Any]]] = [
        {"page_size": 16, "kv_splits": 4},
        {"page_size": 128, "kv_splits": 1},
    ]

    def _instance_for(
        self, case: Any, dtype: str, lens: tuple[int, ...], config: dict[str, Any] | None = None
    ) -> Any:
        require_amx_emulation()
        return super()._instance_for(case, dtype, lens, config)


def _forced(variant: str) -> type[CpuDecodeMLABackend]:
    if variant == "c-amx:emulated":
        return EmulatedAmxCpuDecodeMLA
    return type(f"CpuDecodeMLA_{variant}", (CpuDecodeMLABackend,), {"force_isa": variant})


@pytest.mark.parametrize("variant", ["c-amx", "c-amx:emulated", "c-avx512bf16"])
@pytest.mark.parametrize("page_size", [16, 64, 128])
def test_each_bf16_variant_agrees_with_scalar_and_the_mla_torch_path(variant: str, page_size: int) -> None:
    """Three implementations of the same latent attention over one ragged batch: the bf16 variant
    (forced; AMX also on the emulated tiles), the plain-C one and the torch path."""
    kernel = require_kernel()
    if variant == "c-amx" and kernel.fp8_level < 2:
        pytest.skip("AMX-BF16 is not available (or not granted) on this CPU (c-amx:emulated runs its item)")
    if variant == "c-amx:emulated":
        require_amx_emulation()
    if kernel.isa < ISA_CODES["c-avx512bf16"]:
        pytest.skip(f"this CPU has no AVX-512 BF16 (it runs {ISA_NAMES[kernel.isa]})")
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    lens = (300, 17, 129)
    w = Workload(MLA96, lens, torch.bfloat16, "cpu")
    g = w.geometry("latent")
    rows = torch.randn(3, max(lens), 1, g.qk_head_dim, generator=gen).to(torch.bfloat16)
    q = torch.randn(3, g.num_q_heads, g.qk_head_dim, generator=gen).to(torch.bfloat16)
    new = torch.randn(3, 1, g.qk_head_dim, generator=gen).to(torch.bfloat16)
    outs = {}
    for name, backend, config in (
        ("bf16", _forced(variant)(), {"page_size": page_size}),
        ("scalar", ScalarCpuDecodeMLA(), {"page_size": page_size}),
        ("torch", MLABackend(), {"page_size": page_size, "kernel": "torch"}),
    ):
        cache = backend.create_cache(w, config=config, num_layers=1, max_seq_len=max(lens) + 4)
        backend.append(cache, backend.plan(cache, num_new=lens), layer=0, k=rows, v=rows[..., : g.v_head_dim])
        cache.commit(backend.plan(cache, num_new=(0, 0, 0)))
        cache.seq_lens = lens
        plan = backend.plan(cache, num_new=[1, 1, 1])
        outs[name] = backend.decode(cache, plan, layer=0, q=q, k=new, v=new[..., : g.v_head_dim]).float()
    for other in ("scalar", "torch"):
        torch.testing.assert_close(outs["bf16"], outs[other], atol=3e-2, rtol=3e-2)


def test_unsupported_workloads_say_why() -> None:
    require_kernel()
    llama = Workload.uniform("llama-3.1-8b", batch=1, context=64, dtype="bf16")
    assert "not MLA" in "; ".join(CpuDecodeMLABackend().resolve(llama).reasons)
    fp32 = Workload(MLA96, (8,), torch.float32, "cpu")
    reasons = CpuDecodeMLABackend().resolve(fp32).reasons
    assert reasons and "bf16" in reasons[0], reasons
    assert not ScalarCpuDecodeMLA().resolve(fp32).reasons


def test_plain_c_passes_the_fp32_gate_at_deepseek_v3_rows() -> None:
    """DeepSeek-V3's 576-wide latent rows in fp32 on the plain-C variant, a short context, five seeds:
    with one running sum per score it failed the gate's max_abs at 7 of 18 such runs (its scores
    drifted several ulps from a vector unit's); with 16 partial sums and p·v added once per tile, none."""
    require_kernel()
    w = Workload.uniform("deepseek-v3", batch=1, context=16, dtype="fp32")
    for seed in range(5):
        result = check(ScalarCpuDecodeMLA(), w, decode_steps=1, num_layers=1, seed=seed)
        assert result.passed and result.retrieval == 1.0, result.summary()


def test_isa_offers_every_variant_this_cpu_runs_and_names_what_it_lacks() -> None:
    """Where AMX is granted (here on the emulated tiles) auto is c-amx and the tuner is offered
    c-avx512bf16 too; a row that is no multiple of 32, or a CPU without AMX, is refused c-amx by name."""
    kernel = require_kernel()
    require_amx_emulation()
    tiles = type(
        "EmulatedTiles", (CpuDecodeMLABackend,), {"name": "mla_tiles", "kernel_build": "amx-emulated"}
    )()
    w = Workload(MLA96, (40,), torch.bfloat16, "cpu")
    res = tiles.resolve(w)
    (isa,) = (t for t in res.tunables if t.name == "isa")
    assert res.implementation == "cpu_decode.c[c-amx, MLA latent]" and isa.choices == ("auto", "c-avx512bf16")
    for config, variant in (({}, "c-amx"), ({"isa": "c-avx512bf16"}, "c-avx512bf16")):
        assert tiles.create_cache(w, config=config, num_layers=1, max_seq_len=48).isa == variant
    narrow = Workload(TINY_MLA, (8,), torch.bfloat16, "cpu")  # a latent row of 24
    refused = tiles.resolve(narrow, {"isa": "c-amx"})
    assert not refused.runnable and "multiple of 32" in refused.reasons[0], refused.reasons
    if kernel.fp8_level < 2:
        native = CpuDecodeMLABackend().resolve(w, {"isa": "c-amx"})
        assert native.reasons == ("isa c-amx needs AMX-BF16 tiles granted by the OS; this CPU has none",)
        assert all(t.name != "isa" for t in CpuDecodeMLABackend().resolve(w).tunables)
