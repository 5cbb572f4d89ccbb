"""The compiled ``cpu_decode`` kernel: its source tree, its builds, the compile cache and its ctypes interface.

The kernel is the C source tree ``csrc/`` beside this file, shared by the ``cpu_decode``,
``cpu_decode_fp8`` and ``cpu_decode_mla`` backends. :func:`load_kernel` compiles it at first use with
the system C compiler (``$CC``, else ``cc``/``gcc``/``clang``) into a per-user cache
(``attnbench.core.device.cache_dir() / "cpu_decode"``, one file per hash of the tree, the compiler's
version and the flags, renamed into place atomically so parallel processes never see a half-written
library) and declares the entry points' argument types.

Builds (:data:`BUILDS`): ``native``, what every backend loads, and ``amx-emulated``, the same tree with
the AMX tile operations in plain C (``csrc/amx_emu.h``, which checks every operand the hardware would
refuse), which the tests load so that the AMX items run on any CPU with AVX-512 BF16 + VBMI.
``ATTNBENCH_CPU_DECODE_SANITIZE=address`` builds either with AddressSanitizer
(``scripts/asan-kernel.sh``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from attnbench.core.device import cache_dir
from attnbench.core.resolution import Tunable

__all__ = [
    "BUILDS",
    "DTYPE_CODES",
    "ERR_NOMEM",
    "FP8_SHIFT_CODE",
    "ISA_CODES",
    "ISA_NAMES",
    "MAX_SPLITS",
    "SOURCE",
    "SOURCE_DIR",
    "Kernel",
    "build_flags",
    "build_library",
    "find_compiler",
    "kernel_failed",
    "load_kernel",
    "with_variants",
]

#: the kernel's source tree: ``cpu_decode.c`` and the headers it includes (``amx_emu.h``)
SOURCE_DIR = Path(__file__).with_name("csrc")
SOURCE = SOURCE_DIR / "cpu_decode.c"
FLAGS = ("-O3", "-fPIC", "-shared", "-fopenmp")
#: the builds a process may load: ``native`` (what users run) and ``amx-emulated``, the same source
#: with the AMX tile operations in plain C (``csrc/amx_emu.h``), so that the AMX items run, and are
#: tested, on a CPU without AMX (where it has the AVX-512 BF16 + VBMI the rest of those items use)
BUILDS = {"native": (), "amx-emulated": ("-DCPU_DECODE_AMX_EMULATE",)}
#: ``ATTNBENCH_CPU_DECODE_SANITIZE=address`` builds every flavour with AddressSanitizer (the process
#: must preload the sanitizer's runtime: scripts/asan-kernel.sh does both)
SANITIZE_ENV = "ATTNBENCH_CPU_DECODE_SANITIZE"
#: (-O1 after -O3: a third of the compile time, the usual level for a sanitizer build)
SANITIZERS = {"address": ("-O1", "-fsanitize=address", "-fno-omit-frame-pointer", "-g")}
#: ``ATTNBENCH_CPU_DECODE_SOURCE_DIR``: build from another copy of the tree (scripts/asan-kernel.sh's
#: planted bugs); unset, ``SOURCE_DIR``
SOURCE_DIR_ENV = "ATTNBENCH_CPU_DECODE_SOURCE_DIR"
#: KV splits per sequence the kernel takes (cpu_decode.c's MAX_SPLITS: the workspace is sized for them)
MAX_SPLITS = 16
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
#: the kernel's variants, ordered: a CPU that runs one runs every one before it (cpu_decode_isa())
ISA_NAMES = {0: "c-scalar", 1: "c-avx2", 2: "c-avx512", 3: "c-avx512bf16", 4: "c-amx"}  # 4: fp8 caches only
ISA_CODES = {v: k for k, v in ISA_NAMES.items()}
FP8_SHIFT_CODE = 5  # ISA_FP8_SHIFT: c-avx512bf16 over an fp8 cache with the shift conversion
#: the entry points' interface version (cpu_decode_abi() in cpu_decode.c)
ABI = 7
#: what the kernel's entry points return when a scratch allocation is refused (ERR_NOMEM)
ERR_NOMEM = -4


def kernel_failed(backend: str, rc: int, what: str = "kernel") -> Exception:
    """The exception for an entry point's non-zero return code ``rc`` (``what``: "kernel" or "kernel's
    writer"): :class:`MemoryError` when its scratch memory was refused, else the arguments refused."""
    if rc == ERR_NOMEM:
        return MemoryError(f"backend {backend!r}: the {what} could not allocate its scratch memory")
    return RuntimeError(f"backend {backend!r}: the {what} refused its arguments (code {rc})")


@dataclass(frozen=True)
class Kernel:
    """The loaded library and the best variant the running CPU supports (``isa``: a key of ``ISA_NAMES``)."""

    lib: ctypes.CDLL
    isa: int
    path: Path
    #: the best variant for fp8 caches: 2 AMX (granted by the OS, or emulated), 1 AVX-512 BF16 + VBMI, 0 plain C
    fp8_level: int = 0
    #: the build (a key of ``BUILDS``); ``amx-emulated`` runs its AMX items on the plain-C tiles
    build: str = "native"

    @property
    def amx_emulated(self) -> bool:
        return self.build == "amx-emulated"


