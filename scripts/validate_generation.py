"""Check the generation cost model against measured ``attnbench e2e`` runs: TTFT and ITL per row.

For every e2e report given (``--runs``, the ``.json`` files ``attnbench e2e --save`` writes), the cost
model is calibrated here and now on this device (:func:`attnbench.cost.generation_calibration.calibrate_generation`:
each linear layer timed alone, the matmul-free frames of the model's class; nothing runs the model
being predicted) for the report's model, dtype, paths and batches, and each measured row is predicted
with :func:`~attnbench.cost.generation.predict_generation`. Compared: TTFT with the measured TTFT, ITL
with the measured ITL p50 (the median decode step). Target (issue 27): ≥ 80 % of the compared figures
within ±15 %. The reports' own predictions (made with the calibration of their run, if any) are shown
beside, for reference.

A calibration is measured once per (model, dtype) over the union of the reports' paths and batches,
so every row of that model is predicted from the same measurements. Run it on a quiet machine, with
the thread count the reports were measured with (``--threads``; default: theirs).

    python scripts/validate_generation.py --runs results/cpu/e2e/qwen2.5-0.5b-fp32-b1.json \
        --out results/cpu/e2e/prediction-validation

Writes ``<out>.json`` (every figure, the calibration, command, machine, date, load) and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

TOLERANCE = 0.15
TARGET_SHARE = 0.80


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", nargs="+", required=True, help="e2e reports (.json) to predict")
    p.add_argument("--out", required=True, help="output path without extension")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: the reports')")
    p.add_argument(
        "--max-seconds", type=float, default=90, help="bound on the calibration's timed repeats (default 90)"
    )
    args = p.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads {args.threads} must be ≥ 1")
    if not args.max_seconds > 0:
        p.error(f"--max-seconds {args.max_seconds} must be > 0")
    return args


def _load(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise SystemExit(
            f"--runs {path!r} does not exist; accepted: a .json report of `attnbench e2e --save`"
        )
    data = json.loads(p.read_text())
    if not isinstance(data, dict) or "rows" not in data or "model" not in data:
        raise SystemExit(f"--runs {path!r} is not an `attnbench e2e` report (no 'model' and 'rows')")
    return data


def _model_cost(name: str) -> Any:
    from attnbench.cost.generation import ModelCost
    from attnbench.models.architectures import ARCHITECTURES, hf_config

    if name in ARCHITECTURES:
        config = hf_config(name)
    else:  # a checkpoint directory or a config.json
        import transformers

        config = transformers.AutoConfig.from_pretrained(
            Path(name).parent if name.endswith(".json") else name
        )
    return ModelCost.from_hf_config(config, name=name)


def _error(pred: float, measured: float) -> float:
    return pred / measured - 1.0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from attnbench.core.shapes import parse_dtype
    from attnbench.cost import generation
    from attnbench.cost.generation_calibration import calibrate_generation

    reports = [(path, _load(path)) for path in args.runs]
    threads = args.threads or max(int(r.get("threads") or 0) for _, r in reports) or None
    if threads:
        torch.set_num_threads(threads)
    load_start, started = os.getloadavg(), time.time()
    groups: dict[tuple[str, str], dict[str, set]] = {}
    for _, rep in reports:
        g = groups.setdefault((rep["model"], rep["dtype"]), {"paths": set(), "batches": set()})
        g["paths"].update(r["path"] for r in rep["rows"])
        g["batches"].update(int(r["batch"]) for r in rep["rows"])
    calibrations: dict[tuple[str, str], Any] = {}
    costs: dict[tuple[str, str], Any] = {}
    for (model, dtype), g in groups.items():
        costs[model, dtype] = cost = _model_cost(model)
        print(
            f"calibrating {model} {dtype}: paths {sorted(g['paths'])}, batches {sorted(g['batches'])}",
            flush=True,
        )
        calibrations[model, dtype] = calibrate_generation(
            cost, paths=sorted(g["paths"]), dtype=parse_dtype(dtype), batch_sizes=sorted(g["batches"]),
            max_seconds=args.max_seconds, progress=lambda line: print("  " + line, flush=True),
        )  # fmt: skip
    rows = []
    for path, rep in reports:
        key = (rep["model"], rep["dtype"])
        for r in rep["rows"]:
            pred = generation.predict_generation(
                costs[key], calibrations[key], path=r["path"], batch=int(r["batch"]),
                prompt_len=int(r["prompt_len"]), new_tokens=int(r["new_tokens"]),
            )  # fmt: skip
            own = r.get("prediction") or {}
            rows.append({
                "report": Path(path).name, "model": rep["model"], "dtype": rep["dtype"], "path": r["path"],
                "batch": r["batch"], "prompt_len": r["prompt_len"],
                "ttft_s": r["ttft_s"], "ttft_pred_s": pred.ttft_s, "ttft_err": _error(pred.ttft_s, r["ttft_s"]),
                "itl_p50_s": r["itl_p50_s"], "itl_pred_s": pred.itl_s, "itl_err": _error(pred.itl_s, r["itl_p50_s"]),
                "run_ttft_pred_s": own.get("ttft_s"), "run_itl_pred_s": own.get("itl_s"),
                "prediction": pred.to_dict(),
            })  # fmt: skip
    errors = [abs(r[k]) for r in rows for k in ("ttft_err", "itl_err")]
    within = sum(e <= TOLERANCE for e in errors)
    share = within / len(errors) if errors else 0.0
    summary = {
        "figures": len(errors),
        "within": within,
        "share_within": share,
        "ttft_within": sum(abs(r["ttft_err"]) <= TOLERANCE for r in rows),
        "itl_within": sum(abs(r["itl_err"]) <= TOLERANCE for r in rows),
        "rows": len(rows),
        "target_share": TARGET_SHARE,
        "tolerance": TOLERANCE,
        "met": share >= TARGET_SHARE,
    }
    record = {
        "command": "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])]),
        "machine": f"{platform.node()} — {platform.machine()}, {os.cpu_count()} CPUs",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "load_avg_start": load_start,
        "load_avg_end": os.getloadavg(),
        "seconds": time.time() - started,
        "runs": [
            {"file": Path(p).name, "command": r.get("command"), "date": r.get("date")} for p, r in reports
        ],
        "calibrations": {f"{m} {d}": c.to_dict() for (m, d), c in calibrations.items()},
        "rows": rows,
        "summary": summary,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    out.with_suffix(".md").write_text(_markdown(record))
    print(_markdown(record))
    return 0


def _markdown(rec: dict[str, Any]) -> str:
    s = rec["summary"]
    la, lb = rec["load_avg_start"], rec["load_avg_end"]
    lines = [
        "# Generation cost model against measured e2e runs",
        "",
        f"`{rec['command']}` · {rec['machine']} · torch {rec['torch']} · {rec['threads']} threads · "
        f"{rec['date']} · load average {la[0]:.2f} → {lb[0]:.2f} · {rec['seconds']:.0f} s",
        "",
        "The cost model was calibrated in this run (linear layers alone, matmul-free frames; the model "
        "itself never runs) and predicts each row of the e2e reports below, measured earlier on this "
        "machine: " + ", ".join(f"`{r['file']}` ({r['date']})" for r in rec["runs"]) + ". "
        "`run pred` is the prediction recorded by the e2e run itself (its own calibration).",
        "",
        "| model | dtype | batch | prompt | path | TTFT s | predicted | error | run pred | ITL p50 ms | predicted | error | run pred |",
        "| --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rec["rows"]:
        rt = f"{r['run_ttft_pred_s']:.2f}" if r["run_ttft_pred_s"] else "—"
        ri = f"{r['run_itl_pred_s'] * 1e3:.1f}" if r["run_itl_pred_s"] else "—"
        lines.append(
            f"| {r['model']} | {r['dtype']} | {r['batch']} | {r['prompt_len']} | {r['path']} | "
            f"{r['ttft_s']:.2f} | {r['ttft_pred_s']:.2f} | {r['ttft_err']:+.0%} | {rt} | "
            f"{r['itl_p50_s'] * 1e3:.1f} | {r['itl_pred_s'] * 1e3:.1f} | {r['itl_err']:+.0%} | {ri} |"
        )
    lines += [
        "",
        f"Within ±{s['tolerance']:.0%}: {s['within']} of {s['figures']} figures ({s['share_within']:.0%}; "
        f"TTFT {s['ttft_within']} of {s['rows']}, ITL {s['itl_within']} of {s['rows']}); "
        f"target ≥ {s['target_share']:.0%}: {'met' if s['met'] else 'not met'}.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
