"""The ``cpu_decode`` kernel as a source tree against the single file it was: bit-identity and A/B timing.

The OLD build is the kernel's ``backends/csrc`` at a git revision (``--base``, default ``24377cf``, the
last single-file kernel, ABI 7: positional arguments), read with ``git show`` into a temporary
directory and compiled with the flags :func:`attnbench.backends.cpu_kernel.build_flags` gives the same
build (cached beside the kernel's own builds); the NEW build is this tree through
:func:`~attnbench.backends.cpu_kernel.load_kernel` (ABI 8: one argument struct per entry point).

    python scripts/kernel_tree_ab.py --compare        # 420 cases on this CPU, exit 1 on any difference
    python scripts/kernel_tree_ab.py --ab             # interleaved timing (a quiet machine)
    python scripts/kernel_tree_ab.py --ab --quick     # smoke: batch 1, 1k context, 3 rounds

``--compare`` runs both builds on the same fresh random inputs — each build writes its own cache with
its own writer (the prompt, then one token at its end, as a decode step writes) and attends over it —
and requires every output, every cache byte and every fp8 scale, and every return code, to be
bit-identical: the paged form (GQA groups 1-8 × head dims 32-128 × pages of 16-512 keys × 1 and 4 KV
splits) in every dtype of every variant this CPU runs (``ISA_NAMES``), the fp8 form in plain C and
c-avx512bf16 with both conversions (lookup, shift), the latent form, and the AMX items (native where
the OS grants AMX, else on the ``amx-emulated`` build of both trees where the CPU has AVX-512 BF16 +
VBMI). It prints the cases per form and variant and the differences.

``--ab`` times the two builds alternately on the same inputs (old then new, new then old the next
round; one thread): bf16 paged, fp8 (c-avx512bf16, shift) and latent at batch 1 and 8, context 8k,
and writes ``<out>.json`` and ``<out>.md`` with the command, the machine (platform, CPU, its avx512 /
amx flags), the date, the load average before and after, and per shape the median time per call of
each build and new / old.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import hashlib
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from attnbench.backends import cpu_kernel as ck
from attnbench.cli.common import positive_int
from attnbench.core.device import cache_dir, fingerprint
from attnbench.core.workload import Workload

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BASE = "24377cf"
OLD_ABI = 7
#: the ABI-7 entry points' positional arguments, each named by the field of the ABI-8 struct it became
OLD_ARGS: dict[str, tuple[str, ...]] = {
    "cpu_decode_attend": (
        "q", "k_cache", "v_cache", "block_table", "seq_lens", "out", "workspace", "num_seqs", "num_q_heads",
        "num_kv_heads", "head_dim", "page_size", "max_pages", "splits", "dtype", "isa", "threads", "prefetch",
        "scale",
    ),
    "cpu_decode_attend_fp8": (
        "q", "k_cache", "v_cache", "k_scales", "v_scales", "block_table", "seq_lens", "out", "workspace",
        "num_seqs", "num_q_heads", "num_kv_heads", "head_dim", "page_size", "max_pages", "splits", "dtype", "isa",
        "threads", "prefetch", "scale",
    ),
    "cpu_decode_attend_latent": (
        "q", "k_cache", "block_table", "seq_lens", "out", "workspace", "num_seqs", "num_q_heads", "head_dim",
        "v_head_dim", "page_size", "max_pages", "splits", "dtype", "isa", "threads", "scale",
    ),
    "cpu_decode_write": (
        "k_cache", "v_cache", "k", "v", "block_table", "positions", "num_new", "num_seqs", "max_new",
        "num_kv_heads", "head_dim", "page_size", "max_pages", "pair", "elem_size",
    ),
    "cpu_decode_write_fp8": (
        "k_cache", "v_cache", "k_scales", "v_scales", "k", "v", "block_table", "positions", "num_new", "num_seqs",
        "max_new", "num_kv_heads", "head_dim", "page_size", "max_pages", "dtype", "isa",
    ),
}  # fmt: skip


def _declare_old(lib: ctypes.CDLL) -> None:
    """The ABI-7 argument types, as cpu_kernel.py declared them at the base revision."""
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


def _git(*args: str) -> bytes:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, check=True).stdout


def build_old(base: str, build: str) -> ctypes.CDLL:
    """The kernel of revision ``base`` in ``build`` (a key of ``cpu_kernel.BUILDS``), compiled with this
    tree's flags for that build (cached per revision, flags and compiler)."""
    cc = ck.find_compiler()
    if cc is None:
        sys.exit("no C compiler found (set CC, or install gcc or clang)")
    try:
        sha = _git("rev-parse", "--verify", "--quiet", f"{base}^{{commit}}").decode().strip()
    except subprocess.CalledProcessError:
        sys.exit(
            f"--base {base!r}: not a commit of this repository (accepted: a revision git knows, e.g. 24377cf)"
        )
    flags = ck.build_flags(build)
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(f"{sha} {' '.join(flags)} {version}".encode()).hexdigest()[:16]
    target = cache_dir() / "cpu_decode" / f"tree-ab-{sha[:12]}-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "csrc"
            src.mkdir()
            for name in _git("ls-tree", "--name-only", sha, "backends/csrc/").decode().split():
                (src / Path(name).name).write_bytes(_git("show", f"{sha}:{name}"))
            so = Path(tmp) / "old.so"
            proc = subprocess.run(
                [cc, *flags, "-I", str(src), "-o", str(so), str(src / "cpu_decode.c"), "-lm"],
                capture_output=True,
                text=True,
            )
            if proc.returncode != 0:
                sys.exit(f"{cc} could not build {base}'s kernel ({build}): {proc.stderr.strip()[:500]}")
            os.replace(so, target)
    lib = ctypes.CDLL(str(target))
    if lib.cpu_decode_abi() != OLD_ABI:
        sys.exit(f"{base}'s kernel has ABI {lib.cpu_decode_abi()}; this script calls ABI {OLD_ABI}")
    _declare_old(lib)
    return lib


