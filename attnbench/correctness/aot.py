"""Ahead-of-time specialisations of the split-KV decode family (:mod:`attnbench.kernels.triton_decode`).

:func:`specialization` gives the keyword arguments of :func:`attnbench.kernels.triton_utils.aot_compile` for one
:class:`~attnbench.kernels.triton_decode.DecodeSpec` in one compute dtype; :func:`covering_specializations`
is the set the tests compile for sm_80 and sm_90: every value of every constexpr at least once (each
page size, tile, dtype, cache dtype, form) and the geometries that stress
registers, not the whole product (one split or several is a run-time flag, not a specialisation). :func:`merge_specialization` is the split merge (one for every
split count).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from attnbench.kernels.triton_decode import (
    MERGE_WARPS,
    DecodeSpec,
    decode_constexprs,
    merge_constexprs,
    split_kv_decode_kernel,
    split_merge_kernel,
)
from attnbench.kernels.triton_utils import AotResult, aot_compile_many

__all__ = [
    "TL_DTYPE",
    "aot_markdown",
    "covering_specializations",
    "merge_specialization",
    "resident_programs",
    "spec_id",
    "specialization",
    "spill_bytes",
    "spills_expected",
]

TL_DTYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}

_POINTERS: tuple[str, ...] = ("q_ptr", "k_ptr", "v_ptr", "ks_ptr", "vs_ptr", "block_table_ptr", "lens_ptr")
_POINTERS += ("out_ptr", "part_o_ptr", "part_lse_ptr")
_STRIDES = (
    "stride_qb", "stride_qh", "stride_kp", "stride_kt", "stride_kh", "stride_vp", "stride_vt", "stride_vh",
    "stride_sp", "stride_st", "stride_sh", "stride_bt", "stride_ob", "stride_oh", "stride_lb", "stride_lh",
)  # fmt: skip
#: what the JIT sees as multiples of 16 at run time for head_dim 128 / DeepSeek-V3's latent rows
#: (torch pointers are 16-byte aligned); the scale and block-table strides are not
_ALIGNED: tuple[str, ...] = ("q_ptr", "k_ptr", "v_ptr", "ks_ptr", "vs_ptr", "out_ptr", "part_o_ptr")
_ALIGNED += ("part_lse_ptr", "stride_qb", "stride_qh", "stride_kp", "stride_kt", "stride_vp", "stride_vt")
_ALIGNED += ("stride_ob", "stride_oh", "stride_lb", "stride_lh")


def specialization(spec: DecodeSpec, dtype: torch.dtype) -> dict[str, Any]:
    """``aot_compile`` keyword arguments of the decode kernel for ``spec`` in compute ``dtype`` (one
    binary for one split and for several: ``direct`` is a run-time flag)."""
    t = TL_DTYPE[dtype]
    kv = "u8" if spec.kv_fp8 else t
    types = {"q_ptr": t, "k_ptr": kv, "v_ptr": kv, "out_ptr": t, "block_table_ptr": "i32", "lens_ptr": "i32"}
    sig = {p: "*" + types.get(p, "fp32") for p in _POINTERS}
    sig |= {"scale_log2e": "fp32"} | dict.fromkeys(_STRIDES, "i32") | {"direct": "i32"}
    constexprs = decode_constexprs(spec, dtype)
    aligned = [n for n in _ALIGNED if spec.kv_fp8 or n not in ("stride_kh", "stride_vh")]
    if spec.kv_fp8 or spec.dk % 16 == 0:  # a head's row starts 16 bytes after the previous one
        aligned += ["stride_kh", "stride_vh"]
    return {
        "kernel": split_kv_decode_kernel,
        "signature": sig | dict.fromkeys(constexprs, "constexpr"),
        "constexprs": constexprs,
        "num_warps": spec.num_warps,
        "num_stages": spec.num_stages,
        "aligned": tuple(aligned),
    }


def merge_specialization(dv: int, dtype: torch.dtype) -> dict[str, Any]:
    """``aot_compile`` keyword arguments of the split merge for output width ``dv``."""
    constexprs = merge_constexprs(dv)
    sig = {
        "part_o_ptr": "*fp32",
        "part_lse_ptr": "*fp32",
        "out_ptr": f"*{TL_DTYPE[dtype]}",
        "num_splits": "i32",
    }
    strides = ("stride_lb", "stride_lh", "stride_ob", "stride_oh")
    sig |= dict.fromkeys(strides, "i32")
    return {
        "kernel": split_merge_kernel,
        "signature": sig | dict.fromkeys(constexprs, "constexpr"),
        "constexprs": constexprs,
        "num_warps": MERGE_WARPS,
        "num_stages": 2,
        "aligned": ("part_o_ptr", "part_lse_ptr", "out_ptr", *strides),
    }


def spill_bytes(r: AotResult) -> int:
    """Bytes a compiled kernel keeps in local memory: ``cuobjdump``'s LOCAL plus its STACK frame, where
    ptxas puts register spills (the kernels make no calls, so a stack frame is spills)."""
    return (r.local_bytes or 0) + (r.stack_bytes or 0)


#: per SM of sm_80 / sm_90 (CUDA's occupancy rules): registers, their allocation unit per warp,
#: shared memory, the shared memory the runtime reserves per program (bytes), warps, programs
_SM_LIMITS = {80: (65536, 256, 167936, 1024, 64, 32), 90: (65536, 256, 233472, 1024, 64, 32)}


def resident_programs(r: AotResult) -> int | None:
    """Programs of one compiled kernel that fit on an SM at once: the least of what its registers
    (allocated per warp in units of 256, i.e. rounded up to 8 per thread), its shared memory, its warps
    and the program limit allow. ``None`` without the register count (no ``cuobjdump``)."""
    if r.registers is None or r.arch not in _SM_LIMITS:
        return None
    regs, unit, smem, reserved, warps, programs = _SM_LIMITS[r.arch]
    per_warp = -(-r.registers * 32 // unit) * unit
    by_regs = (regs // per_warp) // r.num_warps
    by_smem = smem // ((r.shared_bytes or 0) + reserved)
    return min(by_regs, by_smem, warps // r.num_warps, programs)


def spills_expected(request: Mapping[str, Any]) -> bool:
    """The specialisations known to spill on sm_80 and sm_90: float32 compute (``DOT_PRECISION="ieee"``,
    FMA dots, no tensor cores) with fp8 pages or in the latent form. They spilled before the
    unification too (docs/fp8.md, docs/mla.md); the tests check that they still do, so that this list
    stays true."""
    c = request["constexprs"]
    return c.get("DOT_PRECISION") == "ieee" and bool(c.get("KV_FP8") or c.get("LATENT"))


def spec_id(request: dict[str, Any]) -> str:
    """A short, unique name of a specialisation (for test ids and tables)."""
    c = request["constexprs"]
    if "PAGE_SIZE" not in c:
        return f"merge-{request['signature']['out_ptr'].lstrip('*')}-dv{c['DV']}"
    form = "latent" if c["LATENT"] else "fp8" if c["KV_FP8"] else "paged"
    dtype = request["signature"]["q_ptr"].lstrip("*")
    return (
        f"{form}-{dtype}-g{c['GROUP']}x{c['BLOCK_G']}-d{c['DK']}x{c['DV']}-page{c['PAGE_SIZE']}"
        f"-n{c['BLOCK_N']}-w{request['num_warps']}"
    )


def covering_specializations() -> Iterator[dict[str, Any]]:
    """Every constexpr value at least once, for the three backends of the family (see the module doc)."""
    from attnbench.backends import fp8, mla, triton_paged  # the backends declare their own choices

    bf16 = torch.bfloat16
    base = DecodeSpec(group=4, dk=128, dv=128, page_size=16, block_n=32)
    for page_size in triton_paged.PAGE_SIZES:  # each page size once (in-page tiles and per-token pages)
        yield specialization(DecodeSpec(4, 128, 128, page_size, 32), bf16)
    for block_n in triton_paged.BLOCK_N:  # each other tile once, within a page (n32: the loop above)
        if block_n != base.block_n:
            yield specialization(DecodeSpec(4, 128, 128, 64, block_n), bf16)
    for dtype, group, dk, dv in triton_paged.AOT_GEOMETRIES:
        yield specialization(DecodeSpec(group, dk, dv, base.page_size, base.block_n), dtype)
    for dtype in (torch.float32, torch.float16, bf16):  # fp8 pages in every compute dtype
        for block_n in fp8.BLOCK_N:
            spec = DecodeSpec(4, 128, 128, 64, block_n, kv_fp8=True)
            yield specialization(spec, dtype)
    for name in mla.TILES:  # the latent form: every declared tile, DeepSeek-V3's 128 heads, 512 + 64
        yield specialization(mla.decode_spec(name, bf16, heads=128, dk=576, dv=512, page_size=64), bf16)
    spec32 = mla.decode_spec(next(iter(mla.TILES)), torch.float32, heads=128, dk=576, dv=512, page_size=16)
    yield specialization(spec32, torch.float32)
    for dv in (128, 512):
        yield merge_specialization(dv, bf16)


#: what ``python -m attnbench.correctness.aot`` compiles by default
aot_specializations = covering_specializations


# -- a report: ``python -m attnbench.correctness.aot [MODULE]`` ------------------------------------
def aot_markdown(rows: Sequence[tuple[Mapping[str, Any], AotResult | Exception]]) -> str:
    """A Markdown table of compile results: registers, local memory (spills), shared memory, loads."""
    lines = [
        "| kernel | arch | first pointer | specialisation | warps | registers | spill bytes (local + stack) | shared bytes "
        "| 16-byte global loads | other global loads |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for request, r in rows:
        spec = ", ".join(
            f"{k}={v}"
            for k, v in request["constexprs"].items()
            if k.isupper() and not k.startswith(("BLOCK_D", "DOT_"))
        )
        name = getattr(getattr(request["kernel"], "fn", request["kernel"]), "__name__", "?")
        arch = f"sm_{request.get('arch', 90)}"
        ptr = next((t.lstrip("*") for t in request["signature"].values() if t.startswith("*")), "")
        if isinstance(r, Exception):
            lines.append(
                f"| {name} | {arch} | {ptr} | {spec} | | FAILED: {str(r).splitlines()[0][:80]} | | | | |"
            )
            continue
        loads = r.global_loads()
        wide = ", ".join(f"{op} ×{n}" for op, n in loads.items() if op.endswith(".128")) or "none"
        other = ", ".join(f"{op} ×{n}" for op, n in loads.items() if not op.endswith(".128")) or "none"
        lines.append(
            f"| {name} | {arch} | {ptr} | {spec} | {r.num_warps} | {r.registers} | {spill_bytes(r)} | {r.shared_bytes} "
            f"| {wide} | {other} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Compile every specialisation a module declares (its ``aot_specializations()``) for sm_80 and
    sm_90 and print the Markdown table; exit status 1 if any failed."""

    p = argparse.ArgumentParser(prog="python -m attnbench.correctness.aot", description=main.__doc__)
    p.add_argument(
        "module",
        nargs="?",
        default=__name__,
        help="module with aot_specializations() (default: this one, the split-KV family's covering set)",
    )
    p.add_argument("--arch", default="80,90", help="comma-separated SM versions (default: %(default)s)")
    args = p.parse_args(argv)
    specs = list(importlib.import_module(args.module).aot_specializations())
    requests = [{**s, "arch": int(a)} for a in args.arch.split(",") for s in specs]
    results = aot_compile_many(requests)
    print(aot_markdown(list(zip(requests, results, strict=True))))
    return 1 if any(isinstance(r, Exception) for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
