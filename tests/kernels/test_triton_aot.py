"""Ahead-of-time compilation of Triton kernels for NVIDIA targets on a CPU-only machine.

The interpreter accepts programs that the GPU compiler rejects, so every kernel of every Triton backend
is also compiled here for sm_80 and sm_90, for each tile configuration it declares.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # as tests/conftest.py: the interpreter, chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import triton
import triton.language as tl
from helpers.triton_modes import run_uninterpreted

from attnbench.backends import fp8, mla
from attnbench.backends.triton_paged import AOT_GEOMETRIES, BLOCK_N, PAGE_SIZES
from attnbench.correctness.aot import (
    covering_specializations,
    resident_programs,
    spec_id,
    spill_bytes,
    spills_expected,
)
from attnbench.kernels.triton_utils import (
    AotCompileError,
    AotResult,
    aot_compile,
    aot_compile_many,
    kernel_for,
    language_interpreted,
    triton_mode,
)

ARCHS = (80, 90)


@triton.jit
def _scale_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)


@triton.jit
def _small_dot_kernel(a_ptr, b_ptr, c_ptr, N: tl.constexpr):
    idx = tl.arange(0, N)
    a = tl.load(a_ptr + idx[:, None] * N + idx[None, :])
    b = tl.load(b_ptr + idx[:, None] * N + idx[None, :])
    tl.store(c_ptr + idx[:, None] * N + idx[None, :], tl.dot(a, b))


@pytest.mark.skipif(torch.cuda.is_available(), reason="without CUDA only: the interpreted mode")
def test_triton_mode_here() -> None:
    # this process loaded triton in interpreter mode (conftest / the top of this file)
    assert language_interpreted()
    assert triton_mode("cpu") == ("interpreted", "")
    mode, reason = triton_mode("meta")
    assert mode is None and "'meta'" in reason


_MODE_PROBE = """
import os, sys
from attnbench.kernels.triton_utils import triton_mode
print(repr(triton_mode("cpu")))
import triton.language
os.environ["TRITON_INTERPRET"] = "1"
print(repr(triton_mode("cpu")))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="without CUDA only: the CPU refusal")
def test_triton_mode_reasons_without_the_interpreter() -> None:
    before, after = (eval(line) for line in run_uninterpreted(_MODE_PROBE))
    assert before[0] is None and "set TRITON_INTERPRET=1" in before[1]
    assert after[0] is None and "after triton was imported" in after[1]


def test_kernel_for_runs_interpreted_whatever_the_import_mode() -> None:
    x = torch.randn(100)
    y = torch.empty(100)
    kernel_for(_scale_kernel, "interpreted")[(4,)](x, y, 100, BLOCK=32)
    torch.testing.assert_close(y, 2 * x)


def test_aot_compile_reads_registers_and_sass() -> None:
    sig = {"x_ptr": "*bf16", "y_ptr": "*bf16", "n": "i32", "BLOCK": "constexpr"}
    spec = {
        "kernel": _scale_kernel,
        "signature": sig,
        "constexprs": {"BLOCK": 1024},
        "aligned": ("x_ptr", "y_ptr", "n"),
    }
    for arch, r in zip(ARCHS, aot_compile_many([{**spec, "arch": a} for a in ARCHS]), strict=True):
        assert not isinstance(r, Exception), r
        assert r.cubin and f".target sm_{arch}" in r.ptx
        if r.sass is None:
            pytest.skip(f"SASS not read: {r.tool_note}")
        assert r.registers is not None and 0 < r.registers < 255
        assert r.local_bytes == 0
        # n is a multiple of 16 (hinted), so the masked loads still vectorise to 16 bytes
        assert r.global_loads().get("LDG.E.128", 0) >= 1, r.global_loads()


def test_aot_rejects_what_the_interpreter_accepts() -> None:
    a, b, c = torch.randn(8, 8), torch.randn(8, 8), torch.empty(8, 8)
    kernel_for(_small_dot_kernel, "interpreted")[(1,)](a, b, c, N=8)
    torch.testing.assert_close(c, a @ b, rtol=1e-4, atol=1e-4)
    sig = {"a_ptr": "*fp16", "b_ptr": "*fp16", "c_ptr": "*fp16", "N": "constexpr"}
    with pytest.raises(AotCompileError, match="16"):  # tl.dot needs every dimension ≥ 16
        aot_compile(_small_dot_kernel, signature=sig, constexprs={"N": 8}, arch=90)


def test_aot_compile_names_bad_arguments() -> None:
    with pytest.raises(ValueError, match="no argument"):
        aot_compile(_scale_kernel, signature={"z": "i32"}, constexprs={})
    with pytest.raises(ValueError, match="lacks"):
        aot_compile(_scale_kernel, signature={"x_ptr": "*fp32"}, constexprs={})


