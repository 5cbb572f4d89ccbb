"""vLLM's ``vllm bench serve`` against vLLM's OpenAI server, with and without attnbench in the engine.

For each path — vLLM as it ships (``ATTNBENCH_VLLM=0``) and through attnbench (``ATTNBENCH_VLLM=1``),
in that order, each its own fresh server — this starts vLLM's OpenAI-compatible server (prefix caching
on) and runs vLLM's serving benchmark client (``vllm.benchmarks.serve``, the code ``vllm bench serve``
runs) against it with its ``random`` dataset, ``--max-concurrency`` = the number of prompts, all sent at
once:

1. **fill**: every prompt with one output token — the server prefills all of them (its TTFT and
   throughput are prefill's, recorded but not the point);
2. **decode** (``--repeats`` times): the same prompts (same seed) with ``--output-len`` tokens each. The
   prompts' blocks are in vLLM's prefix cache, so a request recomputes at most its last partial block
   (``--input-len`` one past a multiple of the block size: one token) and the run is the concurrent
   decode at that context — the serving regime the kernel is for. vLLM's report gives its output
   tokens/s, TPOT/ITL and failed requests.

``ATTNBENCH_VLLM_TIMING`` is set in both servers (:mod:`attnbench_vllm.timing`: a timer around the
attention layers in the engine's worker), so the attention's seconds during each decode run are known:
its share ``s`` of vLLM's run. With ``--side-by-side JSON`` (``attnbench bench --save`` of ``cpu_decode``
and ``vllm_cpu`` at this batch and context) the kernels' ratio ``r`` predicts attnbench's output
tokens/s as vLLM's × 1 / (1 − s + s / r), printed beside what the server measured.

The model is Qwen2.5-0.5B's geometry with vLLM's dummy (random) weights; the benchmark's dataset needs a
tokenizer, so a word-level one with one word per token id (the id in base 62: any id sequence survives
decode and encode unchanged) is written beside the config.

    python scripts/vllm_serve_bench.py --prompts 16 --input-len 8193 --output-len 64 \\
        --side-by-side results/engines/side-by-side-qwen2.5-0.5b-t1-b16-epyc-avx512.json \\
        --out results/engines/vllm-serve-16x8k-epyc-avx512

Writes ``OUT.json`` and ``OUT.md`` (command, machine, date, load before and after, vLLM's result of every
run). Run it on a quiet machine (``../shared/tools/when-quiet``) and nothing else beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from attnbench.cli.common import positive_int

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from vllm_attention_share import _side_by_side  # noqa: E402
from vllm_serving_bench import QWEN_05B, model_folder, parse_engine_args, report_header, write_report  # noqa: E402

SERVER = "from vllm.entrypoints.launchers.api_server.entry import main; main()"
CLIENT = """
import json, sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""
#: the fields of vLLM's serving result this report keeps
KEPT = (
    "duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
    "output_throughput", "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms",
    "median_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms",
)  # fmt: skip


#: the tokenizer's alphabet: token id i is i written in base 62 (1-3 characters for a 152k vocabulary)
DIGITS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def word(i: int) -> str:
    """Token id ``i``'s word: ``i`` in base 62. Short words matter: vLLM's server refuses a prompt longer
    than about 7 characters per token of the context window before it tokenizes it."""
    out = DIGITS[i % 62]
    while i >= 62:
        i //= 62
        out = DIGITS[i % 62] + out
    return out


