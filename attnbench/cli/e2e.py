"""``attnbench e2e`` — a real model generates through each path: TTFT, ITL, tokens, the user's number.

A Hugging Face decoder — a checkpoint directory, a config.json (random weights) or an architecture
preset with random weights (qwen2.5-0.5b: the real geometry, MLP and vocabulary) — generates greedily
through transformers' stock paths (sdpa with its DynamicCache, sdpa with a StaticCache) and through
each candidate backend (attnbench.integrations.transformers.use_backend), for every batch × prompt
length. Each path prefills the prompt once (TTFT) and then runs the decode steps, each timed (ITL
p50/p90); the time inside the attention calls gives the attention share of a step. Backends pass
the correctness gate at the run's batch and context before they are timed, and their tokens are
compared with the first stock path's. With the cost model (attnbench.cost.generation) each row also
shows the predicted TTFT and ITL. On the same model and prompt the paths prefill one after another,
then their decode steps run interleaved (step i of every path, in an order rotated each step, before
step i+1 of any), so the ITLs are compared side by side; --sequential runs each path to its end
before the next. Run it on a quiet machine.

example: attnbench e2e --model qwen2.5-0.5b --batch 1,4 --prompt 1k --new-tokens 32 --threads 2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from attnbench.cli.common import (
    add_command,
    add_device_option,
    cli_table,
    command_line,
    console,
    emit_json,
    positive_int_list,
    print_table,
    run_record,
    tokens_to_generate,
)
from attnbench.core.registry import load_registry
from attnbench.core.shapes import load_shape, parse_dtype
from attnbench.core.workload import Workload
from attnbench.correctness.gate import check
from attnbench.measure.bench import CheckFailed

if TYPE_CHECKING:
    from attnbench.measure.e2e import GenerationPath, PathRun


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "e2e", __doc__)
    p.add_argument(
        "--model",
        "-m",
        required=True,
        help="a checkpoint directory, a config.json (random weights) or an architecture preset with "
        "random weights: qwen2.5-0.5b, tiny-qwen2",
    )
    p.add_argument(
        "--batch", "-b", type=positive_int_list, default="1", help="batch sizes, comma-separated (default 1)"
    )
    p.add_argument(
        "--prompt",
        "-p",
        type=positive_int_list,
        default="1k",
        help="prompt lengths, comma-separated, k suffix (default 1k)",
    )
    p.add_argument("--new-tokens", "-n", default="32", help="tokens generated per sequence (≥ 2; default 32)")
    p.add_argument(
        "--paths",
        default=None,
        help="comma-separated paths: sdpa, sdpa-static, flash_attention_2 (CUDA), and backends, each "
        "optionally with a config as name[key=value,…] (default: sdpa, sdpa-static and every exact "
        "backend that runs natively here, each in its default config)",
    )
    p.add_argument("--dtype", default="bf16", help="model dtype: bf16, fp16, fp32 (default bf16)")
    add_device_option(p)
    p.add_argument(
        "--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts (default 0)")
    p.add_argument("--no-gate", action="store_true", help="skip the correctness gate (not recommended)")
    p.add_argument(
        "--no-predict", action="store_true", help="skip the cost model's prediction (and its calibration)"
    )
    p.add_argument("--wide", action="store_true", help="more columns: ITL p90, predictions, implementation")
    p.add_argument(
        "--sequential",
        action="store_true",
        help="decode each path to its end before the next path's prefill (default: decode steps interleaved)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    p.add_argument(
        "--save",
        metavar="PREFIX",
        default=None,
        help="write PREFIX.json after every (batch, prompt) point (nothing lost if interrupted) and PREFIX.md at the end",
    )
    p.add_argument(
        "--plot", metavar="PNG", default=None, help="plot ITL against context per path (matplotlib)"
    )
    p.set_defaults(func=run)


def default_paths(*, device: str, dtype: torch.dtype) -> list[str]:
    """The stock paths that exist here, then every exact backend that would run natively (not
    interpreted) for a small workload on ``device`` in ``dtype``."""

    paths = ["sdpa", "sdpa-static"]
    workload = Workload(load_shape("tiny-gqa"), (64,), dtype, device)
    for entry in load_registry():
        backend = entry.create()
        res = backend.resolve(workload)
        if res.runnable and not res.interpreted and not res.lossy and backend.kv_form == "expanded":
            paths.append(entry.name)
    return paths


def _gate(*, shape: Any, batch: int, context: int, dtype: torch.dtype, device: str):

    def gate(backend: Any, config: dict[str, Any]) -> str:
        workload = Workload(shape, (context,) * batch, dtype, device)
        result = check(backend, workload, config=config, num_layers=1)
        if not result.passed:
            raise CheckFailed(result)
        return result.summary()

    return gate


def run(args: argparse.Namespace) -> int:
    try:  # deferred: generation runs through transformers, an optional extra the other commands never load
        from attnbench.integrations.transformers import shape_of
        from attnbench.measure.e2e import (
            STOCK_PATHS,
            PathRun,
            compare_tokens,
            load_hf_model,
            parse_path,
            run_paths,
        )
    except ImportError as missing:
        raise ValueError(
            f"e2e generates with a transformers model and transformers is not importable ({missing}): "
            "pip install 'attnbench[transformers]'"
        ) from None

    batches, prompts = args.batch, args.prompt
    new_tokens = tokens_to_generate(args)
    dtype = parse_dtype(args.dtype, field="--dtype")
    if args.plot:  # refused before the runs, not after minutes of them
        _plot_module()
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads = {args.threads} must be ≥ 1")
        torch.set_num_threads(args.threads)
    names = [e.name for e in load_registry()]
    texts = args.paths.split(",") if args.paths else default_paths(device=args.device, dtype=dtype)
    paths = [parse_path(t, backends=names) for t in texts if t.strip()]
    if not any(p.stock for p in paths):
        raise ValueError(f"--paths {args.paths!r}: name at least one stock path ({', '.join(STOCK_PATHS)})")
    err = Console(stderr=True)
    load_start, started = os.getloadavg(), time.time()
    with err.status(f"building {args.model} ({args.dtype})…"):
        model, name = load_hf_model(args.model, dtype=dtype, device=args.device, seed=args.seed)
        shape = shape_of(model)
    predictor, calibration = (
        (None, None) if args.no_predict else _predictor(model, paths, dtype=dtype, batches=batches, err=err)
    )
    record = run_record(command=command_line(args), load_start=load_start, started=started)
    report: dict[str, Any] = {
        **record,
        "model": name,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "device": args.device,
        "new_tokens": new_tokens,
        "paths": [p.name for p in paths],
        "interleaved": not args.sequential,  # the decode steps of the paths alternate (see run_paths)
        "rows": [],
        "failed": [],  # candidates refused by the correctness gate, with the reason
    }
    if calibration is not None:  # what the predictions were made from (scripts/validate_generation.py)
        report["calibration"] = calibration.to_dict()
    total = len(batches) * len(prompts) * len(paths)
    done = 0
    for batch in batches:
        for prompt_len in prompts:
            gen = torch.Generator().manual_seed(args.seed + 1)
            vocab = int(model.config.get_text_config(decoder=True).vocab_size)
            prompt = torch.randint(0, vocab, (batch, prompt_len), generator=gen).to(args.device)
            gate = None
            if not args.no_gate:
                gate = _gate(
                    shape=shape, batch=batch, context=prompt_len + new_tokens, dtype=dtype, device=args.device
                )
            done += len(paths)
            with err.status(
                f"[{done}/{total}] b={batch} prompt={prompt_len}: {len(paths)} prefills, then "
                f"{new_tokens - 1} decode steps of each path interleaved…"
            ):
                runs, failures = run_paths(
                    model,
                    paths,
                    prompt=prompt,
                    new_tokens=new_tokens,
                    gate=gate,
                    interleave=not args.sequential,
                )
            for path, fail in failures:  # a candidate that fails the gate is never timed
                if not isinstance(fail, CheckFailed):
                    raise fail
                report["failed"].append(
                    {"batch": batch, "prompt_len": prompt_len, "path": path.name, "reason": str(fail)}
                )
                err.print(
                    escape(f"  b={batch} prompt={prompt_len} {path.name}: not timed: {fail}"), soft_wrap=False
                )
            reference: PathRun | None = None
            for row in runs:
                if reference is None and row.stock:
                    reference = row
                if reference is not None and row is not reference:
                    compare_tokens(row, reference)
                if predictor is not None:
                    row.prediction = predictor(row)
                report["rows"].append(row.to_dict())
                err.print(_progress_line(row))
            if args.save:
                _write_json(Path(f"{args.save}.json"), report | {"load_avg_end": list(os.getloadavg())})
    report["load_avg_end"] = list(os.getloadavg())
    report["seconds"] = round(time.time() - started, 1)
    report["summary"] = summarise([PathRun.from_dict(r) for r in report["rows"]])
    if args.save:
        _write_json(Path(f"{args.save}.json"), report)
        Path(f"{args.save}.md").write_text(markdown(report))
    if args.plot:
        plot(report, Path(args.plot))
    if args.json:
        emit_json(report)
        return 0
    out = console()
    if args.wide and not out.is_terminal:
        out.width = max(out.width, 160)  # --wide asks for the columns that 80 cannot hold
    print_table(out, e2e_table(report, wide=args.wide))
    out.print(
        "ITL ×: ITL p50 over the best stock path's at the same point; attn: the share of a decode step "
        "inside the attention calls; tokens: against the first stock path (ref)",
        soft_wrap=False,
    )
    for line in summary_lines(report["summary"]):
        out.print(escape(line), soft_wrap=False)
    out.print(
        f"load average {report['load_avg_start'][0]:.2f} → {report['load_avg_end'][0]:.2f} · "
        f"{report['threads']} threads · {report['seconds']:.0f} s",
        soft_wrap=False,
    )
    return 0


def _predictor(
    model: Any, paths: list[GenerationPath], *, dtype: torch.dtype, batches: list[int], err: Console
):
    """The cost model's prediction per row, calibrated once on this device, and that calibration
    (``(None, None)`` when unavailable)."""
    try:  # deferred: the cost model's calibration imports transformers (only for --predict)
        from attnbench.cost import generation
        from attnbench.cost.generation_calibration import calibrate_generation
    except ImportError:
        return None, None
    cost = generation.ModelCost.from_hf_config(model.config)
    with err.status("calibrating the cost model (short measurements on this device)…"):
        calibration = calibrate_generation(
            cost, paths=[p.name for p in paths], dtype=dtype, batch_sizes=batches
        )

    def predict(row: PathRun) -> dict[str, float]:
        pred = generation.predict_generation(
            cost,
            calibration,
            path=row.path,
            batch=row.batch,
            prompt_len=row.prompt_len,
            new_tokens=row.new_tokens,
        )
        return {k: float(v) for k, v in vars(pred).items() if isinstance(v, (int, float))}

    return predict, calibration


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def _progress_line(row: PathRun) -> str:
    tokens = (
        ""
        if row.tokens_match is None
        else (" · tokens same" if row.tokens_match else f" · tokens differ from step {row.first_mismatch}")
    )
    return (
        f"  b={row.batch} prompt={row.prompt_len} {row.path}: TTFT {row.ttft_s:.2f} s, "
        f"ITL p50 {row.itl_p50_s * 1e3:.1f} ms, attention {row.attention_share:.0%}{tokens}"
    )


# -- summary, table, markdown, plot ---------------------------------------------------------------
def summarise(rows: list[PathRun]) -> list[dict[str, Any]]:
    """Per (batch, prompt): the best stock path and the best backend by ITL p50, and their ratios."""
    points: dict[tuple[int, int], list[PathRun]] = {}
    for r in rows:
        points.setdefault((r.batch, r.prompt_len), []).append(r)
    out = []
    for (batch, prompt_len), runs in points.items():
        stock = [r for r in runs if r.stock]
        backends = [r for r in runs if not r.stock]
        if not stock or not backends:
            continue
        best_stock = min(stock, key=lambda r: r.itl_p50_s)
        best = min(backends, key=lambda r: r.itl_p50_s)
        sdpa = next((r for r in stock if r.path == "sdpa"), stock[0])
        out.append(
            {
                "batch": batch,
                "prompt_len": prompt_len,
                "best_stock": best_stock.path,
                "best_backend": best.path,
                "itl_ratio": best.itl_p50_s / best_stock.itl_p50_s,
                "ttft_ratio_vs_sdpa": best.ttft_s / sdpa.ttft_s,
                "e2e_ratio": best.e2e_s / min(r.e2e_s for r in stock),
                "tokens_match": best.tokens_match,
            }
        )
    return out


def summary_lines(summary: list[dict[str, Any]]) -> list[str]:
    return [
        f"b={s['batch']} prompt={s['prompt_len']}: {s['best_backend']} ITL ×{s['itl_ratio']:.2f} of "
        f"{s['best_stock']}, TTFT ×{s['ttft_ratio_vs_sdpa']:.2f} of sdpa, end to end ×{s['e2e_ratio']:.2f}"
        for s in summary
    ]


def _ratio_to_stock(row: dict[str, Any], rows: list[dict[str, Any]]) -> float:
    stock = [
        r["itl_p50_s"]
        for r in rows
        if r["stock"] and r["batch"] == row["batch"] and r["prompt_len"] == row["prompt_len"]
    ]
    return row["itl_p50_s"] / min(stock) if stock else math.nan


def e2e_table(report: dict[str, Any], *, wide: bool = False) -> Table:
    """The rows of ``attnbench e2e --json`` as a table that fits 80 columns (``wide``: more columns)."""
    columns = ["b", "prompt", "path", "TTFT s", "ITL ms", "e2e s", "attn", "ITL ×", "tokens"]
    if wide:
        columns += ["ITL p90 ms", "pred TTFT s", "pred ITL ms", "implementation"]
    title = escape(
        f"measured: {report['model']} {report['dtype']} · {report['threads']} threads · +{report['new_tokens']} tokens"
    )
    table = cli_table(
        title, columns, right=[c for c in columns if c not in ("path", "tokens", "implementation")]
    )
    rows = report["rows"]
    for r in rows:
        if r["tokens_match"] is None:
            tokens = "ref"
        else:
            tokens = "same" if r["tokens_match"] else f"≠@{r['first_mismatch']}"
        cells = [
            str(r["batch"]),
            str(r["prompt_len"]),
            r["path"],
            f"{r['ttft_s']:.2f}",
            f"{r['itl_p50_s'] * 1e3:.1f}",
            f"{r['e2e_s']:.2f}",
            f"{r['attention_share']:.0%}",
            f"{_ratio_to_stock(r, rows):.2f}",
            tokens,
        ]
        if wide:
            pred = r.get("prediction") or {}
            cells += [
                f"{r['itl_p90_s'] * 1e3:.1f}",
                f"{pred['ttft_s']:.2f}" if "ttft_s" in pred else "—",
                f"{pred['itl_s'] * 1e3:.1f}" if "itl_s" in pred else "—",
                escape(r["implementation"]),
            ]
        table.add_row(*cells)
    return table


def markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: what ran, on what, with what load; the rows; the summary."""
    lines = [
        f"# attnbench e2e: {report['model']} {report['dtype']}",
        "",
        f"`{report['command']}` · {report['machine']} · torch {report['torch']} · {report['threads']} threads · "
        f"{report['date']} · load average {report['load_avg_start'][0]:.2f} → {report['load_avg_end'][0]:.2f} · "
        f"{report.get('seconds', 0):.0f} s",
        "",
        "Each path prefills the prompt once (TTFT, the first token included), then "
        f"{report['new_tokens'] - 1} decode steps are timed one by one (ITL), "
        + (
            "interleaved across the paths (step i of every path, in an order rotated each step, before step i+1 "
            "of any: the ITLs are compared side by side). "
            if report.get("interleaved")
            else "each path to its end before the next path's prefill. "
        )
        + "`attn` is the share of the decode "
        "steps' time spent inside the attention calls; `ITL ×` is the ITL p50 over the best stock path's at the "
        "same point; tokens are compared with the first stock path's (greedy).",
        "",
        "| batch | prompt | path | implementation | TTFT s | ITL p50 ms | ITL p90 ms | e2e s | attn | ITL × | tokens | predicted TTFT s | predicted ITL ms |",
        "| ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |",
    ]
    rows = report["rows"]
    for r in rows:
        pred = r.get("prediction") or {}
        tokens = (
            "reference"
            if r["tokens_match"] is None
            else ("same" if r["tokens_match"] else f"differ from step {r['first_mismatch']}")
        )
        predicted = f"{pred['ttft_s']:.2f} | {pred['itl_s'] * 1e3:.1f}" if "ttft_s" in pred else "— | —"
        lines.append(
            f"| {r['batch']} | {r['prompt_len']} | {r['path']} | {r['implementation']} | {r['ttft_s']:.2f} | "
            f"{r['itl_p50_s'] * 1e3:.1f} | {r['itl_p90_s'] * 1e3:.1f} | {r['e2e_s']:.2f} | {r['attention_share']:.0%} | "
            f"{_ratio_to_stock(r, rows):.2f} | {tokens} | {predicted} |"
        )
    lines += ["", *[f"- {line}" for line in summary_lines(report.get("summary", []))], ""]
    return "\n".join(lines)


def _plot_module() -> Any:
    """``matplotlib.pyplot`` (Agg), or ``ValueError`` saying how to install it."""
    try:  # deferred: matplotlib is the optional plot extra
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ValueError(f"--plot needs matplotlib (pip install -e '.[plot]'): {err}") from None
    return plt


def plot(report: dict[str, Any], out: Path) -> None:
    """ITL p50 against context (prompt + half the new tokens), one line per path and batch."""
    plt = _plot_module()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for r in report["rows"]:
        series.setdefault((r["path"], r["batch"]), []).append(
            (r["prompt_len"] + r["new_tokens"] // 2, r["itl_p50_s"] * 1e3)
        )
    for (path, batch), pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{path} (batch {batch})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("ITL p50 (ms)")
    ax.set_title(f"{report['model']} {report['dtype']}, {report['threads']} threads: ITL per path")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
