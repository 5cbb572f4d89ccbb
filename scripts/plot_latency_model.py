"""Plot the estimator's ITL against context for several batch sizes: where the KV cache takes over.

Each panel is one model on one GPU preset (bf16 weights and KV). Solid lines: estimated ITL per batch
size; the dashed line is the weight-read floor (the ITL if the cache were free); a dot marks the
context at which KV reads equal weight reads for that batch; where weights + KV no longer fit in the
GPUs' memory the line turns dotted. Needs the ``plot`` extra (matplotlib).

With ``--validation JSON`` it draws instead the predicted-vs-measured plot of a
``scripts/validate_estimator.py`` run (held-out points filled, fit-grid points hollow, the ±15 % band).

    python scripts/plot_latency_model.py --out docs/img/itl-vs-context.png
    python scripts/plot_latency_model.py --validation results/history/cpu/costmodel/estimator-validation-cpu.json \
        --out docs/img/estimator-validation-cpu.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from attnbench.cost.estimate import estimate

PANELS = [("llama-3.1-8b", "h100", 1), ("llama-3.3-70b", "h100", 2), ("llama-3.3-70b", "h200", 4)]
BATCHES = [1, 8, 32, 128]
CONTEXTS = sorted([2**k for k in range(9, 18)] + [3 * 2**k for k in range(8, 16)])  # 512 .. 128k


def plot_validation(doc: dict[str, Any], out: str | Path) -> None:
    """Predicted vs measured step time of a validation run, log-log, with the ±15 % band."""
    rows = [r for r in doc["rows"] if r.get("predicted_s") is not None]
    fig, ax = plt.subplots(figsize=(6.4, 5.6))
    backends = sorted({r["backend"] for r in rows})
    markers = {"bf16": "o", "fp32": "s", "fp16": "^"}
    for i, backend in enumerate(backends):
        for r in (r for r in rows if r["backend"] == backend):
            held = r["role"] == "holdout"
            ax.plot(
                1e3 * r["measured_s"], 1e3 * r["predicted_s"], markers.get(r["dtype"], "D"),
                color=f"C{i}", markerfacecolor=f"C{i}" if held else "none", markersize=5, alpha=0.85,
            )  # fmt: skip
        ax.plot([], [], "o", color=f"C{i}", label=backend)
    lo = min(1e3 * min(r["measured_s"], r["predicted_s"]) for r in rows) * 0.8
    hi = max(1e3 * max(r["measured_s"], r["predicted_s"]) for r in rows) * 1.25
    ax.plot([lo, hi], [lo, hi], color="black", linewidth=0.8)
    ax.fill_between(
        [lo, hi], [lo * 0.85, hi * 0.85], [lo * 1.15, hi * 1.15], color="grey", alpha=0.2, label="±15 %"
    )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured step (ms)")
    ax.set_ylabel("predicted step (ms), calibrated model")
    h = doc.get("summary", {}).get("holdout") or {}
    title = "attention-only decode step on " + str(doc["device"]["name"])
    if h:
        title += f"\nheld-out: {h['within']}/{h['points']} within ±15 %, median |error| {100 * h['median_abs_error']:.1f} %"
    ax.set_title(title + "\n(filled: held-out; hollow: fit grid; ○ bf16, □ fp32)", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="docs/img/itl-vs-context.png")
    p.add_argument("--validation", default=None, help="a validate_estimator.py JSON: plot it instead")
    args = p.parse_args(argv)
    if args.validation:
        plot_validation(json.loads(Path(args.validation).read_text()), args.out)
        return 0
    contexts = CONTEXTS
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5.2 * len(PANELS), 4.4), sharey=False)
    for ax, (model, gpu, tp) in zip(axes, PANELS, strict=True):
        for batch, color in zip(BATCHES, ("C0", "C1", "C2", "C3"), strict=True):
            ests = [estimate(model, gpu=gpu, tp=tp, batch=batch, context=c, new_tokens=1) for c in contexts]
            itl = [1e3 * e.itl_s for e in ests]
            fits = [e.memory_needed_bytes <= e.gpu.memory_bytes for e in ests]
            last_fit = max((i for i, f in enumerate(fits) if f), default=-1)
            ax.plot(contexts[: last_fit + 1], itl[: last_fit + 1], color=color, label=f"batch {batch}")
            if last_fit < len(contexts) - 1:
                start = max(last_fit, 0)
                ax.plot(contexts[start:], itl[start:], color=color, linestyle=":", linewidth=1)
            floor = ests[0].step.fixed_s + ests[0].step.weight_s
            ax.axhline(1e3 * floor, color="grey", linestyle="--", linewidth=0.8)
            cross = ests[0].crossover_context
            if contexts[0] <= cross <= contexts[-1]:
                at = estimate(model, gpu=gpu, tp=tp, batch=batch, context=round(cross), new_tokens=1)
                ax.plot([cross], [1e3 * at.itl_s], "o", color=color, markersize=5)
        e0 = estimate(model, gpu=gpu, tp=tp, batch=1, context=512, new_tokens=1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("ITL (ms), estimated")
        ax.set_title(
            f"{model}, {tp}× {e0.gpu.label.split(' (')[0]}\n(achievable {e0.gpu.achievable:g}, bf16)",
            fontsize=9,
        )
        ax.grid(True, which="both", alpha=0.3)
        floor0 = e0.step.fixed_s + e0.step.weight_s
        ax.text(contexts[0], 1e3 * floor0 * 0.83, "weight reads + fixed cost", fontsize=7, color="grey")
    axes[0].legend(fontsize=8, loc="upper left")
    fig.suptitle(
        "ITL vs context: dots mark KV reads = weight reads; dotted: does not fit in GPU memory", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
