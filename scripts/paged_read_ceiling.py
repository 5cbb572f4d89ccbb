"""How fast one core can read a paged KV cache at all: contiguous runs in a random order, no arithmetic.

``cpu_decode`` reads a layer's cache page by page in the block table's order; a page holds one KV
head's run of ``page_size`` tokens contiguously (32 KiB for fp8 at page 128 and head_dim 128, 64 KiB
for bf16). The read bandwidth that ``bench``'s ``% read`` is against is a sum over one contiguous
buffer. This script reads the same kind of memory (a buffer in 2 MiB pages, 512 MiB, far past the
last-level cache) in runs of ``--run-kib`` KiB, in order and in a random order, with software
prefetches 0, 64 and 256 lines ahead (the next run's lines once the current one ends), four 64-byte
loads an iteration summed into four accumulators, at one thread (a C loop compiled with the kernel's
compiler; AVX-512F), interleaved round by round with the bar itself (``attnbench.core.device.ReadMeter``):
the share a kernel that did nothing but read could reach.

    python scripts/paged_read_ceiling.py --run-kib 32,64 --rounds 3 --out results/cpu/kernels/paged-read-ceiling
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from attnbench.cli.common import positive_int, positive_int_list, run_line
from attnbench.core.device import ReadMeter

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from microbench import compile_c, print_and_save_report, script_run_record  # noqa: E402

PREFETCH = (0, 64, 256)

SOURCE = r"""
#define _GNU_SOURCE
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
/* GB/s of reading nrun runs of `run` bytes in the order ord, prefetching pfd lines ahead (0: none) */
static double pass(const char *buf, long nrun, long run, const long *ord, int pfd) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    const long lines = run / 64;
    double t0 = now();
    for (long c = 0; c < nrun; c++) {
        const char *p = buf + ord[c] * run, *nx = c + 1 < nrun ? buf + ord[c + 1] * run : p;
        for (long l = 0; l < lines; l += 4) {
            if (pfd)
                for (int k = 0; k < 4; k++) {
                    long L = l + k + pfd;
                    _mm_prefetch(L < lines ? p + 64 * L : nx + 64 * (L - lines), _MM_HINT_T2);
                }
            a0 = _mm512_add_epi32(a0, _mm512_load_si512(p + 64 * l));
            a1 = _mm512_add_epi32(a1, _mm512_load_si512(p + 64 * l + 64));
            a2 = _mm512_add_epi32(a2, _mm512_load_si512(p + 64 * l + 128));
            a3 = _mm512_add_epi32(a3, _mm512_load_si512(p + 64 * l + 192));
        }
    }
    double dt = now() - t0;
    a0 = _mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3));
    if (_mm512_reduce_add_epi32(a0) == 123456789) printf("#\n");
    return (double)nrun * run / dt / 1e9;
}
int main(int argc, char **argv) {
    const long bytes = 512L << 20, run = atol(argv[1]) * 1024, nrun = bytes / run;
    char *buf = aligned_alloc(2L << 20, bytes);
    if (!buf) return 1;
    madvise(buf, bytes, MADV_HUGEPAGE);
    memset(buf, 1, bytes);
    long *seq = malloc(sizeof(long) * nrun), *rnd = malloc(sizeof(long) * nrun);
    if (!seq || !rnd) return 1;
    for (long i = 0; i < nrun; i++) seq[i] = rnd[i] = i;
    srand(7);
    for (long i = nrun - 1; i > 0; i--) { long j = rand() % (i + 1), t = rnd[i]; rnd[i] = rnd[j]; rnd[j] = t; }
    const int pfd[3] = {0, 64, 256};
    pass(buf, nrun, run, seq, 0); /* warm-up */
    printf("%.3f", pass(buf, nrun, run, seq, 0));
    for (int i = 0; i < 3; i++) printf(" %.3f", pass(buf, nrun, run, rnd, pfd[i]));
    printf("\n");
    return 0;
}
"""


def _build(tmp: Path) -> Path:
    exe = compile_c(SOURCE, tmp / "paged_read", ["-O3", "-funroll-loops", "-mavx512f"])
    if exe is None:
        raise SystemExit("paged_read_ceiling: no C compiler (set CC, or install gcc or clang)")
    return exe


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--run-kib",
        type=positive_int_list,
        default="32,64",
        help="contiguous run sizes in KiB (one page of one KV head)",
    )
    ap.add_argument(
        "--rounds", type=positive_int, default=3, help="interleaved rounds; each figure is their median"
    )
    ap.add_argument("--out", default="results/cpu/kernels/paged-read-ceiling")
    args = ap.parse_args()
    runs = args.run_kib
    torch.set_num_threads(1)
    start, load_start = time.time(), os.getloadavg()
    meter = ReadMeter("cpu", 512 * 2**20)
    bars: list[float] = []
    got: dict[int, list[list[float]]] = {r: [] for r in runs}
    with tempfile.TemporaryDirectory() as tmp:
        exe = _build(Path(tmp))
        for _ in range(args.rounds):
            bars.append((meter() or 0.0) / 1e9)
            for r in runs:
                out = subprocess.run(
                    [str(exe), str(r)], check=True, capture_output=True, text=True, timeout=600
                )
                got[r].append([float(x) for x in out.stdout.split()])
        bars.append((meter() or 0.0) / 1e9)
    bar = statistics.median(bars)
    rows = []
    for r in runs:
        med = [statistics.median(x[i] for x in got[r]) for i in range(1 + len(PREFETCH))]
        rows.append(
            {"run_kib": r, "in_order_gbps": med[0], "random_gbps": dict(zip(PREFETCH, med[1:], strict=True))}
        )
    report = script_run_record(
        args, parser=ap, prog="python scripts/paged_read_ceiling.py", load_start=load_start, started=start
    ) | {"threads": 1, "read_bar_gbps": bars, "rows": rows}
    lines = [
        "# Reading a paged cache at one thread: contiguous runs in a random order, no arithmetic",
        "",
        run_line(report) + f"; 1 thread; median of {args.rounds} interleaved rounds.",
        "",
        f"The bar (`ReadMeter`, a torch sum over 512 MiB in 2 MiB pages, before each round and after the "
        f"last): median {bar:.1f} GB/s ({', '.join(f'{b:.1f}' for b in bars)}).",
        "",
        "| run | in order | random order, no prefetch | random, 64 lines ahead | random, 256 lines ahead "
        "| best random / bar |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        rnd = row["random_gbps"]
        best = max(rnd.values())
        lines.append(
            f"| {row['run_kib']} KiB | {row['in_order_gbps']:.1f} GB/s | {rnd[0]:.1f} | {rnd[64]:.1f} | "
            f"{rnd[256]:.1f} | {100 * best / bar:.0f} % |"
        )
    return print_and_save_report(args.out, report, lines)


if __name__ == "__main__":
    raise SystemExit(main())
