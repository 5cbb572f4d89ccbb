"""The compiled ``cpu_decode`` kernel: its source tree, its builds, the compile cache and its ctypes interface.

The kernel is the C source tree ``csrc/`` beside this file, shared by the ``cpu_decode``,
``cpu_decode_fp8`` and ``cpu_decode_mla`` backends: ``cpu_decode.c``, the one translation unit the
build compiles (the entry points, the ISA detection and the dispatch), and the headers it includes —
``common.h`` (types, enums, the argument structs, scratch memory, scalar conversions),
``vec_generic.h``, ``isa_avx2.h``, ``isa_avx512.h``, ``isa_amx.h`` (one per instruction set, with
``amx_emu.h``), ``decode_paged.h``, ``decode_fp8.h``, ``decode_latent.h`` (one per cache form) and
``writers.h``; ``cpu_decode.c``'s header comment describes every path. :func:`load_kernel` compiles
it at first use with the system C compiler (``$CC``, else ``cc``/``gcc``/``clang``) into a per-user
cache (``attnbench.core.device.cache_dir() / "cpu_decode"``, one file per hash of the tree, the
compiler's version and the flags, renamed into place atomically so parallel processes never see a
half-written library), declares the entry points' argument types and checks that the C argument
structs (``cpu_decode_attend_args``, ``cpu_decode_write_args``) have the layout of their ctypes
Structures here (:class:`AttendArgs`, :class:`WriteArgs`; :func:`check_layout`).

Each entry point takes one pointer to its struct: build it with keyword fields and pass
``ctypes.byref`` (``lib.cpu_decode_attend(ctypes.byref(AttendArgs(q=..., ...)))``); fields a form does
not read stay 0 / NULL. The fp8 conversion is a field of its own (``fp8_convert``); on this side the
code :data:`FP8_SHIFT_CODE` still names "c-avx512bf16 with the shift conversion", and
:func:`kernel_isa` turns a variant code into the two fields.

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
from typing import Any, ClassVar

import torch

from attnbench.core.device import cache_dir
from attnbench.core.resolution import Tunable

__all__ = [
    "BUILDS",
    "DTYPE_CODES",
    "ERR_NOMEM",
    "FP8_CONVERT_CODES",
    "FP8_SHIFT_CODE",
    "ISA_CODES",
    "ISA_NAMES",
    "MAX_SPLITS",
    "SOURCE",
    "SOURCE_DIR",
    "AttendArgs",
    "Kernel",
    "WriteArgs",
    "build_flags",
    "build_library",
    "check_layout",
    "find_compiler",
    "kernel_failed",
    "kernel_isa",
    "load_kernel",
    "step_args",
    "with_variants",
]

#: the kernel's source tree: ``cpu_decode.c`` (the translation unit compiled) and the headers it includes
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
#: KV splits per sequence the kernel takes (common.h's MAX_SPLITS: the workspace is sized for them)
MAX_SPLITS = 16
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
#: the kernel's variants, ordered: a CPU that runs one runs every one before it (cpu_decode_isa())
ISA_NAMES = {0: "c-scalar", 1: "c-avx2", 2: "c-avx512", 3: "c-avx512bf16", 4: "c-amx"}  # 4: fp8 caches only
ISA_CODES = {v: k for k, v in ISA_NAMES.items()}
#: the fp8 conversions of c-avx512bf16 (the attend args' ``fp8_convert``: common.h's CV_LOOKUP, CV_SHIFT)
FP8_CONVERT_CODES = {"lookup": 0, "shift": 1}
#: on this side only, a variant code beside ISA_NAMES': c-avx512bf16 over an fp8 cache with the shift
#: conversion (the kernel takes it as ``isa`` c-avx512bf16 and ``fp8_convert`` shift: :func:`kernel_isa`)
FP8_SHIFT_CODE = 5
#: the entry points' interface version (cpu_decode_abi() in cpu_decode.c): 8, the argument structs
ABI = 8
#: what the kernel's entry points return when a scratch allocation is refused (ERR_NOMEM)
ERR_NOMEM = -4


def kernel_isa(code: int) -> tuple[int, int]:
    """The ``isa`` and ``fp8_convert`` fields for the variant code ``code`` (a key of ``ISA_NAMES``, or
    :data:`FP8_SHIFT_CODE`: c-avx512bf16 with the shift conversion; every other code converts fp8 by
    lookups, the only conversion its item has)."""
    if code == FP8_SHIFT_CODE:
        return ISA_CODES["c-avx512bf16"], FP8_CONVERT_CODES["shift"]
    return code, FP8_CONVERT_CODES["lookup"]


_P, _I32, _F32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_float


class AttendArgs(ctypes.Structure):
    """``cpu_decode_attend_args`` (common.h), what ``cpu_decode_attend``, ``cpu_decode_attend_fp8`` and
    ``cpu_decode_attend_latent`` take: one struct for the three forms (the same arguments but for the fp8
    scales and the latent value width). The paged form leaves the scales and ``v_head_dim`` unset; the
    latent form reads ``num_q_heads`` as H, ``head_dim`` as the row Dk, ``v_head_dim`` as Dv and
    ``k_cache`` as its rows (``v_cache``, the scales, ``num_kv_heads`` and ``prefetch`` unset)."""

    c_name: ClassVar[str] = "cpu_decode_attend_args"
    _fields_ = (
        ("q", _P),
        ("k_cache", _P),
        ("v_cache", _P),
        ("k_scales", _P),
        ("v_scales", _P),
        ("block_table", _P),
        ("seq_lens", _P),
        ("out", _P),
        ("workspace", _P),
        ("num_seqs", _I32),
        ("num_q_heads", _I32),
        ("num_kv_heads", _I32),
        ("head_dim", _I32),
        ("v_head_dim", _I32),
        ("page_size", _I32),
        ("max_pages", _I32),
        ("splits", _I32),
        ("dtype", _I32),
        ("isa", _I32),
        ("fp8_convert", _I32),
        ("threads", _I32),
        ("prefetch", _I32),
        ("scale", _F32),
    )


def step_args(cache: Any, plan: Any, q: torch.Tensor, out: torch.Tensor, **fields: Any) -> AttendArgs:
    """An attention call's struct over one of the kernel's paged caches (``cpu_decode``'s or the latent
    one's): what every form takes from the cache (block table, workspace, sizes, dtype, scale) and the
    step's plan (lengths, splits, threads), and ``fields``, the form's own (its pages, variant)."""
    g = cache.geometry
    return AttendArgs(
        q=q.data_ptr(),
        block_table=cache.block_table.data_ptr(),
        seq_lens=plan.seq_lens32.data_ptr(),
        out=out.data_ptr(),
        workspace=cache.workspace.data_ptr(),
        num_seqs=cache.batch,
        num_q_heads=g.num_q_heads,
        head_dim=g.qk_head_dim,
        page_size=cache.page_size,
        max_pages=cache.pages_per_seq,
        splits=plan.splits,
        dtype=DTYPE_CODES[cache.dtype],
        threads=plan.threads,
        scale=g.scale,
        **fields,
    )


class WriteArgs(ctypes.Structure):
    """``cpu_decode_write_args`` (common.h), what ``cpu_decode_write`` and ``cpu_decode_write_fp8`` take:
    ``k``/``v`` ``[num_seqs, max_new, Hkv, D]``. ``cpu_decode_write`` reads ``pair`` and ``elem_size``,
    ``cpu_decode_write_fp8`` the scales, ``dtype`` and ``isa`` instead."""

    c_name: ClassVar[str] = "cpu_decode_write_args"
    _fields_ = (
        ("k_cache", _P),
        ("v_cache", _P),
        ("k_scales", _P),
        ("v_scales", _P),
        ("k", _P),
        ("v", _P),
        ("block_table", _P),
        ("positions", _P),
        ("num_new", _P),
        ("num_seqs", _I32),
        ("max_new", _I32),
        ("num_kv_heads", _I32),
        ("head_dim", _I32),
        ("page_size", _I32),
        ("max_pages", _I32),
        ("pair", _I32),
        ("elem_size", _I32),
        ("dtype", _I32),
        ("isa", _I32),
    )


#: the argument structs :func:`load_kernel` checks
ARG_STRUCTS: tuple[type[ctypes.Structure], ...] = (AttendArgs, WriteArgs)


def check_layout(
    lib: ctypes.CDLL, struct_cls: type[ctypes.Structure], c_name: str | None = None
) -> str | None:
    """None where the C struct ``c_name`` (default ``struct_cls.c_name``) has the layout of ``struct_cls``:
    the same fields in the same order, each at the same offset with the same size, and the same
    ``sizeof`` (``cpu_decode_args_layout``/``cpu_decode_args_field`` report the C side); else what differs
    first, naming the struct and the field with its C and ctypes offsets (or the two sizes)."""
    name: str = c_name or str(getattr(struct_cls, "c_name", struct_cls.__name__))
    key = name.encode()
    lib.cpu_decode_args_layout.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int64), ctypes.c_int]
    lib.cpu_decode_args_layout.restype = ctypes.c_int
    lib.cpu_decode_args_field.argtypes = [ctypes.c_char_p, ctypes.c_int]
    lib.cpu_decode_args_field.restype = ctypes.c_char_p
    count = lib.cpu_decode_args_layout(key, None, 0)
    if count < 0:
        return f"the kernel has no argument struct {name}"
    layout = (ctypes.c_int64 * (1 + 2 * count))()
    lib.cpu_decode_args_layout(key, layout, len(layout))
    ours = [(field[0], getattr(struct_cls, field[0])) for field in struct_cls._fields_]
    for i in range(max(count, len(ours))):
        c_field = lib.cpu_decode_args_field(key, i).decode() if i < count else None
        c_off, c_size = (layout[1 + 2 * i], layout[2 + 2 * i]) if i < count else (None, None)
        if i >= len(ours):
            return (
                f"{name}: field {c_field!r} (C offset {c_off}) has no ctypes field in "
                f"{struct_cls.__name__} (ctypes offset none)"
            )
        py_field, desc = ours[i]
        if c_field is None:
            return (
                f"{name}: field {py_field!r} of {struct_cls.__name__} (ctypes offset {desc.offset}) is not "
                "in the C struct (C offset none)"
            )
        if c_field != py_field:
            return (
                f"{name}: field {i} is {c_field!r} at C offset {c_off} but {py_field!r} at ctypes offset "
                f"{desc.offset} in {struct_cls.__name__}"
            )
        if c_off != desc.offset or c_size != desc.size:
            return (
                f"{name}: field {py_field!r} at C offset {c_off} ({c_size} bytes), ctypes offset "
                f"{desc.offset} ({desc.size} bytes) in {struct_cls.__name__}"
            )
    if layout[0] != ctypes.sizeof(struct_cls):
        return f"{name}: size {layout[0]} bytes in C, {ctypes.sizeof(struct_cls)} in ctypes ({struct_cls.__name__})"
    return None


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
    for struct_cls in ARG_STRUCTS:
        mismatch = check_layout(lib, struct_cls)
        if mismatch is not None:
            return f"cpu_decode kernel at {path}: argument struct layout differs from ctypes: {mismatch}"
    i = ctypes.c_int
    for fn, struct_cls in (
        (lib.cpu_decode_attend, AttendArgs),
        (lib.cpu_decode_attend_fp8, AttendArgs),
        (lib.cpu_decode_attend_latent, AttendArgs),
        (lib.cpu_decode_write, WriteArgs),
        (lib.cpu_decode_write_fp8, WriteArgs),
    ):
        fn.argtypes = [ctypes.POINTER(struct_cls)]
        fn.restype = i
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
