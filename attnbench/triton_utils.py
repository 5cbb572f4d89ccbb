"""Helpers for backends written in Triton: where their kernels can run, and compiling them ahead of time.

Where a kernel runs (:func:`triton_mode`):

- ``"native"``: the workload is on a CUDA device and Triton has a working CUDA driver;
- ``"interpreted"``: the workload is on the CPU and ``TRITON_INTERPRET=1`` is set. Results are
  correct but slow: such candidates are checked against the reference, never timed for tuning;
- otherwise ``None``, with the reason (for ``Backend.supports()``).

``TRITON_INTERPRET`` is read by ``@triton.jit`` when a kernel is *defined*, so a kernel module
imported before the variable was set holds compiled-mode kernels. :func:`kernel_for` sidesteps this:
it wraps the kernel's Python function in the launcher the mode needs (cached), whatever the
environment was at import time. Test suites should still set ``TRITON_INTERPRET=1`` before importing
triton (e.g. ``os.environ.setdefault("TRITON_INTERPRET", "1")`` at the top of ``conftest.py``).

Ahead-of-time compilation (:func:`aot_compile`) needs no GPU: ``triton.compile`` of an ``ASTSource``
for a ``GPUTarget("cuda", 80 | 90, 32)`` yields PTX and a cubin. The GPU compiler rejects programs the
interpreter accepts (``tl.dot`` with a dimension under 16, non-power-of-two blocks, shared memory
over the limit...), so every kernel is compiled this way in the tests. When the ``cuobjdump`` shipped
in the triton wheel is found, the cubin's registers, local memory (spills) and SASS are read too::

    r = aot_compile(my_kernel, signature={"x": "*bf16", "n": "i32", "BLOCK": "constexpr"},
                    constexprs={"BLOCK": 128}, arch=90, num_warps=4, aligned=("x",))
    r.registers, r.local_bytes, r.sass_count("LDG.E.128")
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

__all__ = [
    "AotResult",
    "TritonMode",
    "aot_compile",
    "interpret_requested",
    "kernel_for",
    "nvidia_tool",
    "triton_import_error",
    "triton_mode",
]

TritonMode = Literal["native", "interpreted"]
_TRUE = ("1", "true", "yes", "on")


def interpret_requested() -> bool:
    """True when ``TRITON_INTERPRET`` asks for the interpreter."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE


@functools.cache
def triton_import_error() -> str | None:
    """Why triton cannot be imported, or ``None`` if it can."""
    try:
        import triton
        import triton.language  # noqa: F401
    except Exception as err:  # ImportError, or a broken install
        return f"triton not importable ({type(err).__name__}: {err})"
    return None


@functools.cache
def _cuda_driver_error() -> str | None:
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    try:
        from triton.runtime import driver

        target = driver.active.get_current_target()
    except Exception as err:  # no driver, or a driver triton cannot use
        return f"triton has no usable CUDA driver ({type(err).__name__}: {err})"
    if target.backend != "cuda":
        return f"triton's active target is {target.backend!r}, not 'cuda'"
    return None


def triton_mode(device: str | torch.device) -> tuple[TritonMode | None, str]:
    """How Triton kernels would run on ``device``: ``(mode, "")`` or ``(None, reason)``."""
    err = triton_import_error()
    if err:
        return None, err
    dev = torch.device(device)
    if dev.type == "cuda":
        err = _cuda_driver_error()
        return (None, err) if err else ("native", "")
    if dev.type == "cpu":
        if interpret_requested():
            return "interpreted", ""
        return None, "Triton kernels run on the CPU only in the interpreter: set TRITON_INTERPRET=1"
    return None, f"Triton kernels need a CUDA device (or the CPU with TRITON_INTERPRET=1); got {dev.type!r}"


def _python_fn(kernel: Any) -> Callable[..., Any]:
    """The plain Python function under a ``@triton.jit`` kernel (compiled or interpreted)."""
    fn = getattr(kernel, "fn", kernel)
    if not callable(fn):
        raise TypeError(f"{kernel!r} is not a Triton kernel or a Python function")
    return fn


@functools.cache
def _wrap(fn: Callable[..., Any], mode: TritonMode) -> Any:
    if mode == "interpreted":
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(fn)
    from triton.runtime.jit import JITFunction

    return JITFunction(fn)


def kernel_for(kernel: Any, mode: TritonMode) -> Any:
    """``kernel`` as a launchable object for ``mode`` (a ``JITFunction`` or an ``InterpretedFunction``).

    Returns ``kernel`` itself when it already is the right kind; otherwise a cached wrapper of its
    Python function. Kernels must not call other ``@triton.jit`` functions (those would keep the
    kind they were defined with).
    """
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    want = InterpretedFunction if mode == "interpreted" else JITFunction
    if isinstance(kernel, want):
        return kernel
    return _wrap(_python_fn(kernel), mode)


# -- ahead-of-time compilation ---------------------------------------------------------------------
def nvidia_tool(name: str) -> str | None:
    """Path of a CUDA binary tool (``cuobjdump``, ``nvdisasm``, ``ptxas``): triton's copy, else PATH."""
    try:
        from triton import knobs

        tool = getattr(knobs.nvidia, name.replace("-", "_"))
        return str(tool.path)
    except Exception:  # an old triton without knobs, or a wheel without the tool
        return shutil.which(name)


