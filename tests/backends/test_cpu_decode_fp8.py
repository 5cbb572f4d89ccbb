"""``cpu_decode_fp8``: the conformance suite on each variant, the writer against ``quantize``, the variants
against each other, and non-finite K/V.

The AVX-512 variant runs where the CPU has AVX512_BF16 and AVX512_VBMI (elsewhere its cases skip with
that reason); the plain-C variant is forced and runs on every CPU, so CI checks the fp8 arithmetic and
layout wherever it runs. Under ``ATTNBENCH_REQUIRE_CPU_DECODE=1`` a kernel that does not build fails.
"""

from __future__ import annotations

import itertools
import os
from typing import Any, ClassVar

import pytest
import torch
from helpers.cpu_kernel import (
    SPLIT_CONFIGS,
    ScalarConformance,
    amx_emulated,
    require_amx_emulation,
    require_kernel,
    scalar,
)
from helpers.tuning_helpers import planted_registry

from attnbench.backends.cpu_decode_fp8 import CpuDecodeFp8Backend, CpuDecodeFp8Cache, measured_variant
from attnbench.core.backend import ConfigError, Tunable
from attnbench.core.shapes import ModelShape
from attnbench.core.workload import Workload
from attnbench.kernels.fp8_cache import NonFiniteKVError, dequantize, quantize
from attnbench.tables import ResultsTable
from attnbench.testing import CASES, BackendConformance
from attnbench.tuning import TuneOptions, tune


class TestCpuDecodeFp8(BackendConformance):
    """The variant the CPU runs (c-amx where the OS grants AMX, else c-avx512bf16 on an AVX-512 BF16 +
    VBMI CPU; bf16 only)."""

    backend = CpuDecodeFp8Backend
    dtypes = ("bf16",)
    configs: ClassVar[list[dict[str, Any]]] = [CpuDecodeFp8Backend.default_config(), *SPLIT_CONFIGS]


ScalarCpuDecodeFp8 = scalar(CpuDecodeFp8Backend, "cpu_decode_fp8_scalar")


class TestCpuDecodeFp8Scalar(ScalarConformance):
    """The plain-C variant, forced: what runs the fp8 layout on any CPU."""

    backend = ScalarCpuDecodeFp8


EmulatedAmxCpuDecodeFp8 = amx_emulated(CpuDecodeFp8Backend, "cpu_decode_fp8_amx_emulated")


class TestCpuDecodeFp8AmxEmulated(BackendConformance):
    """The AMX variant on the emulated tiles (every CPU with AVX-512 BF16 + VBMI; elsewhere its cases skip
    with that reason): the conformance suite and the gate on pages of 16 to 512 keys, split and not."""

    backend = EmulatedAmxCpuDecodeFp8
    dtypes = ("bf16",)
    configs: ClassVar[list[dict[str, Any]]] = [
        {"page_size": 16, "kv_splits": 4},
        {"page_size": 256, "kv_splits": 4},
        {"page_size": 512, "kv_splits": 1, "prefetch": 0},
    ]
    cases = CASES[:3]

    def _instance_for(
        self, case: Any, dtype: str, lens: tuple[int, ...], config: dict[str, Any] | None = None
    ) -> Any:
        require_amx_emulation()
        return super()._instance_for(case, dtype, lens, config)


GQA = ModelShape.attention_only("gqa-14-2", num_heads=14, num_kv_heads=2, head_dim=64)  # 4 + 3 heads