def write_tokenizer(folder: Path, vocab_size: int, eos: int) -> None:
    """A word-level tokenizer: token id ``i`` is the word :func:`word` ``(i)``, words split on and joined
    with spaces. Its own folder without a config.json: beside a Qwen2 config, transformers would load
    Qwen2's tokenizer class over it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # the special tokens (id 0 as the unknown word, ``eos``) get words no other word contains: the
    # tokenizer cuts a special token's text out of any word before it looks words up
    vocab = {word(i): i for i in range(vocab_size) if i not in (0, eos)} | {"<unk>": 0, "<eos>": eos}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins the words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")
    fast.save_pretrained(folder)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def _attention_s(timing: Path) -> float:
    return float(json.loads(timing.read_text())["attention_s"]) if timing.exists() else 0.0


def _client(port: int, model: Path, args: argparse.Namespace, output_len: int, result: Path) -> dict:
    """vLLM's serving benchmark client against the server (healthy already): no ready-check request
    (vLLM's client sends the first prompt once before the timed run unless told not to, and its
    attention would count in the run's attention share)."""
    cmd = [
        sys.executable, "-c", CLIENT, "--backend", "vllm", "--base-url", f"http://127.0.0.1:{port}",
        "--model", str(model), "--tokenizer", str(model.parent / "tokenizer"), "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(output_len), "--num-prompts", str(args.prompts),
        "--max-concurrency", str(args.prompts), "--request-rate", "inf", "--seed", "0",
        "--ready-check-timeout-sec", "0", "--disable-tqdm", "--save-result",
        "--result-dir", str(result.parent), "--result-filename", result.name,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0 or not result.exists():
        raise RuntimeError(f"vLLM's serving benchmark failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    full = json.loads(result.read_text())
    return {k: full[k] for k in KEPT if k in full}


def _serve(model: Path, *, served: bool, args: argparse.Namespace, workdir: Path) -> dict:
    """One fresh server on one path: the fill run and the decode runs."""
    name = "attnbench" if served else "vllm"
    port = _free_port()
    timing = workdir / f"timing-{name}.json"
    log = workdir / f"server-{name}.log"
    cmd = [
        sys.executable, "-c", SERVER, "--model", str(model), "--tokenizer", str(model.parent / "tokenizer"), "--load-format", "dummy", "--dtype", "bfloat16",
        "--max-model-len", str(args.input_len + args.output_len + 64), "--block-size", str(args.block_size),
        "--kv-cache-dtype", args.kv_cache_dtype, "--enable-prefix-caching", "--host", "127.0.0.1",
        "--port", str(port), "--seed", "0",
    ]  # fmt: skip
    env = os.environ | {
        "ATTNBENCH_VLLM": "1" if served else "0",
        "ATTNBENCH_VLLM_TIMING": str(timing),
        "VLLM_CPU_KVCACHE_SPACE": str(args.kv_space_gib),
    }
    started = time.monotonic()
    with log.open("w") as out:
        server = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while not _healthy(port):
            if server.poll() is not None or time.monotonic() - started > args.timeout:
                raise RuntimeError(f"vLLM's server ({name}) did not start:\n{log.read_text()[-3000:]}")
            time.sleep(2)
        start_s = time.monotonic() - started
        print(f"{name}: server up in {start_s:.0f} s", flush=True)
        fill = _client(port, model, args, 1, workdir / f"fill-{name}.json")
        print(f"{name}: fill {fill['duration']:.0f} s, {fill['failed']} failed", flush=True)
        decode = []
        for i in range(args.repeats):
            before = _attention_s(timing)
            r = _client(port, model, args, args.output_len, workdir / f"decode-{name}-{i}.json")
            r["attention_s"] = _attention_s(timing) - before
            r["attention_share"] = r["attention_s"] / r["duration"]
            decode.append(r)
            print(f"{name}: decode {r['output_throughput']:.2f} tok/s, TPOT {r['median_tpot_ms']:.1f} ms, attention {100 * r['attention_share']:.0f} %, {r['failed']} failed", flush=True)  # fmt: skip
        chose = [x for x in log.read_text().splitlines() if "attention layers on" in x]
        return {"server_start_s": start_s, "fill": fill, "decode": decode, "attnbench": chose[-1] if chose else None}  # fmt: skip
    finally:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def _median(values: list[float]) -> float:
    s = sorted(values)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--prompts", type=positive_int, default=16, help="requests, all concurrent (default 16)")
    p.add_argument(
        "--input-len",
        type=positive_int,
        default=8193,
        help="prompt tokens (default 8193: 64 blocks of 128 and one token, recomputed in the decode runs)",
    )
    p.add_argument(
        "--output-len", type=positive_int, default=64, help="tokens per decode-run request (default 64)"
    )
    p.add_argument("--repeats", type=positive_int, default=2, help="decode runs per server (default 2)")
    p.add_argument(
        "--side-by-side",
        metavar="JSON",
        help="attnbench bench --save JSON with cpu_decode and vllm_cpu at --prompts × context: the prediction",
    )
    args = parse_engine_args(
        p, argv, render, timeout=3600, timeout_help="seconds per server start and per client run"
    )
    if args is None:
        return 0
    load_before = os.getloadavg()
    paths = {}
    with tempfile.TemporaryDirectory(prefix="attnbench-vllm-serve-") as tmp:
        model = model_folder(Path(tmp))
        write_tokenizer(Path(tmp) / "tokenizer", QWEN_05B["vocab_size"], QWEN_05B["eos_token_id"])
        for served in (False, True):
            paths["attnbench" if served else "vllm"] = _serve(
                model, served=served, args=args, workdir=Path(tmp)
            )
    row: dict = {
        "prompts": args.prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "paths": paths,
    }
    for name, run in paths.items():
        row[f"{name}_output_tok_s"] = _median([r["output_throughput"] for r in run["decode"]])
        row[f"{name}_share"] = _median([r["attention_share"] for r in run["decode"]])
    row["ratio"] = row["attnbench_output_tok_s"] / row["vllm_output_tok_s"]
    row["fill_ratio"] = (
        paths["attnbench"]["fill"]["output_throughput"] / paths["vllm"]["fill"]["output_throughput"]
    )
    ratios = _side_by_side(args.side_by_side)  # the bench's context: the prompt, or the prompt less one
    ratio = ratios.get((args.prompts, args.input_len - 1)) or ratios.get((args.prompts, args.input_len))
    if ratio:
        s = row["vllm_share"]
        row["side_by_side_ratio"] = ratio
        row["predicted_ratio"] = 1 / (1 - s + s / ratio)
        row["measured_over_predicted"] = row["ratio"] / row["predicted_ratio"]
    model_text = f"Qwen2.5-0.5B geometry, vLLM dummy weights, bf16, block size {args.block_size}"
    return write_report(args, argv, load_before, model=model_text, rows=[row], render=render)


def render(report: dict) -> str:
    """The Markdown report of a run (``--render`` rebuilds it from the run's JSON, measuring nothing)."""
    lines = [
        *report_header(report, "vLLM's serving benchmark with and without attnbench in the engine"),
        f"- model: {report['model']}; vLLM's OpenAI server (prefix caching on), one fresh server per path; "
        "vLLM's `vllm.benchmarks.serve` client, random dataset, every prompt sent at once "
        "(max concurrency = prompts). Fill: one output token per prompt (the prefill). Decode: the same "
        "prompts again, now in the prefix cache, with the output length below; attention share: the "
        "engine worker's attention seconds over the run's duration (ATTNBENCH_VLLM_TIMING)",
        "",
    ]
    for r in report["rows"]:
        lines += [
            f"## {r['prompts']} concurrent × {r['input_len']} tokens, {r['output_len']} output tokens each",
            "",
            "| path | run | duration s | output tok/s | median TPOT ms | median ITL ms | mean TTFT ms | failed | attention share |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]  # fmt: skip
        for name, run in r["paths"].items():
            f = run["fill"]
            lines.append(f"| {name} | fill | {f['duration']:.1f} | {f['output_throughput']:.3f} | — | — | {f['mean_ttft_ms']:.0f} | {f['failed']} | — |")  # fmt: skip
            for i, d in enumerate(run["decode"]):
                lines.append(f"| {name} | decode {i + 1} | {d['duration']:.1f} | {d['output_throughput']:.2f} | {d['median_tpot_ms']:.1f} | {d['median_itl_ms']:.1f} | {d['mean_ttft_ms']:.0f} | {d['failed']} | {100 * d['attention_share']:.1f} % |")  # fmt: skip
        lines += [
            "",
            f"- decode output tokens/s, attnbench / vLLM (medians of the runs): **{r['ratio']:.3f}**; "
            f"fill (prefill) throughput ratio {r['fill_ratio']:.3f}",
        ]
        if "predicted_ratio" in r:
            lines.append(
                f"- predicted from the kernels side by side ({r['side_by_side_ratio']:.2f}×) and vLLM's "
                f"attention share ({100 * r['vllm_share']:.1f} %): {r['predicted_ratio']:.3f}; measured / "
                f"predicted {r['measured_over_predicted']:.3f}"
            )
        lines.append(f"- attnbench in the engine: {r['paths']['attnbench']['attnbench']}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