# -- the split-KV family: every constexpr value at least once, not the whole product ------------------
_SPECS = list(covering_specializations())
_DECODE = [s["constexprs"] for s in _SPECS if "PAGE_SIZE" in s["constexprs"]]


def test_aot_specializations_cover_every_constexpr_value() -> None:
    def seen(name: str) -> set:
        return {c[name] for c in _DECODE}

    assert seen("PAGE_SIZE") >= set(PAGE_SIZES) and seen("BLOCK_N") >= set(BLOCK_N) | set(fp8.BLOCK_N)
    assert seen("KV_FP8") == seen("LATENT") == {True, False}
    assert seen("DOT_PRECISION") == {"ieee", "tf32"}
    assert {c["BLOCK_G"] for c in _DECODE if c["LATENT"]} == {t.block_h for t in mla.TILES.values()}
    warps = {s["num_warps"] for s in _SPECS}
    assert warps >= {t.num_warps for t in mla.TILES.values()}
    geometries = {(c["GROUP"], c["DK"], c["DV"]) for c in _DECODE if not c["LATENT"] and not c["KV_FP8"]}
    assert geometries >= {(g, dk, dv) for _, g, dk, dv in AOT_GEOMETRIES}
    assert len({spec_id(s) for s in _SPECS}) == len(_SPECS)
    assert any("PAGE_SIZE" not in s["constexprs"] for s in _SPECS)  # the merge
    # each value once, not the product: far fewer than page sizes × tiles × dtypes × forms
    assert len(_SPECS) < len(PAGE_SIZES) * len(BLOCK_N) * 3 * 3 * 2


@pytest.fixture(scope="module")
def family_aot() -> dict:
    """Every specialisation for every arch, compiled in one batch (one child process when interpreted)."""
    keys = [(spec_id(spec), arch) for arch in ARCHS for spec in _SPECS]
    results = aot_compile_many([{**spec, "arch": arch} for arch in ARCHS for spec in _SPECS])
    return dict(zip(keys, results, strict=True))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("spec", _SPECS, ids=[spec_id(s) for s in _SPECS])
def test_aot_compiles_for_nvidia(family_aot: dict, spec: dict, arch: int) -> None:
    r = family_aot[spec_id(spec), arch]
    if isinstance(r, Exception):
        raise r
    assert r.cubin, "no cubin"
    if r.sass is None:
        pytest.skip(f"compiled; SASS not read: {r.tool_note}")
    spilled = spill_bytes(r)  # local memory and the stack frame, where ptxas puts spills
    if spills_expected(spec):  # fp32 FMA dots with fp8 pages / latent rows: known, see the docs
        assert spilled > 0, (
            f"{spec_id(spec)} sm_{arch} no longer spills: update spills_expected() and the docs"
        )
    else:
        assert spilled == 0 and not r.sass_count("STL"), f"{spec_id(spec)} sm_{arch}: {spilled} bytes spilled"
    assert r.registers is not None and r.registers <= 255
    loads = r.global_loads()
    wide = sum(n for op, n in loads.items() if op.endswith(".128"))
    assert wide >= 1, f"{spec_id(spec)} sm_{arch}: no 16-byte global loads: {loads}"
    c = spec["constexprs"]
    if "PAGE_SIZE" in c and not c["LATENT"] and not c["KV_FP8"]:  # K/V tiles stream through cp.async
        assert loads.get("LDGSTS.E.BYPASS.128", 0) >= 2, loads
    if c.get("KV_FP8"):  # the fp8 bytes arrive in 16-byte pieces, never byte by byte
        assert not r.sass_count("LDG.E.U8"), r.summary()


def test_resident_programs_follow_the_occupancy_rules() -> None:
    def compiled(arch: int, warps: int, registers: int | None, shared: int) -> AotResult:
        return AotResult("k", arch, warps, 2, {}, "", b"", shared, registers=registers)

    # registers are allocated 8 per thread at a time: 75 and 80 both take 2,560 per warp, 6 programs
    assert resident_programs(compiled(90, 4, 75, 21504)) == resident_programs(compiled(90, 4, 80, 21504)) == 6
    assert resident_programs(compiled(90, 4, 81, 21504)) == 5  # 88 per thread: 23 warps
    # 8 warps of 192 or 194 registers: one program by registers (two would need 98,304 or more)
    assert (
        resident_programs(compiled(90, 8, 192, 114688))
        == resident_programs(compiled(90, 8, 194, 114688))
        == 1
    )
    # shared memory decides: sm_80 holds one 112,704-byte program, 32 registers or 168
    assert (
        resident_programs(compiled(80, 4, 32, 112704)) == resident_programs(compiled(80, 4, 168, 112704)) == 1
    )
    assert resident_programs(compiled(80, 1, 16, 0)) == 32  # the program limit
    assert resident_programs(compiled(90, 4, None, 0)) is None