@dataclass(frozen=True)
class Side:
    """One build's library: ``old`` (positional, ABI 7) or ``new`` (argument structs, ABI 8)."""

    name: str
    lib: ctypes.CDLL

    def bind(self, fn: str, fields: dict[str, Any]) -> Callable[[], int]:
        """The call of entry point ``fn`` with ``fields`` (the new struct's field names; those a form does
        not take are left out or ignored), ready to run."""
        if self.name == "old":
            f = dict(fields)
            if f.get("fp8_convert") == ck.FP8_CONVERT_CODES["shift"]:
                f["isa"] = ck.FP8_SHIFT_CODE  # ABI 7 carried the shift conversion in isa (both fp8 calls)
            return functools.partial(getattr(self.lib, fn), *(f.get(n) or 0 for n in OLD_ARGS[fn]))
        struct_cls = ck.WriteArgs if fn.startswith("cpu_decode_write") else ck.AttendArgs
        names = {name for name, _ in struct_cls._fields_}
        args = struct_cls(**{k: v for k, v in fields.items() if k in names})
        return functools.partial(getattr(self.lib, fn), ctypes.byref(args))

    def call(self, fn: str, fields: dict[str, Any]) -> int:
        return int(self.bind(fn, fields)())


# -- the cases ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    form: str  # paged, fp8, latent
    variant: str  # a name of ISA_NAMES
    convert: str  # fp8: lookup or shift
    build: str  # native or amx-emulated
    dtype: torch.dtype
    groups: int  # GQA group (latent: the heads)
    head_dim: int  # D (latent: the row, Dk)
    v_head_dim: int  # latent: Dv
    page_size: int
    splits: int
    threads: int
    prefetch: int
    seed: int

    @property
    def label(self) -> str:
        variant = self.variant + (
            f"/{self.convert}" if self.form == "fp8" and self.variant == "c-avx512bf16" else ""
        )
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{self.form:6} {variant:19} {dtype:8} {self.build:12}"


