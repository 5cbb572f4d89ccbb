"""Compile the ``mla`` backend's kernels — the split-KV family kernel in its latent form, and the family's
merge — for sm_80 and sm_90 (no GPU needed) and print a table of registers, spills, shared memory and
16-byte global loads for every declared tile (DeepSeek-V3 dims: 128 heads, rows of 512 + 64, bf16)::

    python scripts/mla_aot.py
"""

from __future__ import annotations

import torch

from attnbench.backends.mla import TILES, decode_spec
from attnbench.core.device import fingerprint
from attnbench.correctness.aot import merge_specialization, specialization, spill_bytes
from attnbench.kernels.triton_utils import aot_compile_many


def main() -> None:
    fp = fingerprint("cpu")
    print(f"triton {fp['triton']}, torch {fp['torch']}, compiled on: {fp['name']} (no GPU needed)\n")
    print("| tile | arch | kernel | registers | spill bytes | shared bytes | 16-byte global loads |")
    print("|---|---|---|---:|---:|---:|---:|")
    bf16 = torch.bfloat16
    jobs = [
        (tile, arch, specialization(decode_spec(tile, bf16, heads=128, dk=576, dv=512, page_size=64), bf16))
        for tile in TILES
        for arch in (80, 90)
    ]
    jobs += [("(merge)", arch, merge_specialization(512, bf16)) for arch in (80, 90)]
    for (tile, arch, _), r in zip(
        jobs, aot_compile_many([{**s, "arch": a} for _, a, s in jobs]), strict=True
    ):
        if isinstance(r, Exception):
            print(f"| {tile} | sm_{arch} | FAILED: {str(r).splitlines()[0][:80]} | | | | |")
            continue
        wide = sum(n for op, n in r.global_loads().items() if op.endswith(".128"))
        print(
            f"| {tile} | sm_{arch} | {r.kernel} | {r.registers} | {spill_bytes(r)} | {r.shared_bytes} | {wide} |"
        )


if __name__ == "__main__":
    main()
