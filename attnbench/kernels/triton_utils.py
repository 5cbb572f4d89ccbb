"""Helpers for backends written in Triton: where their kernels can run, and compiling them ahead of time
(the Markdown report of a set of specialisations: ``python -m attnbench.correctness.aot``).

Where a kernel runs (:func:`triton_mode`):

- ``"native"``: the workload is on a CUDA device and Triton has a working CUDA driver;
- ``"interpreted"``: Triton was loaded in interpreter mode (``TRITON_INTERPRET=1`` set *before*
  ``triton`` was first imported). Results are correct but slow: such candidates are checked against
  the reference, never timed for tuning;
- otherwise ``None``, with the reason (for ``Backend.supports()``).

Interpreter mode is fixed when ``triton`` is imported: ``@triton.jit`` (Triton's own standard library
included: ``tl.cdiv``, ``tl.sum``...) builds interpreted or compiled functions at definition time, so
setting the variable later does not help and :func:`triton_mode` says so. Test suites set it at the
top of ``conftest.py`` (``os.environ.setdefault("TRITON_INTERPRET", "1")``) on machines without CUDA.

Ahead-of-time compilation (:func:`aot_compile`, :func:`aot_compile_many`) needs no GPU: ``triton.compile``
of an ``ASTSource`` for a ``GPUTarget("cuda", 80 | 90, 32)`` yields PTX and a cubin. The GPU compiler
rejects programs the interpreter accepts (``tl.dot`` with a dimension under 16, non-power-of-two
blocks, too much shared memory...), so every kernel is compiled this way in the tests. In a process
where Triton runs interpreted, compilation happens in a child process started without the
interpreter (the kernel is re-imported there from its module or file). When the ``cuobjdump``
shipped in the triton wheel is found, the cubin's registers, local memory (spills) and SASS are read::

    r = aot_compile(my_kernel, signature={"x": "*bf16", "n": "i32", "BLOCK": "constexpr"},
                    constexprs={"BLOCK": 128}, arch=90, num_warps=4, aligned=("x",))
    r.registers, r.local_bytes, r.global_loads()   # {"LDG.E.128": 2, ...}
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from attnbench.core.child import run_child

__all__ = [
    "AotCompileError",
    "AotResult",
    "TritonMode",
    "aot_compile",
    "aot_compile_many",
    "interpret_requested",
    "kernel_for",
    "language_interpreted",
    "nvidia_tool",
    "triton_import_error",
    "triton_mode",
]

TritonMode = Literal["native", "interpreted"]
_TRUE = ("1", "true", "yes", "on")


def interpret_requested() -> bool:
    """True when ``TRITON_INTERPRET`` asks for the interpreter (now; see :func:`language_interpreted`)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE


@functools.cache
def triton_import_error() -> str | None:
    """Why triton cannot be imported, or ``None`` if it can."""
    try:  # triton is imported on first use: interpreter mode is fixed by that import (module docstring)
        import triton.language  # noqa: F401
    except Exception as err:  # ImportError, or a broken install
        return f"triton not importable ({type(err).__name__}: {err})"
    return None


def language_interpreted() -> bool:
    """True when ``triton.language`` was loaded in interpreter mode (its ``@jit`` helpers are interpreted).

    If triton is not imported yet, the answer is what importing it now would give.
    """
    standard = sys.modules.get("triton.language.standard")
    if standard is None:
        return interpret_requested()
    return isinstance(standard.cdiv, _function_classes()[0])


@functools.cache
def _cuda_driver_error() -> str | None:
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    try:  # triton on first use (module docstring)
        from triton.runtime import driver

        target = driver.active.get_current_target()
    except Exception as err:  # no driver, or a driver triton cannot use
        return f"triton has no usable CUDA driver ({type(err).__name__}: {err})"
    if target.backend != "cuda":
        return f"triton's active target is {target.backend!r}, not 'cuda'"
    return None


def triton_mode(device: str | torch.device) -> tuple[TritonMode | None, str]:
    """How Triton kernels would run on ``device``: ``(mode, "")`` or ``(None, reason)``.

    In interpreter mode every device runs interpreted (CUDA tensors are copied to the host and back).
    """
    err = triton_import_error()
    if err:
        return None, err
    dev = torch.device(device)
    if dev.type not in ("cuda", "cpu"):
        return (
            None,
            f"Triton kernels need a CUDA device (or the CPU with TRITON_INTERPRET=1); got {dev.type!r}",
        )
    if language_interpreted():
        return "interpreted", ""
    if dev.type == "cuda":
        err = _cuda_driver_error()
        return (None, err) if err else ("native", "")
    if interpret_requested():
        return None, (
            "TRITON_INTERPRET=1 was set after triton was imported; set it before the first import "
            "(e.g. at the top of conftest.py)"
        )
    return (
        None,
        "Triton kernels run on the CPU only in the interpreter: set TRITON_INTERPRET=1 before importing triton",
    )


