"""The decode step (ITL) against context inside vLLM's engine, with and without attnbench's kernel: a
plot from the serving benchmarks' committed JSON (nothing is measured here).

Each file is one that ``scripts/vllm_serving_bench.py`` (vLLM's own latency benchmark: ITL =
(latency(1 + STEPS) − latency(1)) / STEPS) or ``scripts/vllm_attention_share.py`` (vLLM's worker, the
same difference over decode steps after one prefill) wrote; every row at ``--batch`` is a point, one
marker per script, a line per path through the medians at each context.

    python scripts/plot_vllm_itl.py results/engines/vllm-serving-bench-epyc-avx512.json \\
        results/engines/vllm-attention-share-epyc-avx512.json ... --out docs/img/vllm-itl-vs-context.png
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from attnbench.cli.common import positive_int

PATHS = {"vllm": ("vLLM's CPU_ATTN", "tab:gray"), "attnbench": ("attnbench (cpu_decode)", "tab:blue")}


def points(path: Path, batch: int) -> list[tuple[str, int, str, float]]:
    """``(source, context, path, ITL ms)`` for each row at ``batch`` and each path of one report."""
    report = json.loads(path.read_text())
    source = "share" if "vllm_attention_share" in report.get("command", "") else "latency"
    out = []
    for row in report["rows"]:
        if row["batch"] != batch:
            continue
        for name, run in row["runs"].items():
            if "step_ms" in run:
                ms = float(run["step_ms"])
            elif run.get("itlN") and run.get("itl1"):
                ms = 1000 * (run["itlN"]["median_s"] - run["itl1"]["median_s"]) / row["steps"]
            else:
                continue
            out.append((source, int(row["input_len"]), name, ms))
    return out


def plot(found: list[tuple[str, int, str, float]], out: Path, batch: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    markers = {"latency": "o", "share": "s"}
    for name, (label, color) in PATHS.items():
        mine = [p for p in found if p[2] == name]
        for source, marker in markers.items():
            xs = [c for s, c, _, _ in mine if s == source]
            ys = [ms for s, _, _, ms in mine if s == source]
            if xs:
                ax.scatter(xs, ys, marker=marker, color=color, alpha=0.8, label=f"{label}, {source} run")
        contexts = sorted({c for _, c, _, _ in mine})
        ax.plot(
            contexts,
            [statistics.median(ms for _, c, _, ms in mine if c == x) for x in contexts],
            color=color,
            linewidth=1,
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (prompt tokens)")
    ax.set_ylabel("decode step (ITL), ms")
    ax.set_title(f"vLLM's engine, batch {batch}: ITL against context")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("reports", nargs="+", type=Path, help="the serving scripts' JSON reports")
    p.add_argument("--batch", type=positive_int, default=1, help="the batch to plot (default 1)")
    p.add_argument("--out", type=Path, required=True, help="the PNG to write")
    args = p.parse_args(argv)
    missing = [str(r) for r in args.reports if not r.is_file()]
    if missing:
        p.error(f"no such report: {', '.join(missing)}")
    found = []
    for r in args.reports:
        try:
            found += points(r, args.batch)
        except (ValueError, KeyError, TypeError) as exc:  # not JSON, or not a serving script's report
            p.error(f"{r}: not a report of vllm_serving_bench.py or vllm_attention_share.py ({exc!r})")
    if not found:
        p.error(f"no row at batch {args.batch} in {', '.join(map(str, args.reports))}")
    plot(found, args.out, args.batch)
    for source, context, name, ms in sorted(found, key=lambda x: (x[1], x[2], x[0])):
        print(f"{context:>6} {name:<10} {ms:7.1f} ms  ({source})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