def find_compiler() -> str | None:
    """The C compiler the kernel is built with: ``$CC``, else the first of cc, gcc, clang on PATH."""
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def build_flags(build: str = "native") -> tuple[str, ...]:
    """The compiler flags of ``build`` (a key of ``BUILDS``), with the sanitizer ``$ATTNBENCH_CPU_DECODE_SANITIZE``
    names, if any; an unknown build or sanitizer raises :class:`ValueError` naming what is accepted."""
    if build not in BUILDS:
        raise ValueError(f"cpu_decode build {build!r} unknown; builds: {', '.join(BUILDS)}")
    sanitize = os.environ.get(SANITIZE_ENV, "")
    if sanitize and sanitize not in SANITIZERS:
        raise ValueError(f"{SANITIZE_ENV}={sanitize!r}: expected one of {', '.join(SANITIZERS)} or unset")
    return (*FLAGS, *BUILDS[build], *SANITIZERS.get(sanitize, ()))


def _source_dir() -> Path:
    return Path(os.environ.get(SOURCE_DIR_ENV) or SOURCE_DIR)


def _build(cc: str, build: str = "native") -> Path:
    """Compile the source tree into the per-user cache unless a library for this tree/compiler/flags exists."""

    flags = build_flags(build)
    src = _source_dir()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    h = hashlib.sha256(version.encode() + " ".join(flags).encode())
    for f in sorted(src.glob("*.[ch]")):  # the tree: a header's change is a new library too
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    out_dir = cache_dir() / "cpu_decode"
    target = out_dir / f"cpu_decode-{h.hexdigest()[:16]}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=".build-", suffix=".so")
    os.close(fd)
    try:
        proc = subprocess.run(
            [cc, *flags, "-I", str(src), "-o", tmp, str(src / SOURCE.name), "-lm"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if proc.returncode != 0:
            first = (proc.stderr.strip().splitlines() or ["(no message)"])[0]
            raise RuntimeError(f"{cc} could not build {SOURCE.name} ({build}): {first}")
        os.replace(tmp, target)  # atomic: a parallel build of the same key replaces it with the same bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def build_library(build: str = "native") -> Path:
    """Compile ``build`` (a key of ``BUILDS``) with the kernel's compiler unless it is cached; its path.
    Raises :class:`RuntimeError` where no compiler is found or the build fails."""
    cc = find_compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc or clang)")
    return _build(cc, build)


@functools.cache
def load_kernel(build: str = "native") -> Kernel | str:
    """The compiled kernel (``build``: a key of ``BUILDS``), or the reason it is unavailable (built once per
    process and build, cached on disk)."""
    cc = find_compiler()
    if cc is None:
        return "no C compiler found (set CC, or install gcc or clang)"
    try:
        path = _build(cc, build)
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return f"cpu_decode kernel unavailable: {exc}"
    if lib.cpu_decode_abi() != ABI:
        return f"cpu_decode kernel at {path} has ABI {lib.cpu_decode_abi()}, expected {ABI}"
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.cpu_decode_attend.argtypes = [p] * 7 + [i] * 11 + [f]
    lib.cpu_decode_attend.restype = i
    lib.cpu_decode_write.argtypes = [p] * 7 + [i] * 8
    lib.cpu_decode_write.restype = i
    lib.cpu_decode_attend_fp8.argtypes = [p] * 9 + [i] * 11 + [f]
    lib.cpu_decode_attend_fp8.restype = i
    lib.cpu_decode_write_fp8.argtypes = [p] * 9 + [i] * 7
    lib.cpu_decode_write_fp8.restype = i
    lib.cpu_decode_attend_latent.argtypes = [p] * 6 + [i] * 10 + [f]
    lib.cpu_decode_attend_latent.restype = i
    lib.cpu_decode_fail_alloc.argtypes = [i]
    lib.cpu_decode_fail_alloc.restype = i
    assert bool(lib.cpu_decode_amx_emulated()) == (build == "amx-emulated"), f"{path}: not the {build} build"
    return Kernel(
        lib=lib,
        isa=int(lib.cpu_decode_isa()),
        path=path,
        fp8_level=int(lib.cpu_decode_fp8_fast()),
        build=build,
    )


def with_variants(tunables: tuple[Tunable, ...], *, others: tuple[str, ...]) -> tuple[Tunable, ...]:
    """``tunables`` with ``isa`` offering ``auto`` and ``others`` — the variants besides the one ``auto``
    runs that run the workload on this CPU — so that a tune measures each; without ``isa`` where there
    are none (one variant runs: nothing to choose). Shared by the kernel's backends."""
    return tuple(
        t.narrowed(("auto", *others)) if t.name == "isa" else t for t in tunables if t.name != "isa" or others
    )