@dataclass(frozen=True)
class AotResult:
    """What compiling one kernel specialisation for one NVIDIA architecture produced.

    ``registers``/``local_bytes``/``stack_bytes``/``shared_bytes`` come from ``cuobjdump -res-usage``
    and ``sass`` from ``cuobjdump -sass``; they are ``None`` when the tool was not found.
    ``local_bytes > 0`` means register spills (or a local array).
    """

    kernel: str
    arch: int
    num_warps: int
    num_stages: int
    constexprs: dict[str, Any]
    ptx: str
    cubin: bytes
    shared_bytes: int | None  # Triton's own shared-memory count (from compile metadata)
    registers: int | None = None
    local_bytes: int | None = None
    stack_bytes: int | None = None
    sass: str | None = None
    tool_note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def sass_count(self, opcode: str) -> int | None:
        """Occurrences of an instruction, e.g. ``"LDG.E.128"`` (16-byte global loads), ``"LDL"``."""
        if self.sass is None:
            return None
        return len(re.findall(rf"\b{re.escape(opcode)}\b", self.sass))

    def global_loads(self) -> dict[str, int]:
        """Global-load instructions in the SASS by width (``LDG.E.128``, ``LDG.E.64``, ``LDG.E.U16``...)."""
        if self.sass is None:
            return {}
        counts: dict[str, int] = {}
        for op in re.findall(r"\b(LDG\.E[.\w]*)", self.sass):
            counts[op] = counts.get(op, 0) + 1
        return counts

    def summary(self) -> dict[str, Any]:
        return {
            "kernel": self.kernel,
            "arch": f"sm_{self.arch}",
            "num_warps": self.num_warps,
            "constexprs": self.constexprs,
            "registers": self.registers,
            "local_bytes": self.local_bytes,
            "shared_bytes": self.shared_bytes,
            "global_loads": self.global_loads(),
            "local_ops": (self.sass_count("LDL") or 0) + (self.sass_count("STL") or 0) if self.sass else None,
        }


def aot_compile(
    kernel: Any,
    *,
    signature: Mapping[str, str],
    constexprs: Mapping[str, Any],
    arch: int = 90,
    num_warps: int = 4,
    num_stages: int = 2,
    aligned: Iterable[str] = (),
    read_sass: bool = True,
) -> AotResult:
    """Compile ``kernel`` for ``sm_{arch}`` without a GPU; raise the compiler's error if it fails.

    ``signature`` maps every argument name to its type (``"*bf16"``, ``"i32"``, ``"fp32"``,
    ``"constexpr"``); ``constexprs`` gives the values of the constexpr ones. ``aligned`` names the
    pointers and integers that the JIT would see as multiples of 16 at run time (pointers from
    torch are 16-byte aligned; strides that are multiples of 16): without that hint the compiler
    cannot emit 16-byte loads. Constexpr names in ``aligned`` are ignored.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = kernel_for(kernel, "native")
    names = list(fn.arg_names)
    unknown = [n for n in [*signature, *constexprs, *aligned] if n not in names]
    if unknown:
        raise ValueError(f"aot_compile: {fn.__name__} has no argument(s) {unknown}; arguments: {names}")
    missing = [n for n in names if n not in signature]
    if missing:
        raise ValueError(f"aot_compile: signature of {fn.__name__} lacks {missing}")
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned if signature[n] != "constexpr"}
    src = ASTSource(fn=fn, signature=dict(signature), constexprs=dict(constexprs), attrs=attrs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # triton's FP-fusion default notice
        compiled = triton.compile(
            src,
            target=GPUTarget("cuda", arch, 32),
            options={"num_warps": num_warps, "num_stages": num_stages},
        )
    cubin = compiled.asm["cubin"]
    result = dict(
        kernel=fn.__name__,
        arch=arch,
        num_warps=num_warps,
        num_stages=num_stages,
        constexprs=dict(constexprs),
        ptx=compiled.asm["ptx"],
        cubin=cubin,
        shared_bytes=getattr(compiled.metadata, "shared", None),
    )
    if read_sass:
        result |= _read_cubin(cubin)
    return AotResult(**result)


def _read_cubin(cubin: bytes) -> dict[str, Any]:
    tool = nvidia_tool("cuobjdump")
    if not tool or not Path(tool).exists():
        return {"tool_note": "cuobjdump not found: registers and SASS not read"}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        try:
            res = subprocess.run([tool, "-res-usage", str(path)], capture_output=True, text=True, timeout=60)
            sass = subprocess.run([tool, "-sass", str(path)], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as err:
            return {"tool_note": f"cuobjdump failed: {err}"}
    if res.returncode or sass.returncode:
        return {"tool_note": f"cuobjdump failed: {(res.stderr or sass.stderr).strip()[:200]}"}
    usage = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", res.stdout))
    return {
        "registers": int(usage["REG"]) if "REG" in usage else None,
        "local_bytes": int(usage["LOCAL"]) if "LOCAL" in usage else None,
        "stack_bytes": int(usage["STACK"]) if "STACK" in usage else None,
        "sass": sass.stdout,
        "tool_note": "cuobjdump",
    }
