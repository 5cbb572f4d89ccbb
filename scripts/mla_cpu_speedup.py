"""``cpu_decode_mla`` against the ``mla`` backend's torch path, side by side, on DeepSeek-V3's latent geometry.

Both paths pass the correctness gate at this geometry (the torch path's scores are fp32; ``attnbench
bench --backends mla,cpu_decode_mla`` gates and times them one at a time); this script times the two
side by side, to give the speed ratio, and the kernel's share of the bf16 matmul peak measured beside
it. Both paths decode the same cache contents (random latent rows, bf16) through enough layer caches,
cycled, that every call reads from DRAM (twice the last-level cache), interleaved round by round (one
step of each path, alternating which goes first), median over ``--rounds``. ``ceiling`` is the peak
over the torch path's GFLOP/s: the speedup a kernel running at the measured peak would have.

    python scripts/mla_cpu_speedup.py --threads 1 --batch 1,8 --context 8k,32k --out results/cpu/bench/mla-speedup-t1
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from attnbench.backends.cpu_decode_mla import CpuDecodeMLABackend
from attnbench.backends.mla import MLABackend
from attnbench.cli.common import command_line, run_record, write_report
from attnbench.core.device import fingerprint, last_level_cache_bytes
from attnbench.core.traffic import attention_flops
from attnbench.core.workload import Workload, parse_int_list, parse_tokens
from attnbench.cost.gpuspec import matmul_peak


def _setup(backend, config, w: Workload, layers: int, rows: torch.Tensor):
    g = w.geometry("latent")
    cache = backend.create_cache(w, config=config, num_layers=layers, max_seq_len=max(w.context_lens) + 8)
    plan = backend.plan(cache, num_new=w.context_lens)
    for layer in range(layers):
        backend.append(cache, plan, layer=layer, k=rows, v=rows[..., : g.v_head_dim])
    cache.commit(plan)
    return cache


def _matmul_peak() -> float:
    """bf16 matmul FLOP/s at the current threads, as bench's ceiling is measured (gpuspec.matmul_peak)."""
    return matmul_peak(torch.device("cpu"), torch.bfloat16)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--context", default="8k,32k")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="results/cpu/bench/mla-speedup")
    args = ap.parse_args()
    if args.threads < 1 or args.rounds < 1:
        ap.error("--threads and --rounds must be ≥ 1")
    torch.set_num_threads(args.threads)
    start, load_start = time.time(), os.getloadavg()
    rows_out = []
    peaks = [_matmul_peak()]
    for batch in parse_int_list(args.batch, field="--batch"):
        for context in (parse_tokens(c) for c in args.context.split(",")):
            w = Workload.uniform("deepseek-v3", batch=batch, context=context, dtype="bf16")
            g = w.geometry("latent")
            per_layer = batch * context * g.qk_head_dim * 2
            layers = max(2, min(16, -(-2 * last_level_cache_bytes("cpu") // per_layer)))
            gen = torch.Generator().manual_seed(0)
            rows = torch.randn(batch, context, 1, g.qk_head_dim, generator=gen).to(torch.bfloat16)
            q = torch.randn(batch, g.num_q_heads, g.qk_head_dim, generator=gen).to(torch.bfloat16)
            new = torch.randn(batch, 1, g.qk_head_dim, generator=gen).to(torch.bfloat16)
            paths = {
                "cpu_decode_mla": (CpuDecodeMLABackend(), {"page_size": 128}),
                "mla[torch]": (MLABackend(), {"kernel": "torch", "page_size": 128}),
            }
            caches = {n: _setup(b, c, w, layers, rows) for n, (b, c) in paths.items()}
            times: dict[str, list[float]] = {n: [] for n in paths}
            for r in range(args.rounds + 1):
                order = list(paths) if r % 2 == 0 else list(reversed(paths))
                for name in order:
                    backend, cache = paths[name][0], caches[name]
                    t0 = time.perf_counter()
                    for layer in range(layers):  # one token appended per layer, then reset: same length
                        plan = backend.plan(cache, num_new=[1] * batch)
                        backend.decode(cache, plan, layer=layer, q=q, k=new, v=new[..., : g.v_head_dim])
                    dt = (time.perf_counter() - t0) / layers
                    cache.seq_lens = w.context_lens  # the next round decodes at the same length
                    if r:  # round 0 warms up
                        times[name].append(dt)
            flops = attention_flops(w.shape, tokens=batch * (context + 1), form="latent", layers=1)
            row = {"batch": batch, "context": context, "layers_cycled": layers}
            row["variant"] = caches["cpu_decode_mla"].isa
            for name, ts in times.items():
                med = statistics.median(ts)
                row[name] = {"ms_per_layer": med * 1e3, "gflops": flops / med / 1e9}
            row["speedup"] = row["mla[torch]"]["ms_per_layer"] / row["cpu_decode_mla"]["ms_per_layer"]
            peaks.append(_matmul_peak())  # the peak again after each point: the row's share is of the mean
            row["matmul_peak_gflops"] = (peaks[-2] + peaks[-1]) / 2e9
            row["share_of_peak"] = row["cpu_decode_mla"]["gflops"] / row["matmul_peak_gflops"]
            row["speedup_ceiling"] = row["matmul_peak_gflops"] / row["mla[torch]"]["gflops"]
            rows_out.append(row)
            print(
                f"b={batch} ctx={context}: cpu_decode_mla {row['cpu_decode_mla']['ms_per_layer']:.2f} ms/layer "
                f"({row['cpu_decode_mla']['gflops']:.0f} GFLOP/s), mla[torch] {row['mla[torch]']['ms_per_layer']:.2f} "
                f"ms/layer: {row['speedup']:.1f}x",
                flush=True,
            )
    command = command_line(args, parser=ap, prog="python scripts/mla_cpu_speedup.py")
    report = run_record(command=command, load_start=load_start, started=start) | {
        "rows": rows_out,
        "matmul_peak_gflops_samples": [x / 1e9 for x in peaks],
    }
    lines = [
        "# cpu_decode_mla against the mla torch path (deepseek-v3 latent geometry, bf16)",
        "",
        f"`{report['command']}` — {report['machine']}, torch {report['torch']}, {report['date']}, load average "
        f"{report['load_avg_start'][0]:.2f} → {report['load_avg_end'][0]:.2f}, {args.threads} thread(s); "
        f"CPU: {fingerprint()['name']}; kernel variant: {', '.join(sorted({r['variant'] for r in rows_out}))}.",
        "",
        "Interleaved rounds, median; layer caches cycled past the last-level cache. Both paths pass the "
        "correctness gate at this geometry. "
        "`peak`: bf16 torch.mm (1024² and 2048², each at its 10th-percentile time, the faster; "
        "`attnbench.cost.gpuspec.matmul_peak`) measured before and after each point at the same threads; `share` is "
        "cpu_decode_mla's GFLOP/s over their mean; `ceiling`: the peak over the torch path's GFLOP/s, the "
        "speedup of a kernel at the peak.",
        "",
        "| batch | context | cpu_decode_mla ms/layer | GFLOP/s | peak GFLOP/s | share | mla[torch] ms/layer | GFLOP/s "
        "| speedup | ceiling |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows_out:
        a, b = r["cpu_decode_mla"], r["mla[torch]"]
        lines.append(
            f"| {r['batch']} | {r['context']} | {a['ms_per_layer']:.2f} | {a['gflops']:.0f} | "
            f"{r['matmul_peak_gflops']:.0f} | {100 * r['share_of_peak']:.0f} % | {b['ms_per_layer']:.2f} | {b['gflops']:.0f} | {r['speedup']:.1f}× "
            f"| {r['speedup_ceiling']:.1f}× |"
        )
    write_report(args.out, report, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