PAGES = (16, 32, 64, 128, 256, 512)
LATENT_PAGES = (16, 32, 64, 128)  # the vector latent items take pages of up to 128 keys
PAGED_GRID = [(g, d) for g in (1, 2, 4, 8) for d in (32, 48, 64, 80, 128)]
FP8_GRID = [(g, d) for g in (1, 2, 4, 8) for d in (32, 64, 96, 128)]
LATENT_GRID = [
    (h, dk, dv, s)
    for h in (1, 4, 16, 20, 64)
    for dk, dv in ((64, 32), (96, 64), (160, 128), (576, 512))
    for s in (1, 4)
]
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def combos(native: ck.Kernel, emulated: ck.Kernel | None) -> list[tuple[str, str, str, str, torch.dtype]]:
    """(form, variant, convert, build, dtype) for every variant this CPU runs."""
    out = []
    for code in range(native.isa + 1):
        name = ck.ISA_NAMES[code]
        for dt in {"c-avx512": (F32, F16), "c-avx512bf16": (BF16,)}.get(name, (F32, F16, BF16)):
            out.append(("paged", name, "lookup", "native", dt))
    out += [("fp8", "c-scalar", "lookup", "native", dt) for dt in (BF16, F32)]
    if native.fp8_level >= 1:
        out += [("fp8", "c-avx512bf16", cv, "native", BF16) for cv in ("lookup", "shift")]
    amx = (
        "native"
        if native.fp8_level >= 2
        else "amx-emulated"
        if emulated and emulated.fp8_level >= 2
        else None
    )
    if amx:
        out.append(("fp8", "c-amx", "lookup", amx, BF16))
    out += [("latent", "c-scalar", "lookup", "native", dt) for dt in (BF16, F32)]
    if native.isa >= ck.ISA_CODES["c-avx512bf16"]:
        out.append(("latent", "c-avx512bf16", "lookup", "native", BF16))
    if amx:
        out.append(("latent", "c-amx", "lookup", amx, BF16))
    return out


