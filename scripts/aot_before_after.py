"""The AOT table before and after the split-KV unification, from the compiler: registers, spill bytes
(local + stack), 16-byte global loads and the programs that fit on one SM (from registers, shared
memory and warps: ``triton_decode_aot.resident_programs``), for sm_80 and sm_90.

"Before" compiles the three per-backend kernels as they were in git history (``--before``, default
the parent of the unification commit: ``_paged_decode_kernel``, ``_fp8_paged_decode_kernel``,
``_mla_decode_partial``, ``_split_reduce_kernel``, ``_mla_decode_merge``, read with ``git show`` and
compiled with the signatures and alignment hints their modules declared); "after" compiles the family
kernel of :mod:`attnbench.kernels.triton_decode` at the same geometry (``triton_decode_aot.specialization``).
Needs git and the repository's history; no GPU::

    python scripts/aot_before_after.py            # Markdown tables and the count of worse comparisons
    python scripts/aot_before_after.py --out results/aot/aot-before-after   # also saved (docs_tables.py
                                                  # copies its sections into the docs)
"""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import triton

from attnbench.backends import fp8, mla, triton_paged
from attnbench.cli.common import run_record, write_report
from attnbench.correctness.aot import (
    TL_DTYPE,
    merge_specialization,
    resident_programs,
    specialization,
    spill_bytes,
)
from attnbench.kernels.triton_decode import DecodeSpec, pow2
from attnbench.kernels.triton_utils import AotResult, aot_compile_many

UNIFICATION = "6be7b6a"  # "One split-KV Triton decode family ..."
OLD_KERNELS = {
    "backends/triton_paged.py": ("_paged_decode_kernel", "_split_reduce_kernel"),
    "backends/fp8.py": ("_fp8_paged_decode_kernel",),
    "backends/mla.py": ("_mla_decode_partial", "_mla_decode_merge"),
}
ARCHS = (80, 90)


def load_old_kernels(commit: str, folder: Path) -> Any:
    """The old ``@triton.jit`` functions, cut out of ``git show commit:path`` into one module file."""
    parts = ["import triton", "import triton.language as tl"]
    for path, names in OLD_KERNELS.items():
        src = subprocess.run(["git", "show", f"{commit}:{path}"], capture_output=True, text=True, check=True)
        lines = src.stdout.splitlines()
        for node in ast.walk(ast.parse(src.stdout)):
            if isinstance(node, ast.FunctionDef) and node.name in names:
                start = min(d.lineno for d in node.decorator_list) - 1
                body = lines[start : node.end_lineno]
                indent = len(body[0]) - len(body[0].lstrip())
                parts.append("\n".join(line[indent:] for line in body))
    file = folder / "old_decode_kernels.py"
    file.write_text("\n\n\n".join(parts) + "\n")
    sys.path.insert(0, str(folder))
    import old_decode_kernels  # type: ignore[import-not-found]

    return old_decode_kernels


def _signature(args: list[tuple[str, str]], t: str, constexprs: dict[str, Any]) -> dict[str, str]:
    return {n: k.format(t=t) for n, k in args} | dict.fromkeys(constexprs, "constexpr")


