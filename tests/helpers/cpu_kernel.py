"""Shared by the tests of the ``cpu_decode`` kernel's backends: the kernel (or a skip), a backend forced
to its plain-C variant or to its AMX variant on the emulated tiles, and the conformance suite's settings
for the plain-C variant."""

from __future__ import annotations

import os
from typing import Any, ClassVar, TypeVar, cast

import pytest

from attnbench.backends.cpu_kernel import Kernel, load_kernel
from attnbench.core.backend import Backend
from attnbench.testing import CASES, BackendConformance

B = TypeVar("B", bound=type[Backend])

#: the configs the suite runs besides the default: 16-token pages in four KV splits, 32 without prefetch
SPLIT_CONFIGS: list[dict[str, Any]] = [
    {"page_size": 16, "kv_splits": 4},
    {"page_size": 32, "kv_splits": 1, "prefetch": 0},
]


def require_kernel() -> Kernel:
    """The compiled kernel; where it does not build, the test skips with the reason (fails under
    ``ATTNBENCH_REQUIRE_CPU_DECODE=1``, as in CI)."""
    kernel = load_kernel()
    if isinstance(kernel, str):
        if os.environ.get("ATTNBENCH_REQUIRE_CPU_DECODE") == "1":
            pytest.fail(kernel)
        pytest.skip(kernel)
    return kernel


def require_amx_emulation() -> Kernel:
    """The ``amx-emulated`` build (the AMX items on plain-C tiles, ``csrc/amx_emu.h``); where this CPU lacks
    the AVX-512 BF16 + VBMI those items use besides their tiles, the test skips with that reason (a
    build failure fails under ``ATTNBENCH_REQUIRE_CPU_DECODE=1``, as in CI)."""
    kernel = load_kernel("amx-emulated")
    if isinstance(kernel, str):
        if os.environ.get("ATTNBENCH_REQUIRE_CPU_DECODE") == "1":
            pytest.fail(kernel)
        pytest.skip(kernel)
    if kernel.fp8_level < 2:
        pytest.skip(
            "this CPU lacks AVX512_BF16 + AVX512_VBMI, which the AMX items use besides their tiles: "
            "the emulated AMX variant cannot run here"
        )
    return kernel


def amx_emulated(backend: B, name: str) -> B:
    """``backend`` forced to its AMX variant on the ``amx-emulated`` build, named ``name``."""
    cls_name = "AmxEmulated" + backend.__name__.removesuffix("Backend")
    attrs = {"name": name, "force_isa": "c-amx", "kernel_build": "amx-emulated"}
    return cast(B, type(cls_name, (backend,), attrs))


def scalar(backend: B, name: str) -> B:
    """``Scalar<backend>``: ``backend`` forced to the plain-C variant (``force_isa``), named ``name``."""
    cls_name = "Scalar" + backend.__name__.removesuffix("Backend")
    return cast(B, type(cls_name, (backend,), {"name": name, "force_isa": "c-scalar"}))


class ScalarConformance(BackendConformance):
    """The suite on a plain-C variant (set ``backend``): bf16 and fp32, the first three cases, no long
    ones, 16-token pages in four KV splits."""

    dtypes = ("bf16", "fp32")
    configs: ClassVar[list[dict[str, Any]] | None] = [SPLIT_CONFIGS[0]]
    cases = CASES[:3]
    long_cases = ()