def cases(native: ck.Kernel, emulated: ck.Kernel | None) -> list[Case]:
    out = []
    for n, (form, variant, convert, build, dt) in enumerate(combos(native, emulated)):
        if form == "latent":
            for i, (h, dk, dv, s) in enumerate(LATENT_GRID):
                ps = LATENT_PAGES[i % len(LATENT_PAGES)]
                out.append(
                    Case(form, variant, convert, build, dt, h, dk, dv, ps, s, 1 + i % 2, 0, 1000 * n + i)
                )
            continue
        for i, (g, d) in enumerate(PAGED_GRID if form == "paged" else FP8_GRID):
            ps, splits = PAGES[i % len(PAGES)], (1, 4)[i // len(PAGES) % 2]
            out.append(
                Case(
                    form,
                    variant,
                    convert,
                    build,
                    dt,
                    g,
                    d,
                    d,
                    ps,
                    splits,
                    1 + i % 2,
                    (0, 2, 4)[i % 3],
                    1000 * n + i,
                )
            )
    return out


@dataclass
class Inputs:
    """One case's tensors (kept alive while the kernel holds their pointers) and its calls' fields."""

    tensors: dict[str, torch.Tensor]
    writes: list[tuple[str, dict[str, Any]]]
    attend: tuple[str, dict[str, Any]]
    results: tuple[str, ...]  # the tensors compared after the calls


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def paged_inputs(case: Case, batch: int = 3, kv_heads: int = 2, context: int | None = None) -> Inputs:
    """A paged (or fp8) cache of ``batch`` sequences in the kernel's layout, zeroed and written by the
    build's writer (the calls in ``writes``), the query and the output (from ``case.seed``)."""
    gen = torch.Generator().manual_seed(case.seed)
    fp8, dt, ps, d = case.form == "fp8", case.dtype, case.page_size, case.head_dim
    max_len = context or min(3 * ps + 17, 1200)
    if context:  # timing: every sequence at the context
        lens = [context] * batch
    else:  # one at the longest, one anywhere, one short (a tile or two)
        lens = [max_len, int(torch.randint(2, max_len + 1, (1,), generator=gen))]
        lens += [int(torch.randint(2, 41, (1,), generator=gen)) for _ in range(batch - 2)]
    maxp = math.ceil(max_len / ps)
    n_pages = batch * maxp
    t: dict[str, torch.Tensor] = {
        "pages": torch.zeros(n_pages, kv_heads, ps // 16, 2, 16 * d, dtype=torch.uint8 if fp8 else dt),
        "block_table": torch.randperm(n_pages, generator=gen).to(torch.int32).view(batch, maxp).contiguous(),
        "k": torch.randn(batch, max_len, kv_heads, d, generator=gen).to(dt),
        "v": torch.randn(batch, max_len, kv_heads, d, generator=gen).to(dt),
        "q": torch.randn(batch, kv_heads * case.groups, d, generator=gen).to(dt),
        "lens": torch.tensor(lens, dtype=torch.int32),
        "zeros": torch.zeros(batch, dtype=torch.int32),
        "ones": torch.ones(batch, dtype=torch.int32),
        "out": torch.zeros(batch, kv_heads * case.groups, d, dtype=dt),
        "workspace": torch.zeros(batch * kv_heads * ck.MAX_SPLITS * case.groups * (d + 2)),
    }
    if fp8 and case.seed % 5 == 0:
        t["k"][1 % batch, 0, 0, 0] = float("nan")  # a non-finite row: counted by the writer, stored as zeros
    t["prompt"] = t["lens"] - 1
    t["last_k"] = torch.stack([t["k"][b, lens[b] - 1] for b in range(batch)])[:, None].contiguous()
    t["last_v"] = torch.stack([t["v"][b, lens[b] - 1] for b in range(batch)])[:, None].contiguous()
    ptrs = {"k_cache": _ptr(t["pages"]), "v_cache": _ptr(t["pages"][0, 0, 0, 1])}
    isa, convert = ck.ISA_CODES[case.variant], ck.FP8_CONVERT_CODES[case.convert]
    if fp8:
        t["scales"] = torch.zeros(2, n_pages, kv_heads, ps)
        ptrs |= {"k_scales": _ptr(t["scales"][0]), "v_scales": _ptr(t["scales"][1])}
        writer: dict[str, Any] = {"dtype": ck.DTYPE_CODES[dt], "isa": isa, "fp8_convert": convert}
    else:
        writer = {"pair": 2 if dt == BF16 else 1, "elem_size": dt.itemsize}
    shared = {
        **ptrs, "block_table": _ptr(t["block_table"]), "num_seqs": batch, "num_kv_heads": kv_heads, "head_dim": d,
        "page_size": ps, "max_pages": maxp,
    }  # fmt: skip
    write_fn = "cpu_decode_write_fp8" if fp8 else "cpu_decode_write"
    writes = [  # the prompt (all but the last token), then the last token at its position
        (write_fn, {**shared, **writer, "k": _ptr(t["k"]), "v": _ptr(t["v"]), "positions": _ptr(t["zeros"]),
                    "num_new": _ptr(t["prompt"]), "max_new": max_len}),
        (write_fn, {**shared, **writer, "k": _ptr(t["last_k"]), "v": _ptr(t["last_v"]),
                    "positions": _ptr(t["prompt"]), "num_new": _ptr(t["ones"]), "max_new": 1}),
    ]  # fmt: skip
    attend = {
        **shared, "q": _ptr(t["q"]), "seq_lens": _ptr(t["lens"]), "out": _ptr(t["out"]),
        "workspace": _ptr(t["workspace"]), "num_q_heads": kv_heads * case.groups, "splits": case.splits,
        "dtype": ck.DTYPE_CODES[dt], "isa": isa, "fp8_convert": convert, "threads": case.threads,
        "prefetch": case.prefetch, "scale": d**-0.5,
    }  # fmt: skip
    fn = "cpu_decode_attend_fp8" if fp8 else "cpu_decode_attend"
    return Inputs(t, writes, (fn, attend), ("out", "pages", "scales") if fp8 else ("out", "pages"))


def latent_inputs(case: Case, batch: int = 3, context: int | None = None) -> Inputs:
    """Latent rows ``[pages, ps, Dk]`` in random pages, the query and the output (from ``case.seed``)."""
    gen = torch.Generator().manual_seed(case.seed)
    dt, ps, h, dk, dv = case.dtype, case.page_size, case.groups, case.head_dim, case.v_head_dim
    max_len = context or 3 * ps + 17
    lens = [max_len] + [
        context or int(torch.randint(1, max_len + 1, (1,), generator=gen)) for _ in range(batch - 1)
    ]
    maxp = math.ceil(max_len / ps)
    t = {
        "rows": torch.randn(batch * maxp, ps, dk, generator=gen).to(dt),
        "block_table": torch.randperm(batch * maxp, generator=gen)
        .to(torch.int32)
        .view(batch, maxp)
        .contiguous(),
        "q": torch.randn(batch, h, dk, generator=gen).to(dt),
        "lens": torch.tensor(lens, dtype=torch.int32),
        "out": torch.zeros(batch, h, dv, dtype=dt),
        "workspace": torch.zeros(batch * ck.MAX_SPLITS * h * (dv + 2)),
    }
    attend = {
        "q": _ptr(t["q"]), "k_cache": _ptr(t["rows"]), "block_table": _ptr(t["block_table"]),
        "seq_lens": _ptr(t["lens"]), "out": _ptr(t["out"]), "workspace": _ptr(t["workspace"]), "num_seqs": batch,
        "num_q_heads": h, "head_dim": dk, "v_head_dim": dv, "page_size": ps, "max_pages": maxp,
        "splits": case.splits, "dtype": ck.DTYPE_CODES[dt], "isa": ck.ISA_CODES[case.variant],
        "threads": case.threads, "scale": dk**-0.5,
    }  # fmt: skip
    return Inputs(t, [], ("cpu_decode_attend_latent", attend), ("out",))


def inputs(case: Case, **kw: Any) -> Inputs:
    return latent_inputs(case, **kw) if case.form == "latent" else paged_inputs(case, **kw)


def run(case: Case, side: Side) -> tuple[list[int], dict[str, torch.Tensor]]:
    """Each call of ``case`` on ``side`` (fresh inputs): the return codes and the tensors to compare."""
    x = inputs(case)
    rcs = [side.call(fn, fields) for fn, fields in [*x.writes, x.attend]]
    return rcs, {name: x.tensors[name] for name in x.results}


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical: the same shape and dtype and the same bytes (NaN payloads and signed zeros too)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def compare(base: str) -> int:
    native = ck.load_kernel("native")
    if isinstance(native, str):
        sys.exit(native)
    emulated = ck.load_kernel("amx-emulated")
    emulated = None if isinstance(emulated, str) else emulated
    sides: dict[str, tuple[Side, Side]] = {}
    all_cases = cases(native, emulated)
    for build in sorted({c.build for c in all_cases}):
        new = native if build == "native" else emulated
        assert new is not None
        sides[build] = (Side("old", build_old(base, build)), Side("new", new.lib))
    counts: dict[str, list[int]] = {}
    failures: list[str] = []
    started = time.perf_counter()
    for case in all_cases:
        (old_rc, old), (new_rc, new) = (run(case, side) for side in sides[case.build])
        diff = [name for name in old if not same(old[name], new[name])]
        if old_rc != new_rc:
            diff.insert(0, f"return codes {old_rc} vs {new_rc}")
        elif any(rc < 0 for rc in new_rc):
            diff.insert(0, f"refused (return codes {new_rc})")
        row = counts.setdefault(case.label, [0, 0])
        row[0] += 1
        if diff:
            row[1] += 1
            failures.append(f"{case}: {', '.join(diff)}")
    total, bad = sum(r[0] for r in counts.values()), sum(r[1] for r in counts.values())
    print(
        f"kernel tree vs {base} (single file, ABI {OLD_ABI}): bit-identical outputs, caches, scales, return codes"
    )
    print(f"{'form':6} {'variant':19} {'dtype':8} {'build':12} {'cases':>5} {'differ':>6}")
    for label, (n, d) in counts.items():
        print(f"{label} {n:5} {d:6}")
    print(f"{total} cases, {bad} with differences ({time.perf_counter() - started:.0f} s)")
    for line in failures[:20]:
        print("DIFFERS:", line, file=sys.stderr)
    return 1 if bad else 0


# -- the A/B timing ----------------------------------------------------------------------------------------
def _cpu_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next(
        (line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []
    )
    return sorted({f for f in flags if f.startswith(("avx512", "amx"))})


def ab_shapes(native: ck.Kernel, quick: bool) -> list[tuple[str, Case, int, int]]:
    """(label, case, batch, context) of the timed shapes this CPU runs with a vector variant."""
    llama = Workload.uniform("llama-3.1-8b", batch=1, context=1024, dtype="bf16").geometry("expanded")
    mla = Workload.uniform("deepseek-v3", batch=1, context=1024, dtype="bf16").geometry("latent")
    group = llama.num_q_heads // llama.num_kv_heads
    paged_isa = "c-avx512bf16" if native.isa >= ck.ISA_CODES["c-avx512bf16"] else ck.ISA_NAMES[native.isa]
    shapes: list[tuple[str, Case]] = [
        (
            "bf16 paged, llama-3.1-8b",
            Case("paged", paged_isa, "lookup", "native", BF16, group, 128, 128, 128, 1, 1, 2, 1),
        ),
    ]
    if native.fp8_level >= 1:
        fp8 = Case("fp8", "c-avx512bf16", "shift", "native", BF16, group, 128, 128, 128, 1, 1, 2, 2)
        shapes.append(("fp8 shift, llama-3.1-8b", fp8))
    if native.isa >= ck.ISA_CODES["c-avx512bf16"]:
        variant = "c-amx" if native.fp8_level >= 2 else "c-avx512bf16"
        latent = Case(
            "latent",
            variant,
            "lookup",
            "native",
            BF16,
            mla.num_q_heads,
            mla.qk_head_dim,
            mla.v_head_dim,
            64,
            1,
            1,
            0,
            3,
        )
        shapes.append(("latent, deepseek-v3", latent))
    batches, context = ((1,), 1024) if quick else ((1, 8), 8192)
    return [(label, case, b, context) for label, case in shapes for b in batches]


def time_ab(old: Side, new: Side, case: Case, batch: int, context: int, rounds: int) -> dict[str, Any]:
    """Alternate the two builds on the same inputs (the new build's writer fills the cache once): per
    round each runs a block of calls (about 50 ms), old first in even rounds, new first in odd ones."""
    kw: dict[str, Any] = {"batch": batch, "context": context}
    if case.form != "latent":
        kw["kv_heads"] = 8
    x = inputs(case, **kw)
    for fn, fields in x.writes:
        new.call(fn, fields)
    fn, fields = x.attend
    calls = {"old": old.bind(fn, fields), "new": new.bind(fn, fields)}
    for call in calls.values():  # warm up; a refusal stops here
        rc = call()
        if rc != 0:
            raise RuntimeError(f"{fn} returned {rc}")
    started = time.perf_counter()
    calls["new"]()
    reps = max(1, int(0.05 / max(time.perf_counter() - started, 1e-6)))
    times: dict[str, list[float]] = {"old": [], "new": []}
    for r in range(rounds):
        for name in ("old", "new") if r % 2 == 0 else ("new", "old"):
            call = calls[name]
            started = time.perf_counter()
            for _ in range(reps):
                call()
            times[name].append((time.perf_counter() - started) / reps)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    return {
        "batch": batch,
        "context": context,
        "variant": case.variant + (f"/{case.convert}" if case.form == "fp8" else ""),
        "calls_per_round": reps,
        "old_ms": med["old"] * 1e3,
        "new_ms": med["new"] * 1e3,
        "new_over_old": med["new"] / med["old"],
        "old_ms_all": [t * 1e3 for t in times["old"]],
        "new_ms_all": [t * 1e3 for t in times["new"]],
    }


def ab(base: str, rounds: int, quick: bool, out: Path, argv: list[str]) -> int:
    native = ck.load_kernel("native")
    if isinstance(native, str):
        sys.exit(native)
    old, new = Side("old", build_old(base, "native")), Side("new", native.lib)
    torch.set_num_threads(1)
    load_start = os.getloadavg()
    started = time.perf_counter()
    rows = []
    for label, case, batch, context in ab_shapes(native, quick):
        row = {"shape": label, **time_ab(old, new, case, batch, context, rounds)}
        rows.append(row)
        print(
            f"{label:28} b={batch} ctx={context}: old {row['old_ms']:.3f} ms, new {row['new_ms']:.3f} ms, "
            f"new/old {row['new_over_old']:.3f}"
        )
    record = {
        "command": "python scripts/kernel_tree_ab.py " + shlex.join(argv),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.platform(),
        "cpu": fingerprint("cpu").get("name", "unknown"),
        "cpu_flags": _cpu_flags(),
        "base": base,
        "threads": 1,
        "rounds": rounds,
        "quick": quick,
        "load_start": [round(x, 2) for x in load_start],
        "load_end": [round(x, 2) for x in os.getloadavg()],
        "wall_s": time.perf_counter() - started,
        "rows": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    out.with_suffix(".md").write_text(_markdown(record))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    return 0


def _markdown(record: dict[str, Any]) -> str:
    lines = [
        f"# cpu_decode: the source tree against the single-file kernel ({record['base']}), interleaved A/B",
        "",
        f"- command: `{record['command']}`",
        f"- date: {record['date']}",
        f"- machine: {record['machine']} ({record['cpu']}; flags: {' '.join(record['cpu_flags']) or 'none'})",
        f"- one thread; {record['rounds']} rounds, each build's block of calls alternating first and second",
        f"- load average at start / end: {record['load_start']} / {record['load_end']}",
        f"- wall time: {record['wall_s']:.0f} s",
        "",
        "| shape | variant | batch | context | old ms / call | new ms / call | new / old |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in record["rows"]:
        lines.append(
            f"| {r['shape']} | {r['variant']} | {r['batch']} | {r['context']} | {r['old_ms']:.3f} | "
            f"{r['new_ms']:.3f} | {r['new_over_old']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--compare", action="store_true", help="bit-identity over every case this CPU runs")
    mode.add_argument("--ab", action="store_true", help="interleaved timing of the two builds")
    ap.add_argument(
        "--base", default=DEFAULT_BASE, help=f"the single-file kernel's revision (default {DEFAULT_BASE})"
    )
    ap.add_argument("--rounds", type=positive_int, default=21, help="--ab rounds (default 21)")
    ap.add_argument("--quick", action="store_true", help="--ab smoke run: batch 1, 1k context, 3 rounds")
    ap.add_argument(
        "--out", default="results/cpu/kernels/kernel-tree-ab", help="--ab's <out>.json and <out>.md"
    )
    args = ap.parse_args(argv)
    if args.compare:
        return compare(args.base)
    return ab(
        args.base,
        3 if args.quick else args.rounds,
        args.quick,
        Path(args.out),
        sys.argv[1:] if argv is None else argv,
    )


if __name__ == "__main__":
    raise SystemExit(main())