_I32 = "i32"
_STRIDES = (
    "stride_qb",
    "stride_qh",
    "stride_kp",
    "stride_kt",
    "stride_kh",
    "stride_vp",
    "stride_vt",
    "stride_vh",
)
_PAGED = [("q_ptr", "*{t}"), ("k_ptr", "*{t}"), ("v_ptr", "*{t}"), ("block_table_ptr", "*i32")]
_PAGED += [("lens_ptr", "*i32"), ("out_ptr", "*{t}"), ("part_o_ptr", "*fp32"), ("part_m_ptr", "*fp32")]
_PAGED += [("part_l_ptr", "*fp32"), ("scale_log2e", "fp32")]
_PAGED += [(s, _I32) for s in (*_STRIDES, "stride_bt", "stride_ob", "stride_oh", "direct")]
_PAGED_ALIGNED = ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "part_o_ptr", *_STRIDES, "stride_ob", "stride_oh")
_FP8 = [("q_ptr", "*{t}"), ("k_ptr", "*u8"), ("v_ptr", "*u8"), ("ks_ptr", "*fp32"), ("vs_ptr", "*fp32")]
_FP8 += [("block_table_ptr", "*i32"), ("lens_ptr", "*i32"), ("out_ptr", "*{t}"), ("part_o_ptr", "*fp32")]
_FP8 += [("part_m_ptr", "*fp32"), ("part_l_ptr", "*fp32"), ("scale_log2e", "fp32"), ("page_size", _I32)]
_FP8 += [
    (s, _I32)
    for s in (*_STRIDES, "stride_sp", "stride_st", "stride_sh", "stride_bt", "stride_ob", "stride_oh")
]
_FP8_ALIGNED = (
    "q_ptr",
    "k_ptr",
    "v_ptr",
    "ks_ptr",
    "vs_ptr",
    "out_ptr",
    "part_o_ptr",
    "page_size",
    *_STRIDES,
)
_FP8_ALIGNED += ("stride_ob", "stride_oh")


def _request(
    kernel: Any, sig: dict[str, str], constexprs: dict[str, Any], aligned: Any, warps: int, stages: int
):
    return {"kernel": kernel, "signature": sig, "constexprs": constexprs, "aligned": tuple(aligned),
            "num_warps": warps, "num_stages": stages}  # fmt: skip


def old_paged(old: Any, dtype: torch.dtype, group: int, dk: int, dv: int, page: int, block_n: int) -> dict:
    c = {"GROUP": group, "BLOCK_G": pow2(group), "DK": dk, "DV": dv, "BLOCK_DK": pow2(dk), "BLOCK_DV": pow2(dv),
         "PAGE_SIZE": page, "BLOCK_N": block_n, "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
         "DOT_F32": False}  # fmt: skip
    sig = _signature(_PAGED, TL_DTYPE[dtype], c)
    return _request(old._paged_decode_kernel, sig, c, _PAGED_ALIGNED, 4, 2)


def old_fp8(old: Any, dtype: torch.dtype, block_n: int, *, direct: bool) -> dict:
    c = {"GROUP": 4, "BLOCK_G": 16, "DK": 128, "DV": 128, "BLOCK_DK": 128, "BLOCK_DV": 128, "BLOCK_N": block_n,
         "DIRECT": direct, "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32"}  # fmt: skip
    return _request(old._fp8_paged_decode_kernel, _signature(_FP8, TL_DTYPE[dtype], c), c, _FP8_ALIGNED, 4, 2)


def old_mla(old: Any, tile: str, dtype: torch.dtype) -> dict:
    t, ty = mla.effective_tile(tile, dtype), TL_DTYPE[dtype]
    c = {"DV": 512, "DPE": 64, "BLOCK_DV": 512, "BLOCK_DPE": 64, "BLOCK_H": t.block_h, "BLOCK_N": t.block_n,
         "PAGE_SIZE": 64, "NUM_SPLITS": 8, "EXACT": dtype == torch.float32}  # fmt: skip
    ptrs = {"Q": f"*{ty}", "KV": f"*{ty}", "BlockTable": "*i32", "SeqLens": "*i32", "PartialO": "*fp32"}
    ptrs["PartialLse"] = "*fp32"
    names = list(old._mla_decode_partial.arg_names)
    sig = {n: "constexpr" if n in c else ptrs.get(n, "fp32" if n == "scale" else _I32) for n in names}
    hints = {"stride_qb", "stride_qh", "stride_kvp", "stride_kvt", "stride_pob", "stride_poh", "stride_pos"}
    aligned = [n for n in names if n in ptrs or n in hints | {"num_heads"}]
    return _request(old._mla_decode_partial, sig, c, aligned, t.num_warps, t.num_stages)


