"""Compile the ``mla`` backend's Triton kernels for sm_80 and sm_90 (no GPU needed) and print a table of
registers, spills, shared memory and 16-byte global loads for every declared tile (DeepSeek-V3 dims, bf16)::

    python scripts/mla_aot.py
"""

from __future__ import annotations

import torch

from attnbench.backends.mla import TILES, kernel_specs
from attnbench.device import fingerprint
from attnbench.triton_utils import aot_compile


def main() -> None:
    fp = fingerprint("cpu")
    print(f"triton {fp['triton']}, torch {fp['torch']}, compiled on: {fp['name']} (no GPU needed)\n")
    print("| tile | arch | kernel | registers | spill bytes | shared bytes | 16-byte global loads |")
    print("|---|---|---|---:|---:|---:|---:|")
    for tile in TILES:
        for arch in (80, 90):
            for spec in kernel_specs(tile=tile, dtype=torch.bfloat16):
                r = aot_compile(**spec, arch=arch)
                wide = sum(n for op, n in r.global_loads().items() if op.endswith(".128"))
                print(
                    f"| {tile} | sm_{arch} | {r.kernel} | {r.registers} | {r.local_bytes} | {r.shared_bytes} | {wide} |"
                )


if __name__ == "__main__":
    main()
