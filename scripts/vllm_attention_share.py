"""The attention's share of vLLM's decode step, with and without attnbench's kernel in the engine.

For each point (batch × input length) and each path — vLLM as it ships (``ATTNBENCH_VLLM=0``) and
through attnbench (``ATTNBENCH_VLLM=1``), alternated, each in a fresh process — this builds vLLM's
engine as ``vllm bench latency`` does (its worker process, its thread binding, compiled graph; prefix
caching on), with ``ATTNBENCH_VLLM_TIMING`` set: the plugin puts a timer around the attention layers'
``forward`` and KV-cache write in the worker (vLLM's ``CPU_ATTN`` implementation on one path,
attnbench's on the other: vLLM calls both outside its compiled graph) and writes the cumulative time
after each step (:mod:`attnbench_vllm.timing`). It prefills the batch once, then, ``--iters`` times,
generates 1 and 1 + STEPS tokens from the same (cached) prompts: the decode step is the difference over
STEPS, and so is the attention's time within it. The share is attention / step.

With ``--side-by-side JSON`` (the JSON ``attnbench bench --save`` writes for ``cpu_decode`` and ``vllm_cpu`` at the same
geometry, batch, context and dtype) it also prints what the kernels' side-by-side ratio ``r`` and vLLM's
share ``s`` predict for the step through attnbench, ``step_vllm · (1 − s + s / r)``, beside what the
engine measured: the integration loses nothing where the two agree. A second table splits each path's
step into the attention, the metadata builder, Python's garbage collector and the rest.

    python scripts/vllm_attention_share.py --points 1x1024,1x8192,4x8192 --out results/engines/vllm-attention-share-epyc-avx512

Writes ``OUT.json`` and ``OUT.md`` (command, machine, date, load before and after). Run it on a quiet
machine (``../shared/tools/when-quiet``) and nothing else beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from attnbench.cli.common import positive_int

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from vllm_serving_bench import (  # noqa: E402
    _points,
    add_engine_options,
    model_folder,
    rendered,
    report_header,
    write_report,
)


def child(args: argparse.Namespace) -> None:
    """One engine, one path: the step and attention times (printed as one ``RESULT`` JSON line)."""
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    timing = Path(os.environ["ATTNBENCH_VLLM_TIMING"])

    def spent() -> dict:
        return json.loads(timing.read_text()) if timing.exists() else {"attention_s": 0.0}

    llm = LLM(
        model=args.model,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=args.input_len + args.steps + 64,
        block_size=args.block_size,
        enable_prefix_caching=True,
        kv_cache_dtype=args.kv_cache_dtype,
        seed=0,
    )
    gen = torch.Generator().manual_seed(0)
    prompts = [
        TokensPrompt(prompt_token_ids=torch.randint(0, 10000, (args.input_len,), generator=gen).tolist())
        for _ in range(args.batch)
    ]

    sums = ("attention_s", "build_s", "gc_s")

    def run(tokens: int) -> dict[str, float]:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, detokenize=False)
        before, t0 = spent(), time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall, after = time.perf_counter() - t0, spent()
        return {"step_s": wall} | {k: after.get(k, 0.0) - before.get(k, 0.0) for k in sums}

    run(1)  # the one full prefill: the prompts are cached from here on
    per_step: dict[str, list[float]] = {k: [] for k in ("step_s", *sums)}
    for _ in range(args.iters):
        one, many = run(1), run(1 + args.steps)
        for k, values in per_step.items():
            values.append((many[k] - one[k]) / args.steps)
    worker = spent()
    result = per_step | {"threads": worker.get("threads"), "affinity": worker.get("affinity")}
    print("RESULT " + json.dumps(result), flush=True)


def _run(model: Path, *, served: bool, batch: int, input_len: int, args: argparse.Namespace) -> dict:
    cmd = [
        sys.executable, str(Path(__file__).resolve()), "--child", "--model", str(model),
        "--batch", str(batch), "--input-len", str(input_len), "--steps", str(args.steps),
        "--iters", str(args.iters), "--block-size", str(args.block_size), "--kv-cache-dtype", args.kv_cache_dtype,
    ]  # fmt: skip
    env = os.environ | {
        "ATTNBENCH_VLLM": "1" if served else "0",
        "ATTNBENCH_VLLM_TIMING": str(Path(tempfile.mkdtemp(prefix="attnbench-timing-")) / "attention.json"),
        "VLLM_CPU_KVCACHE_SPACE": str(args.kv_space_gib),
    }
    started = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(
            f"the engine run failed ({'with' if served else 'without'} attnbench, batch {batch} × {input_len}):\n"
            + (proc.stdout + proc.stderr)[-3000:]
        )
    r = json.loads(lines[-1].removeprefix("RESULT "))
    for part in ("step", "attention", "build", "gc"):
        r[f"{part}_ms"] = 1000 * statistics.median(r[f"{part}_s"])
    r["share"] = r["attention_ms"] / r["step_ms"]
    r["wall_s"] = time.monotonic() - started
    return r


def _side_by_side(path: str | None) -> dict[tuple[int, int], float]:
    """``vllm_cpu`` step / ``cpu_decode`` step per (batch, context) from ``attnbench bench --save``'s JSON
    (``results``: a row per backend and workload, its ``step`` median)."""
    if not path:
        return {}
    times: dict[tuple[int, int], dict[str, float]] = {}
    for row in json.loads(Path(path).read_text())["results"]:
        if row.get("step"):
            key = (int(row["batch"]), int(row["context"]))
            times.setdefault(key, {})[row["backend"]] = float(row["step"]["median_s"])
    return {
        k: v["vllm_cpu"] / v["cpu_decode"] for k, v in times.items() if {"vllm_cpu", "cpu_decode"} <= set(v)
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--points", type=_points, default=_points("1x1024"), help="BATCHxINPUT points (default 1x1024)"
    )
    p.add_argument("--steps", type=positive_int, default=32, help="decode steps per measurement (default 32)")
    p.add_argument(
        "--iters", type=positive_int, default=3, help="measurements per engine (median; default 3)"
    )
    p.add_argument(
        "--side-by-side",
        metavar="JSON",
        help="the JSON of attnbench bench --save with cpu_decode and vllm_cpu at the points",
    )
    add_engine_options(p, timeout=3600, timeout_help="seconds per engine run")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    p.add_argument("--input-len", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return 0
    if rendered(p, args, render):
        return 0
    ratios = _side_by_side(args.side_by_side)
    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory(prefix="attnbench-vllm-share-") as tmp:
        model = model_folder(Path(tmp))
        for batch, input_len in args.points:
            runs = {}
            for served in (False, True):
                r = _run(model, served=served, batch=batch, input_len=input_len, args=args)
                runs["attnbench" if served else "vllm"] = r
                print(f"b={batch} in={input_len} {'attnbench' if served else 'vllm'}: step {r['step_ms']:.1f} ms, attention {r['attention_ms']:.1f} ms ({100 * r['share']:.0f} %), {r['wall_s']:.0f} s", flush=True)  # fmt: skip
            row: dict = {"batch": batch, "input_len": input_len, "runs": runs}
            ratio = ratios.get((batch, input_len))
            if ratio:
                v = runs["vllm"]
                row["side_by_side_ratio"] = ratio
                row["predicted_step_ms"] = v["step_ms"] * (1 - v["share"] + v["share"] / ratio)
                row["measured_over_predicted"] = runs["attnbench"]["step_ms"] / row["predicted_step_ms"]
            rows.append(row)
    model = f"Qwen2.5-0.5B geometry, vLLM dummy weights, bf16, block size {args.block_size}"
    return write_report(args, argv, load_before, model=model, rows=rows, render=render, steps=args.steps)


def _threads(report: dict) -> str:
    seen = sorted(
        {
            (r["runs"][p].get("threads"), str(r["runs"][p].get("affinity")))
            for r in report["rows"]
            for p in r["runs"]
        }
        - {(None, "None")}
    )
    if not seen:
        return "threads not recorded (an in-process engine at torch's default)"
    return "; ".join(f"{t} torch thread(s), CPUs {a}" for t, a in seen)


def render(report: dict) -> str:
    """The Markdown report of a run (``--render`` rebuilds it from the run's JSON, measuring nothing)."""
    lines = [
        *report_header(
            report, "The attention's share of vLLM's decode step, with and without attnbench in the engine"
        ),
        f"- the model's worker process: {_threads(report)}\n"
        f"- model: {report['model']}; one engine per path and point (vLLM's defaults, prefix "
        f"caching on), paths alternated; step and attention = (time of 1 + {report['steps']} tokens − time "
        f"of 1 token) / {report['steps']}, median of the engine's measurements; attention = the attention "
        "layers' forward and KV write, timed around vLLM's calls into them",
        "",
        "| batch | input | vLLM step ms | vLLM attention ms (share) | attnbench step ms | attnbench attention ms (share) | step ratio | attention ratio | side-by-side ratio | predicted step ms | measured / predicted |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["rows"]:
        v, a = r["runs"]["vllm"], r["runs"]["attnbench"]
        pred = (
            f"{r['side_by_side_ratio']:.2f} | {r['predicted_step_ms']:.1f} | {r['measured_over_predicted']:.3f}"
            if "side_by_side_ratio" in r
            else "— | — | —"
        )
        lines.append(
            f"| {r['batch']} | {r['input_len']} | {v['step_ms']:.1f} | {v['attention_ms']:.1f} ({100 * v['share']:.0f} %) "
            f"| {a['step_ms']:.1f} | {a['attention_ms']:.1f} ({100 * a['share']:.0f} %) | {a['step_ms'] / v['step_ms']:.3f} "
            f"| {a['attention_ms'] / v['attention_ms']:.3f} | {pred} |"
        )
    if all("build_ms" in run for r in report["rows"] for run in r["runs"].values()):
        lines += [
            "",
            "Where each path's decode step goes (ms a step; builder = the attention metadata builder's "
            "`build`, vLLM's per-step metadata and on attnbench's path its plan; collector = Python's "
            "garbage collector; rest = the step less the three: the weights' GEMMs, sampling, scheduling):",
            "",
            "| batch | input | path | step | attention | builder | collector | rest |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in report["rows"]:
            for name, run in r["runs"].items():
                rest = run["step_ms"] - run["attention_ms"] - run["build_ms"] - run["gc_ms"]
                lines.append(
                    f"| {r['batch']} | {r['input_len']} | {name} | {run['step_ms']:.1f} | {run['attention_ms']:.1f} "
                    f"| {run['build_ms']:.2f} | {run['gc_ms']:.2f} | {rest:.1f} |"
                )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