def _python_fn(kernel: Any) -> Callable[..., Any]:
    """The plain Python function under a ``@triton.jit`` kernel (compiled or interpreted)."""
    fn = getattr(kernel, "fn", kernel)
    if not callable(fn):
        raise TypeError(f"{kernel!r} is not a Triton kernel or a Python function")
    return fn


@functools.cache
def _function_classes() -> tuple[type, type]:
    """Triton's ``(InterpretedFunction, JITFunction)``, imported on first use (module docstring)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    return InterpretedFunction, JITFunction


@functools.cache
def _wrap(fn: Callable[..., Any], mode: TritonMode) -> Any:
    interpreted, jit = _function_classes()
    return interpreted(fn) if mode == "interpreted" else jit(fn)


def kernel_for(kernel: Any, mode: TritonMode) -> Any:
    """``kernel`` as a launchable object for ``mode`` (a ``JITFunction`` or an ``InterpretedFunction``).

    Returns ``kernel`` itself when it already is the right kind, else a cached wrapper of its Python
    function. ``mode`` should be what :func:`triton_mode` reports: a kernel that calls Triton's
    standard library only runs in the mode ``triton.language`` was loaded in.
    """
    interpreted, jit = _function_classes()
    want = interpreted if mode == "interpreted" else jit
    if isinstance(kernel, want):
        return kernel
    return _wrap(_python_fn(kernel), mode)


# -- ahead-of-time compilation ---------------------------------------------------------------------
def nvidia_tool(name: str) -> str | None:
    """Path of a CUDA binary tool (``cuobjdump``, ``nvdisasm``, ``ptxas``): triton's copy, else PATH."""
    try:  # triton on first use (module docstring)
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
        """Global-load instructions in the SASS by kind and width: ``LDG.E.128`` (16-byte load to
        registers), ``LDGSTS.E.BYPASS.128`` (16-byte ``cp.async`` to shared memory), ``LDG.E.U16``..."""
        if self.sass is None:
            return {}
        return dict(Counter(re.findall(r"\b(LDGSTS\.[.\w]*|LDG\.E[.\w]*)", self.sass)))

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


class AotCompileError(RuntimeError):
    """The Triton/PTX compiler rejected a kernel for an NVIDIA target (the message is the compiler's)."""


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
    """Compile ``kernel`` for ``sm_{arch}`` without a GPU; raise :class:`AotCompileError` if it fails.

    ``signature`` maps every argument name to its type (``"*bf16"``, ``"i32"``, ``"fp32"``,
    ``"constexpr"``); ``constexprs`` gives the values of the constexpr ones. ``aligned`` names the
    pointers and integers that the JIT would see as multiples of 16 at run time (pointers from
    torch are 16-byte aligned; strides that are multiples of 16): without that hint the compiler
    cannot emit 16-byte loads. Constexpr names in ``aligned`` are ignored.
    """
    request = {
        "kernel": kernel,
        "signature": signature,
        "constexprs": constexprs,
        "arch": arch,
        "num_warps": num_warps,
        "num_stages": num_stages,
        "aligned": tuple(aligned),
        "read_sass": read_sass,
    }
    (result,) = aot_compile_many([request])
    if isinstance(result, Exception):
        raise result
    return result


def aot_compile_many(requests: Sequence[Mapping[str, Any]]) -> list[AotResult | Exception]:
    """:func:`aot_compile` for each request (a dict of its keyword arguments plus ``kernel``).

    Returns, in order, each result or the exception that stopped it (bad arguments: ``ValueError``;
    rejected by the compiler: :class:`AotCompileError`). In an interpreted process all requests are
    compiled in one child process (the kernels are re-imported there by module, else by file).
    """
    full = [{**_DEFAULTS, **r} for r in requests]
    checked: list[AotResult | Exception | None] = [_check_request(r) for r in full]
    todo = [i for i, c in enumerate(checked) if c is None]
    if not todo:
        return checked  # type: ignore[return-value]  # no None: every request failed its check
    if not language_interpreted():
        for i in todo:
            checked[i] = _try_compile_here(full[i])
        return checked  # type: ignore[return-value]  # no None: each was filled above
    refs = [{**full[i], "kernel": _kernel_ref(full[i]["kernel"])} for i in todo]
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "requests.pkl", Path(tmp) / "results.pkl"
        src.write_bytes(pickle.dumps((sys.path, refs)))  # the child imports what this process can
        env = {**os.environ, "TRITON_INTERPRET": "0"}
        run = run_child(["-c", _WORKER, str(src), str(dst)], env=env, timeout=1800, stderr_bytes=2000)
        if run.returncode or not dst.exists():
            status = "killed after 1800 s" if run.timed_out else f"exit {run.returncode}"
            raise RuntimeError(f"AOT compile worker failed ({status}): {run.stderr}")
        for i, result in zip(todo, pickle.loads(dst.read_bytes()), strict=True):
            checked[i] = result
        return checked  # type: ignore[return-value]  # no None: each was filled above


