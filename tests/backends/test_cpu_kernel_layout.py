"""The kernel's argument structs (``cpu_decode_attend_args``, ``cpu_decode_write_args``) against their ctypes
Structures: the real ones match in every build, a Structure that differs is refused by the layout check
naming the struct and the field (its C and ctypes offsets) or the sizes, and ``load_kernel`` refuses a
library whose structs differ with that reason instead of calling it with a wrong layout."""

from __future__ import annotations

import ctypes
import types
from collections.abc import Iterator
from typing import Any

import pytest
from helpers.cpu_kernel import require_kernel

from attnbench.backends import cpu_kernel
from attnbench.backends.cpu_kernel import AttendArgs, WriteArgs, check_layout


def _variant_of(
    base: type[AttendArgs | WriteArgs], *, retype: str | None = None, drop_last: bool = False
) -> type[ctypes.Structure]:
    """``base``'s fields with ``retype`` made a c_int64 (or the last one dropped), under the same C name: a
    Structure as a wrong edit of cpu_kernel.py would leave it."""
    fields = [(name, ctypes.c_int64 if name == retype else kind) for name, kind in base._fields_]
    attrs = {"c_name": base.c_name, "_fields_": fields[:-1] if drop_last else fields}
    return type("Wrong" + base.__name__, (ctypes.Structure,), attrs)


@pytest.fixture
def fresh_load_kernel() -> Iterator[None]:
    """load_kernel without its per-process cache, before and after (its result depends on the Structures)."""
    cpu_kernel.load_kernel.cache_clear()
    yield
    cpu_kernel.load_kernel.cache_clear()


@pytest.mark.parametrize("build", list(cpu_kernel.BUILDS))
def test_the_real_structs_match_in_every_build(build: str) -> None:
    require_kernel()
    kernel = cpu_kernel.load_kernel(build)
    assert not isinstance(kernel, str), kernel
    for struct_cls in (AttendArgs, WriteArgs):
        assert check_layout(kernel.lib, struct_cls) is None
    assert ctypes.sizeof(AttendArgs) == 9 * 8 + 13 * 4 + 4  # 9 pointers, 13 int32 and a float
    assert ctypes.sizeof(WriteArgs) == 9 * 8 + 10 * 4
    assert kernel.lib.cpu_decode_abi() == cpu_kernel.ABI == 8


@pytest.mark.parametrize(
    ("base", "field"),
    [
        (AttendArgs, "num_seqs"),
        (AttendArgs, "splits"),
        (AttendArgs, "prefetch"),
        (WriteArgs, "pair"),
        (WriteArgs, "isa"),
    ],
)
def test_a_field_of_another_size_is_refused_by_name(base: type[AttendArgs | WriteArgs], field: str) -> None:
    """One int32 field declared c_int64: the message names the struct, that field (not a later one that
    moved with it) and its C and ctypes offsets."""
    kernel = require_kernel()
    wrong = _variant_of(base, retype=field)
    message = check_layout(kernel.lib, wrong)
    assert message is not None
    c_offset, py_offset = getattr(base, field).offset, getattr(wrong, field).offset
    assert message.startswith(f"{base.c_name}: field {field!r} at C offset {c_offset} (4 bytes), ")
    assert f"ctypes offset {py_offset} (8 bytes)" in message


def test_a_missing_field_an_unknown_struct_and_a_size_mismatch_are_named() -> None:
    kernel = require_kernel()
    dropped = check_layout(kernel.lib, _variant_of(AttendArgs, drop_last=True))
    assert dropped == (
        "cpu_decode_attend_args: field 'scale' (C offset 124) has no ctypes field in WrongAttendArgs "
        "(ctypes offset none)"
    )
    assert check_layout(kernel.lib, AttendArgs, c_name="cpu_decode_nothing_args") == (
        "the kernel has no argument struct cpu_decode_nothing_args"
    )
    # every field where ctypes has it, but a C struct 8 bytes longer (tail padding, an alignment attribute)
    real = kernel.lib

    def layout(name: bytes, out: Any, n: int) -> int:
        count = int(real.cpu_decode_args_layout(name, out, n))
        if out is not None and n > 0:
            out[0] += 8
        return count

    def field(name: bytes, i: int) -> bytes:
        return bytes(real.cpu_decode_args_field(name, i))

    longer = types.SimpleNamespace(cpu_decode_args_layout=layout, cpu_decode_args_field=field)
    assert check_layout(longer, WriteArgs) == (  # type: ignore[arg-type]
        "cpu_decode_write_args: size 120 bytes in C, 112 in ctypes (WriteArgs)"
    )


def test_load_kernel_refuses_a_library_whose_struct_differs(
    monkeypatch: pytest.MonkeyPatch, fresh_load_kernel: None
) -> None:
    require_kernel()
    cpu_kernel.load_kernel.cache_clear()
    monkeypatch.setattr(cpu_kernel, "ARG_STRUCTS", (AttendArgs, _variant_of(WriteArgs, retype="max_new")))
    reason = cpu_kernel.load_kernel()
    assert isinstance(reason, str)
    assert (
        "argument struct layout differs from ctypes: cpu_decode_write_args: field 'max_new' at C offset"
        in reason
    )


def test_the_entry_points_refuse_a_null_struct_and_a_shift_without_fp8() -> None:
    kernel = require_kernel()
    assert kernel.lib.cpu_decode_attend(None) == -1
    assert kernel.lib.cpu_decode_write_fp8(None) == -1
    # the shift conversion is c-avx512bf16's over an fp8 cache only: the paged attention refuses it
    isa, convert = cpu_kernel.kernel_isa(cpu_kernel.FP8_SHIFT_CODE)
    assert (isa, convert) == (cpu_kernel.ISA_CODES["c-avx512bf16"], cpu_kernel.FP8_CONVERT_CODES["shift"])
    args = AttendArgs(num_seqs=1, num_q_heads=2, num_kv_heads=1, head_dim=32, page_size=16, splits=1)
    args.isa, args.fp8_convert, args.dtype = (
        isa,
        convert,
        cpu_kernel.DTYPE_CODES[next(iter(cpu_kernel.DTYPE_CODES))],
    )
    assert kernel.lib.cpu_decode_attend(ctypes.byref(args)) == -1
