"""Ahead-of-time compilation of Triton kernels for NVIDIA targets on a CPU-only machine.

The interpreter accepts programs that the GPU compiler rejects, so every kernel of every Triton backend
is also compiled here for sm_80 and sm_90, for each tile configuration it declares.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import triton
import triton.language as tl

from attnbench.triton_utils import aot_compile, kernel_for, triton_mode

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


def test_triton_mode_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_mode("cpu") == ("interpreted", "")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    mode, reason = triton_mode("cpu")
    assert mode is None and "TRITON_INTERPRET=1" in reason
    mode, reason = triton_mode("meta")
    assert mode is None and "'meta'" in reason
    if not torch.cuda.is_available():
        mode, reason = triton_mode("cuda")
        assert mode is None and "CUDA" in reason


def test_kernel_for_runs_interpreted_whatever_the_import_mode() -> None:
    x = torch.randn(100)
    y = torch.empty(100)
    kernel_for(_scale_kernel, "interpreted")[(4,)](x, y, 100, BLOCK=32)
    torch.testing.assert_close(y, 2 * x)


@pytest.mark.parametrize("arch", ARCHS)
def test_aot_compile_reads_registers_and_sass(arch: int) -> None:
    sig = {"x_ptr": "*bf16", "y_ptr": "*bf16", "n": "i32", "BLOCK": "constexpr"}
    r = aot_compile(
        _scale_kernel, signature=sig, constexprs={"BLOCK": 1024}, arch=arch, aligned=("x_ptr", "y_ptr", "n")
    )
    assert r.cubin and ".target sm_" in r.ptx
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
    with pytest.raises(Exception, match="16"):  # tl.dot needs every dimension ≥ 16
        aot_compile(_small_dot_kernel, signature=sig, constexprs={"N": 8}, arch=90)


def test_aot_compile_names_bad_arguments() -> None:
    with pytest.raises(ValueError, match="no argument"):
        aot_compile(_scale_kernel, signature={"z": "i32"}, constexprs={})
    with pytest.raises(ValueError, match="lacks"):
        aot_compile(_scale_kernel, signature={"x_ptr": "*fp32"}, constexprs={})