def _filled(
    backend: CpuDecodeFp8Backend,
    dtype: torch.dtype,
    lens: tuple[int, ...],
    page_size: int,
    gen: Any,
    shape: ModelShape = GQA,
):
    w = Workload(shape, lens, dtype, "cpu")
    cache = backend.create_cache(w, config={"page_size": page_size}, num_layers=1, max_seq_len=max(lens) + 8)
    b, t, hkv, d = len(lens), max(lens), shape.num_kv_heads, shape.head_dim
    # rows of very different magnitudes, a few values in e4m3's subnormal range, and an all-zero row
    k = torch.randn(b, t, hkv, d, generator=gen) * torch.rand(b, t, hkv, 1, generator=gen) * 8
    k[0, 3, 1, :5] = torch.tensor([1e-3, -2e-3, 3e-4, 0.0, 7.0])
    k[0, 4] = 0.0
    v = torch.randn(b, t, hkv, d, generator=gen)
    k, v = k.to(dtype), v.to(dtype)
    backend.append(cache, backend.plan(cache, num_new=lens), layer=0, k=k, v=v)
    cache.commit(backend.plan(cache, num_new=(0,) * b))
    cache.seq_lens = lens
    return cache, k, v


def _writers() -> list[Any]:
    """The plain-C writer (forced), and the AVX-512 one where the CPU runs an AVX-512 fp8 variant."""
    return [
        pytest.param(ScalarCpuDecodeFp8, torch.float32, id="c-scalar-fp32"),
        pytest.param(ScalarCpuDecodeFp8, torch.float16, id="c-scalar-fp16"),
        pytest.param(ScalarCpuDecodeFp8, torch.bfloat16, id="c-scalar-bf16"),
        pytest.param(CpuDecodeFp8Backend, torch.bfloat16, id="best-variant-bf16"),
    ]


def _writer(backend_class: type[CpuDecodeFp8Backend], dtype: torch.dtype) -> CpuDecodeFp8Backend:
    kernel = require_kernel()
    if backend_class is CpuDecodeFp8Backend and kernel.fp8_level < 1:
        pytest.skip("this CPU lacks AVX512_BF16 + AVX512_VBMI: the plain-C writer is the only one here")
    return backend_class()


@pytest.mark.parametrize(("backend_class", "dtype"), _writers())
def test_the_writer_stores_what_quantize_stores(
    backend_class: type[CpuDecodeFp8Backend], dtype: torch.dtype
) -> None:
    """Byte for byte (as values): the C writer's scales and e4m3 rounding are attnbench.kernels.fp8_cache.quantize's."""
    backend = _writer(backend_class, dtype)
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    lens = (301, 17, 64)
    cache, k, v = _filled(backend, dtype, lens, 32, gen)
    assert isinstance(cache, CpuDecodeFp8Cache)
    for b, n in enumerate(lens):
        got_k, got_v = cache.dequantized(0, b, n)
        (kq, ks, _), (vq, vs, _) = quantize(k[b, :n]), quantize(v[b, :n])
        assert torch.equal(got_k, dequantize(kq, ks)) and torch.equal(got_v, dequantize(vq, vs))
    assert cache.bytes_per_token() == 2 * (2 * 64 + 8)
    per_token = backend.kv_bytes_per_token(Workload(GQA, lens, dtype, "cpu"), config={})
    assert per_token == GQA.num_layers * cache.bytes_per_token()  # one layer in this cache