_DEFAULTS: dict[str, Any] = {"arch": 90, "num_warps": 4, "num_stages": 2, "aligned": (), "read_sass": True}


def _check_request(request: Mapping[str, Any]) -> ValueError | None:
    """The error in a request's arguments, found without compiling anything (``None``: fine)."""

    fn = _python_fn(request["kernel"])
    names = list(inspect.signature(fn).parameters)
    signature, constexprs = request["signature"], request["constexprs"]
    unknown = [n for n in [*signature, *constexprs, *request["aligned"]] if n not in names]
    if unknown:
        return ValueError(f"aot_compile: {fn.__name__} has no argument(s) {unknown}; arguments: {names}")
    missing = [n for n in names if n not in signature]
    if missing:
        return ValueError(f"aot_compile: signature of {fn.__name__} lacks {missing}")
    return None


# run as a script so that results pickle as attnbench.kernels.triton_utils classes, not __main__ ones
_WORKER = "import sys; from attnbench.kernels.triton_utils import _worker_main; _worker_main(sys.argv[1:])"


def _kernel_ref(kernel: Any) -> dict[str, str]:
    fn = _python_fn(kernel)
    return {
        "module": fn.__module__,
        "name": fn.__qualname__,
        "file": str(Path(fn.__code__.co_filename).resolve()),
    }


def _load_kernel(ref: Mapping[str, str]) -> Any:
    module = None
    if ref["module"] not in ("__main__", None):
        with contextlib.suppress(ImportError):
            module = importlib.import_module(ref["module"])
    if module is None or not hasattr(module, ref["name"]):
        spec = importlib.util.spec_from_file_location(f"_aot_kernels_{abs(hash(ref['file']))}", ref["file"])
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load kernel {ref['name']} from {ref['file']}")
        module = importlib.util.module_from_spec(spec)
        folder = str(Path(ref["file"]).parent)  # as for a script: the file's own folder is importable
        added = folder not in sys.path
        if added:
            sys.path.insert(0, folder)
        try:
            spec.loader.exec_module(module)
        finally:
            if added:
                sys.path.remove(folder)
    return getattr(module, ref["name"])


def _worker_main(args: list[str]) -> None:
    src, dst = Path(args[0]), Path(args[1])
    path, requests = pickle.loads(src.read_bytes())
    sys.path += [p for p in path if p not in sys.path]
    results: list[AotResult | Exception] = []
    for r in requests:
        try:
            kernel = _load_kernel(r["kernel"])
        except Exception as err:  # reported per request
            results.append(AotCompileError(f"could not import the kernel: {type(err).__name__}: {err}"))
            continue
        results.append(_try_compile_here({**r, "kernel": kernel}))
    dst.write_bytes(pickle.dumps(results))


def _try_compile_here(request: dict[str, Any]) -> AotResult | Exception:
    try:
        return _compile_here(**request)
    except ValueError as err:
        return err
    except Exception as err:  # the compiler's own exception types vary; keep the message
        return AotCompileError(f"{type(err).__name__}: {err}")


def _compile_here(
    kernel: Any,
    *,
    signature: Mapping[str, str],
    constexprs: Mapping[str, Any],
    arch: int,
    num_warps: int,
    num_stages: int,
    aligned: Iterable[str],
    read_sass: bool,
) -> AotResult:
    # triton on first use (module docstring); its compiler only for ahead-of-time builds
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = kernel_for(kernel, "native")
    names = list(fn.arg_names)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned if signature[n] != "constexpr"}
    src = ASTSource(fn=fn, signature=dict(signature), constexprs=dict(constexprs), attrs=attrs)
    with warnings.catch_warnings(), knobs.runtime.scope():
        knobs.runtime.interpret = False
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