def old_merges(old: Any) -> list[dict]:
    c = {"DV": 128, "BLOCK_DV": 128, "BLOCK_S": 16}  # the old MAX_SPLITS, max(NUM_SPLITS) = 16
    sig = {"part_o_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "out_ptr": "*bf16"}
    sig |= {"num_splits": _I32, "stride_ob": _I32, "stride_oh": _I32} | dict.fromkeys(c, "constexpr")
    reduce = _request(
        old._split_reduce_kernel, sig, c, ("part_o_ptr", "out_ptr", "stride_ob", "stride_oh"), 4, 2
    )
    c = {"DV": 512, "BLOCK_DV": 512, "NUM_SPLITS": 8}
    names = list(old._mla_decode_merge.arg_names)
    ptrs = {"PartialO": "*fp32", "PartialLse": "*fp32", "Out": "*bf16"}
    sig = {n: "constexpr" if n in c else ptrs.get(n, _I32) for n in names}
    hints = set(ptrs) | {"stride_pob", "stride_poh", "stride_pos", "stride_ob", "stride_oh"}
    return [reduce, _request(old._mla_decode_merge, sig, c, [n for n in names if n in hints], 4, 1)]


def rows(old: Any) -> list[tuple[str, str, list[dict], dict]]:
    """(table, row name, the old specialisations it replaced, the family's) for every compared row."""
    bf16, out = torch.bfloat16, []
    for page in triton_paged.PAGE_SIZES:
        for n in triton_paged.BLOCK_N:
            new = specialization(DecodeSpec(4, 128, 128, page, n), bf16)
            out.append(
                (
                    "paged",
                    f"GROUP 4, D 128×128, page {page}, block_n {n}",
                    [old_paged(old, bf16, 4, 128, 128, page, n)],
                    new,
                )
            )
    for dtype, g, dk, dv in triton_paged.AOT_GEOMETRIES:
        name = f"GROUP {g}, D {dk}×{dv}, page 16, block_n 32, {TL_DTYPE[dtype]}"
        out.append(
            (
                "paged",
                name,
                [old_paged(old, dtype, g, dk, dv, 16, 32)],
                specialization(DecodeSpec(g, dk, dv, 16, 32), dtype),
            )
        )
    for dtype in (bf16, torch.float16, torch.float32):
        for n in fp8.BLOCK_N:
            new = specialization(DecodeSpec(4, 128, 128, 64, n, kv_fp8=True), dtype)
            olds = [old_fp8(old, dtype, n, direct=True), old_fp8(old, dtype, n, direct=False)]
            out.append(("fp8", f"{TL_DTYPE[dtype]}, block_n {n} (old: one split / splits)", olds, new))
    for tile in mla.TILES:
        for dtype in (bf16, torch.float32):
            new = specialization(mla.decode_spec(tile, dtype, heads=128, dk=576, dv=512, page_size=64), dtype)
            out.append(("mla", f"{tile}, {TL_DTYPE[dtype]}", [old_mla(old, tile, dtype)], new))
    reduce, merge = old_merges(old)
    out.append(("merge", "Dv 128 (old: _split_reduce_kernel)", [reduce], merge_specialization(128, bf16)))
    out.append(("merge", "Dv 512 (old: _mla_decode_merge)", [merge], merge_specialization(512, bf16)))
    return out  # fmt: skip


def _figures(r: AotResult | Exception) -> tuple[int, int, int, int, int]:
    if isinstance(r, Exception):
        raise r
    wide = sum(n for op, n in r.global_loads().items() if op.endswith(".128"))
    return r.registers or 0, spill_bytes(r), wide, resident_programs(r) or 0, r.shared_bytes or 0


_FIGURES = ("registers", "spill bytes", "16-B loads", "programs per SM", "shared bytes")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--before", default=f"{UNIFICATION}^", help="commit of the old kernels (default: %(default)s)"
    )
    p.add_argument(
        "--out",
        metavar="PATH",
        help="also write PATH.md (the tables under the command, machine and date) and PATH.json",
    )
    args = p.parse_args(argv)
    known = subprocess.run(
        ["git", "rev-parse", "--verify", "--quiet", f"{args.before}^{{commit}}"], capture_output=True
    )
    if known.returncode != 0:
        p.error(
            f"--before {args.before!r}: not a commit of this repository (accepted: a commit that holds "
            f"the per-backend kernels, e.g. the default {UNIFICATION}^)"
        )
    load_start, started = os.getloadavg(), time.time()
    with tempfile.TemporaryDirectory() as tmp:
        old = load_old_kernels(args.before, Path(tmp))
        table = rows(old)
        requests = [{**s, "arch": a} for _, _, olds, new in table for s in [*olds, new] for a in ARCHS]
        results = iter(aot_compile_many(requests))
        figures = [
            [[_figures(next(results)) for _ in ARCHS] for _ in [*olds, new]] for _, _, olds, new in table
        ]
    worse = dict.fromkeys(_FIGURES[:4], 0)
    comparisons, current, worse_rows, lines = 0, None, [], []
    for (kind, name, _, _), figs in zip(table, figures, strict=True):
        if kind != current:
            current = kind
            lines += [f"\n#### {kind}\n"]
            lines += [
                "| specialisation | registers sm_80 / sm_90 | spill bytes sm_80 / sm_90 "
                "| 16-B loads sm_80 / sm_90 | programs per SM sm_80 / sm_90 | shared bytes (sm_90) |",
                "| --- | --- | --- | --- | --- | --- |",
            ]
        *olds, new = figs
        cells = []
        for i in range(4):
            cells.append(
                " / ".join(f"{'|'.join(str(o[a][i]) for o in olds)} → {new[a][i]}" for a in range(len(ARCHS)))
            )
        shared = f"{' · '.join(str(o[-1][4]) for o in olds)} → {new[-1][4]}"
        lines += [f"| {name} | " + " | ".join(c.replace("|", " · ") for c in cells) + f" | {shared} |"]
        for o in olds:
            for a in range(len(ARCHS)):
                comparisons += 1
                if new[a][0] > o[a][0]:
                    worse_rows.append(
                        f"{kind} {name} sm_{ARCHS[a]}: registers {o[a][0]} → {new[a][0]}, spill bytes "
                        f"{o[a][1]} → {new[a][1]}, programs per SM {o[a][3]} → {new[a][3]}"
                    )
                worse["registers"] += new[a][0] > o[a][0]
                worse["spill bytes"] += new[a][1] > o[a][1]
                worse["16-B loads"] += new[a][2] < o[a][2]
                worse["programs per SM"] += new[a][3] < o[a][3]
    lines += [
        "\n#### summary\n",
        "registers higher now:\n" + ("\n".join(f"- {w}" for w in worse_rows) or "- none"),
    ]
    lines += [
        f"\ncomparisons (old binary × arch): {comparisons}; worse now: "
        + ", ".join(f"{k} {v}" for k, v in worse.items())
    ]
    print("\n".join(lines))
    if args.out:
        command = "python scripts/aot_before_after.py" + (
            f" --before {args.before}" if args.before != f"{UNIFICATION}^" else ""
        )
        record = run_record(command=command, load_start=load_start, started=started)
        record |= {"triton": triton.__version__, "archs": list(ARCHS), "comparisons": comparisons}
        record["worse"] = worse
        record["rows"] = [
            {"kind": kind, "name": name, "archs": {f"sm_{a}": [dict(zip(_FIGURES, f[i], strict=True))
             for f in figs] for i, a in enumerate(ARCHS)}}
            for (kind, name, _, _), figs in zip(table, figures, strict=True)
        ]  # fmt: skip
        head = [
            "# AOT before and after the split-KV unification",
            "",
            f"`{command}` · {record['machine']} · {record['date']} · torch {record['torch']}, triton "
            f"{record['triton']} (compiled ahead of time for sm_80 and sm_90, no GPU; the old kernels "
            f"from `{args.before}`; each cell: old → family, per architecture; programs per SM from "
            "registers, shared memory and warps)",
        ]
        write_report(args.out, record, "\n".join(head + lines) + "\n")
        print(f"wrote {args.out}.md and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