@pytest.mark.parametrize(("backend_class", "dtype"), _writers())
def test_the_writer_rounds_every_bf16_value_as_torch(
    backend_class: type[CpuDecodeFp8Backend], dtype: torch.dtype
) -> None:
    """Every bf16 value in [-448, 448] (e4m3's range), each in a row whose amax is 448, so the scale is
    exactly 1 and the stored byte is the rounding alone: torch's float8_e4m3fn conversion, subnormals,
    ties to even and the largest values included. The values are exact in every compute dtype but fp16,
    whose range and precision cover fewer of them (those it holds are checked)."""
    backend = _writer(backend_class, dtype)
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    values = bits[bits.isfinite() & (bits.abs() <= 448)]
    if dtype == torch.float16:
        values = values[values.to(torch.float16).float() == values]
    per_row = 63  # and a 448 in each row
    rows = -(-values.numel() // per_row)
    padded = torch.cat([values, values.new_zeros(rows * per_row - values.numel())]).view(rows, per_row)
    k = torch.cat([padded, padded.new_full((rows, 1), 448.0)], dim=1)
    # rows as tokens of one sequence with both KV heads, K and V alike (the two layouts' positions)
    tokens = -(-rows // 2)
    k = torch.cat([k, k.new_zeros(2 * tokens - rows, 64)]).view(1, tokens, 2, 64).to(dtype)
    w = Workload(GQA, (tokens,), dtype, "cpu")
    cache = backend.create_cache(w, config={"page_size": 128}, num_layers=1, max_seq_len=tokens)
    backend.append(cache, backend.plan(cache, num_new=(tokens,)), layer=0, k=k, v=k)
    got_k, got_v = cache.dequantized(0, 0, tokens)
    want = k[0].float().to(torch.float8_e4m3fn).double()
    assert torch.equal(got_k, want) and torch.equal(got_v, want)


#: (page_size, kv_splits, GQA group, head_dim): every page size with 1-4 splits, the group sizes 1-8 and
#: head dims 32-128 spread over them (each value at least twice)
VARIANT_CASES = [
    (page, splits, (i * 3) % 8 + 1, (32, 64, 96, 128)[(i + i // 4) % 4])
    for i, (page, splits) in enumerate(itertools.product((16, 64, 128, 256, 512), (1, 2, 3, 4)))
]


@pytest.mark.parametrize(("page_size", "splits", "group", "head_dim"), VARIANT_CASES)
def test_the_variants_agree_on_one_cache(page_size: int, splits: int, group: int, head_dim: int) -> None:
    """c-avx512bf16 (both conversions), c-amx on the emulated tiles (and on real ones where the CPU has
    them) and c-scalar decode the same fp8 pages alike: ragged lengths (pages' ends, a split's end inside
    a page, a one-token sequence), values in e4m3's subnormal range (which the shift conversion reads as
    0). The emulated tiles stop the process on any operand the hardware would refuse (amx_emu.h)."""
    kernel = require_kernel()
    if kernel.fp8_level < 1:
        pytest.skip("this CPU lacks AVX512_BF16 + AVX512_VBMI: only the plain-C variant reads fp8 here")
    require_amx_emulation()
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    shape = ModelShape.attention_only(f"gqa-{group}", num_heads=2 * group, num_kv_heads=2, head_dim=head_dim)
    lens = (2 * page_size + 37, 17, page_size + 64, 1)
    backend = CpuDecodeFp8Backend()
    cache, _, _ = _filled(backend, torch.bfloat16, lens, page_size, gen, shape=shape)
    q = torch.randn(len(lens), 2 * group, head_dim, generator=gen).to(torch.bfloat16)
    nk = torch.randn(len(lens), 2, head_dim, generator=gen).to(torch.bfloat16)
    runs: list[tuple[str, CpuDecodeFp8Backend, str, str]] = [
        ("c-avx512bf16:lookup", backend, "c-avx512bf16", "lookup"),
        ("c-avx512bf16:shift", backend, "c-avx512bf16", "shift"),
        ("c-amx:emulated", EmulatedAmxCpuDecodeFp8(), "c-amx", "lookup"),
        ("c-scalar", ScalarCpuDecodeFp8(), "c-scalar", "shift"),
    ]
    if kernel.fp8_level >= 2:
        runs.insert(0, ("c-amx", backend, "c-amx", "lookup"))
    outs = {}
    for name, runner, isa, convert in runs:
        cache.isa, cache.convert = isa, convert
        plan = runner.plan(cache, num_new=[1] * len(lens))
        plan.splits = splits
        outs[name] = runner.decode(cache, plan, layer=0, q=q, k=nk, v=nk).float()
    # the AVX-512 and AMX variants round p · v_scale to bf16 for the dot product; all round the output
    for name, *_ in runs[:-1]:
        torch.testing.assert_close(outs[name], outs["c-scalar"], atol=2e-2, rtol=2e-2, msg=name)
    # the same bf16 products (the shift's scaled by powers of two, its e4m3 subnormals read as 0; AMX's
    # summed in another order)
    for name in ("c-avx512bf16:shift", "c-amx:emulated", "c-amx"):
        if name in outs:
            torch.testing.assert_close(
                outs[name], outs["c-avx512bf16:lookup"], atol=1e-2, rtol=1e-2, msg=name
            )


def test_non_finite_kv_are_refused_by_name_and_stored_as_zeros() -> None:
    require_kernel()
    backend = ScalarCpuDecodeFp8()
    w = Workload(GQA, (5,), torch.float32, "cpu")
    cache = backend.create_cache(w, config={"page_size": 16}, num_layers=1, max_seq_len=16)
    k = torch.randn(1, 5, 2, 64)
    v = torch.randn(1, 5, 2, 64)
    k[0, 2, 1, 7] = float("nan")
    v[0, 4, 0, 0] = float("inf")
    with pytest.raises(NonFiniteKVError, match=r"cpu_decode_fp8_scalar.*layer 0: 2 K/V rows hold NaN or inf"):
        backend.append(cache, backend.plan(cache, num_new=(5,)), layer=0, k=k, v=v)
    got_k, got_v = cache.dequantized(0, 0, 5)
    assert torch.equal(got_k[2, 1], torch.zeros(64, dtype=torch.float64))
    assert torch.equal(got_v[4, 0], torch.zeros(64, dtype=torch.float64))
    assert torch.isfinite(got_k).all() and torch.isfinite(got_v).all()


def test_unsupported_shapes_and_devices_say_why() -> None:
    kernel = require_kernel()
    odd = ModelShape.attention_only("d80", num_heads=4, num_kv_heads=1, head_dim=80)
    reasons = CpuDecodeFp8Backend().supports(Workload(odd, (8,), torch.bfloat16, "cpu"))
    assert any("head_dim 80 must be a multiple of 32" in r for r in reasons), reasons
    reasons = CpuDecodeFp8Backend().supports(Workload(GQA, (8,), torch.bfloat16, "meta"))
    assert any("runs on the cpu only" in r for r in reasons), reasons
    if kernel.fp8_level < 1:
        reasons = CpuDecodeFp8Backend().supports(Workload(GQA, (8,), torch.bfloat16, "cpu"))
        assert reasons and "AVX512_BF16 and AVX512_VBMI" in reasons[0], reasons
    fp32 = CpuDecodeFp8Backend().supports(Workload(GQA, (8,), torch.float32, "cpu"))
    assert fp32, "the AVX-512 fp8 variant computes in bf16 only"
    assert CpuDecodeFp8Backend.lossy == "fp8 e4m3 K/V"


class Avx512CpuDecodeFp8(CpuDecodeFp8Backend):
    name = "cpu_decode_fp8_avx512"
    force_isa = "c-avx512bf16"


class TestCpuDecodeFp8Avx512(BackendConformance):
    """The AVX-512 BF16 variant forced where AMX would run (it runs where AMX is not granted), with
    each conversion (the default, shift, runs in TestCpuDecodeFp8 where AMX is not granted)."""

    backend = Avx512CpuDecodeFp8
    dtypes = ("bf16",)
    configs: ClassVar[list[dict[str, Any]]] = [
        {"page_size": 32, "kv_splits": 4, "convert": "shift"},
        {"page_size": 32, "kv_splits": 4, "convert": "lookup"},
    ]
    cases = CASES[:3]

    def _instance_for(
        self, case: Any, dtype: str, lens: tuple[int, ...], config: dict[str, Any] | None = None
    ) -> Any:
        kernel = require_kernel()
        if kernel.fp8_level < 1:
            pytest.skip("this CPU lacks AVX512_BF16 + AVX512_VBMI")
        return super()._instance_for(case, dtype, lens, config)


# -- the variant as a tunable ---------------------------------------------------------------------------
class EmulatedTilesCpuDecodeFp8(CpuDecodeFp8Backend):
    """The fp8 backend on the amx-emulated build, nothing forced: what an AMX CPU offers the tuner (AMX
    tiles granted), with one choice for every tunable but ``isa`` so that a tune is two trials."""

    name = "cpu_decode_fp8_emulated_tiles"
    kernel_build = "amx-emulated"
    tunables: ClassVar[tuple[Tunable, ...]] = tuple(
        t if t.name == "isa" else Tunable(t.name, (t.default,), t.default, t.doc)
        for t in CpuDecodeFp8Backend.tunables
    )


def test_isa_auto_runs_the_variant_measured_fastest_and_a_tune_offers_the_others() -> None:
    require_amx_emulation()
    w = Workload(GQA, (40,), torch.bfloat16, "cpu")
    backend = EmulatedTilesCpuDecodeFp8()
    # where AMX is granted (here: emulated) auto is still c-avx512bf16: measured faster on AMX Xeons
    assert measured_variant(require_amx_emulation()).variant == "c-avx512bf16"  # type: ignore[union-attr]
    assert backend.implementation(w) == "cpu_decode.c[c-avx512bf16, fp8 e4m3 K/V]"
    (isa,) = (t for t in backend.tunables_for(w) if t.name == "isa")
    assert isa.choices == ("auto", "c-amx") and isa.default == "auto"
    for config, variant in (({}, "c-avx512bf16"), ({"isa": "c-amx"}, "c-amx")):
        cache = backend.create_cache(w, config=config, num_layers=1, max_seq_len=48)
        assert cache.isa == variant
    # a group of 32 query heads per KV head is past the AMX item's 16: refused by name, not offered
    wide = Workload(
        ModelShape.attention_only("g32", num_heads=32, num_kv_heads=1, head_dim=64),
        (8,),
        torch.bfloat16,
        "cpu",
    )
    res = backend.resolve(wide, {"isa": "c-amx"})
    assert not res.runnable and "GQA groups up to 16" in res.reasons[0], res.reasons
    assert all(t.name != "isa" for t in backend.tunables_for(wide))


def test_isa_names_what_this_cpu_lacks() -> None:
    kernel = require_kernel()
    w = Workload(GQA, (40,), torch.bfloat16, "cpu")
    if kernel.fp8_level >= 2:
        pytest.skip("this CPU has AMX tiles: every isa choice runs here")
    res = CpuDecodeFp8Backend().resolve(w, {"isa": "c-amx"})
    assert not res.runnable, res
    assert res.reasons[0] in (
        "isa c-amx needs AMX-BF16 tiles granted by the OS; this CPU has none",
        "isa c-amx needs AVX512_BF16 and AVX512_VBMI, which this CPU lacks",
    )
    with pytest.raises(ValueError, match="isa c-amx needs"):
        CpuDecodeFp8Backend().create_cache(w, config={"isa": "c-amx"}, num_layers=1, max_seq_len=48)
    with pytest.raises(ConfigError, match=r"isa = 'avx9' not in \('auto', 'c-avx512bf16', 'c-amx'\)"):
        CpuDecodeFp8Backend.resolve_config({"isa": "avx9"})


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_a_tune_measures_each_variant_and_the_table_records_the_winner(tmp_path: Any, profile: Any) -> None:
    """The tuner measures both variants the (emulated) AMX CPU runs; the emulated tiles are plain C, many
    times slower than c-avx512bf16, so the faster is plain and the table must name it."""
    require_amx_emulation()
    w = Workload(GQA, (256,), torch.bfloat16, "cpu")
    reg = planted_registry(EmulatedTilesCpuDecodeFp8)
    options = TuneOptions(timeout_s=120.0, warmup=1, repeats=3, allow_lossy=True)
    report = tune([w], registry=reg, results_dir=tmp_path, options=options, profile=profile, samples=7)
    (entry,) = report.entries.values()
    tried = sorted(c["config"]["isa"] for c in entry["candidates"] if c.get("step_ms"))
    assert tried == ["auto", "c-amx"], entry["candidates"]
    assert entry["winner"]["config"]["isa"] == "auto", entry
    on_disk = ResultsTable.load(report.table_path, fingerprint=profile.fingerprint)
    assert next(iter(on_disk.entries.values()))["winner"]["config"]["isa"] == "auto"
