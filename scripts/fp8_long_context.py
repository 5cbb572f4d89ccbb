"""fp8 KV cache at long context: needle retrieval and error against exact attention, 1k to 128k.

Batch 1, llama-3.1-8b's attention geometry (32 query heads over 8 KV heads of 128), 2 layers, bf16
compute, the gate's inputs (random K/V with needle probes planted at the first, newest and previous
tokens, around every power of two and at random middles, plus one long-accumulation probe), several
seeds per context. For each: the share of probes retrieved (every output value within the declared
fp8 bound against exact attention), the worst rel_l2 / max_abs / cosine against exact float64
attention, and the error against attention over the K/V as stored (the kernel's own arithmetic,
held to a calibrated bound). Accuracy only (nothing is timed). Writes ``<out>.json`` and ``<out>.md``.

    python scripts/fp8_long_context.py --out results/cpu/accuracy/fp8-long-context-cpu
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from attnbench.cli.common import command_line, run_record, write_report
from attnbench.core.registry import load_registry
from attnbench.core.shapes import load_shape
from attnbench.core.workload import Workload
from attnbench.correctness.gate import check, prepare_case


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="1024,8192,32768,131072")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--out", default="results/cpu/accuracy/fp8-long-context-cpu")
    args = ap.parse_args()
    fp8 = load_registry(env={"ATTNBENCH_DISABLE_PLUGIN_AUTOLOAD": "1"}).get("fp8")
    shape = load_shape(args.model)
    start, load_start = time.time(), os.getloadavg()
    rows = []
    for ctx in (int(c) for c in args.contexts.split(",")):
        w = Workload(shape, (ctx,), args.dtype, "cpu")
        acc = {"retrieval": [], "rel_l2": [], "max_abs": [], "cosine": [], "stored_rel_l2": [], "passed": 0}
        probes = 0
        for seed in range(args.seeds):
            case = prepare_case(w, form=fp8.kv_form, seed=7919 * seed + ctx)
            r = check(fp8, w, case=case)
            probes = r.probes
            acc["retrieval"].append(r.retrieval)
            acc["rel_l2"].append(r.error.rel_l2)
            acc["max_abs"].append(r.error.max_abs)
            acc["cosine"].append(r.error.cosine)
            acc["stored_rel_l2"].append(r.stored_error.rel_l2 if r.stored_error else float("nan"))
            acc["passed"] += int(r.passed)
            del case
        tol = fp8.tolerance(w.dtype)
        rows.append(
            {
                "context": ctx,
                "seeds": args.seeds,
                "probes_per_run": probes,
                "retrieval_min": min(acc["retrieval"]),
                "retrieval_mean": sum(acc["retrieval"]) / len(acc["retrieval"]),
                "rel_l2_worst": max(acc["rel_l2"]),
                "rel_l2_mean": sum(acc["rel_l2"]) / len(acc["rel_l2"]),
                "max_abs_worst": max(acc["max_abs"]),
                "cosine_worst": min(acc["cosine"]),
                "stored_rel_l2_worst": max(acc["stored_rel_l2"]),
                "gate_passed": acc["passed"],
                "bound": vars(tol),
            }
        )
        print(f"{ctx}: {rows[-1]}", file=sys.stderr, flush=True)
    command = command_line(args, parser=ap, prog="python scripts/fp8_long_context.py")
    report = run_record(command=command, load_start=load_start, started=start) | {
        "model": args.model,
        "dtype": args.dtype,
        "implementation": fp8.implementation(Workload(shape, (64,), args.dtype, "cpu")),
        "rows": rows,
    }
    md = [
        "# fp8 (e4m3) KV cache at long context",
        "",
        f"`{report['command']}` — {report['machine']}, torch {report['torch']}, {report['date']}, load average "
        f"{load_start[0]:.2f} → {report['load_avg_end'][0]:.2f} ({report['seconds']:.0f} s; accuracy only).",
        "",
        f"{args.model} attention geometry, batch 1, 2 layers, {args.dtype}, {report['implementation']}; "
        f"bound against exact attention: rel_l2 ≤ {rows[0]['bound']['rel_l2']}, max_abs ≤ "
        f"{rows[0]['bound']['max_abs']}, cosine ≥ {rows[0]['bound']['min_cosine']}.",
        "",
        "| context | seeds | probes / run | needle retrieval (min, mean) | rel_l2 vs exact (mean, worst) "
        "| max_abs worst | cosine worst | rel_l2 vs stored K/V (worst) | gate passed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        md.append(
            f"| {r['context']} | {r['seeds']} | {r['probes_per_run']} | {r['retrieval_min']:.0%}, "
            f"{r['retrieval_mean']:.0%} | {r['rel_l2_mean']:.3g}, {r['rel_l2_worst']:.3g} | "
            f"{r['max_abs_worst']:.3g} | {r['cosine_worst']:.5f} | {r['stored_rel_l2_worst']:.3g} | "
            f"{r['gate_passed']} / {r['seeds']} |"
        )
    write_report(args.out, report, "\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
