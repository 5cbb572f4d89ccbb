"""``attnbench estimate`` — estimate TTFT, ITL and end-to-end latency from the cost model.

Estimate generation latency TTFT + N·ITL for a model on a GPU from the cost model: a decode step
reads every weight and the whole KV cache once, so ITL ≈ fixed + max(bytes / (bandwidth ·
achievable), FLOPs / (peak · achievable)), fixed being kernel launches and the engine's host work;
on a calibrated device the KV term is the measured model of the backend select() chooses. TTFT comes
from the prefill's FLOPs. Shows the split into weight reads, KV reads and the FLOP bound, and the
batch × context at which the KV cache overtakes the weights. All byte and FLOP figures are per GPU
of the tensor-parallel group. The model is described in docs/latency-model.md.

example: attnbench estimate --model llama-3.3-70b --gpu h100 --tp 2 --batch 1 --context 8192 --new-tokens 250
"""

from __future__ import annotations

import argparse

from rich.markup import escape
from rich.table import Table

from attnbench.cli.common import add_command, add_model_option, cli_table, console, emit_json, print_table
from attnbench.core.workload import parse_tokens
from attnbench.cost.estimate import KV_DTYPES, WEIGHT_DTYPES, Estimate, MoERouting, estimate, list_gpus
from attnbench.selection.select import backend_for


def _tokens(field: str):  # argparse type: "8k" → 8192, with the option's name in the error
    def parse(text: str) -> int:
        try:
            return parse_tokens(text, field=field)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    return parse


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--achievable {text!r} is not a number; accepted: a fraction in (0, 1]"
        ) from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"--achievable {text!r} must be a fraction in (0, 1]")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "estimate", __doc__)
    add_model_option(p, required=True)
    p.add_argument(
        "--gpu",
        required=True,
        help=f"GPU preset ({', '.join(list_gpus())}; aliases such as h100 work; datasheet figures), "
        "'this' for the measured current device (with its calibration when `attnbench calibrate` wrote "
        "one), or the PATH of a calibration file (calibration-*.yaml)",
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs (default 1)")
    p.add_argument(
        "--batch", "-b", type=_tokens("--batch"), default=1, help="sequences decoded together (default 1)"
    )
    p.add_argument(
        "--context",
        "-c",
        type=_tokens("--context"),
        required=True,
        help="tokens cached when decoding starts (8k ok)",
    )
    p.add_argument(
        "--prompt-len",
        type=_tokens("--prompt-len"),
        default=None,
        help="tokens the prefill computes (default: --context; fewer means a cached prefix)",
    )
    p.add_argument(
        "--new-tokens",
        "-n",
        type=_tokens("--new-tokens"),
        required=True,
        help="tokens generated per sequence",
    )
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="bf16", help="KV-cache dtype (default bf16)")
    p.add_argument(
        "--weight-dtype", choices=WEIGHT_DTYPES, default="bf16", help="weight dtype (default bf16)"
    )
    p.add_argument(
        "--achievable",
        type=_fraction,
        default=None,
        help="fraction of datasheet bandwidth and FLOP/s reached (default: the preset's, 0.8; 1 for 'this')",
    )
    p.add_argument("--moe-experts", type=int, default=None, help="MoE: routed experts per layer (e.g. 256)")
    p.add_argument("--moe-top-k", type=int, default=None, help="MoE: experts chosen per token (e.g. 8)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f} ms" if seconds < 1 else f"{seconds:,.3f} s"


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:,.3f} GB"


def render(est: Estimate) -> Table:
    """The breakdown as a table (also used by the docs' worked examples)."""
    gpu = est.gpu
    title = (
        f"{est.model} on {est.tp}× {gpu.label} — batch {est.batch}, context {est.context}, prompt "
        f"{est.prompt_len}, {est.new_tokens} new tokens, weights {est.weight_dtype}, KV {est.kv_dtype}"
    )
    t = cli_table(escape(title), ["per GPU", "amount", "time", "note"], right=["amount", "time"])
    t.title_justify = "left"
    bw = gpu.memory_bandwidth * gpu.achievable
    rate = f"{bw / 1e12:.2f} TB/s" if bw >= 1e12 else f"{bw / 1e9:.2f} GB/s"
    s = est.step
    t.add_row(
        "weight reads",
        _gb(s.weight_bytes),
        _ms(s.weight_s),
        f"at {rate} ({gpu.achievable:g} of {'measured' if gpu.measured else 'datasheet'})",
    )
    att = est.attention
    t.add_row(
        "KV reads",
        _gb(s.kv_bytes),
        _ms(s.kv_s),
        f"{est.batch} × {est.context + 1} tokens × {est.kv_bytes_per_token:,} B"
        if att is None
        else f"calibrated {att.backend}: {est.batch} × {est.context + 1} tokens × {att.kv_bytes_per_token:,} B",
    )
    t.add_row("memory total", _gb(s.weight_bytes + s.kv_bytes), _ms(s.memory_s), "")
    t.add_row("FLOP bound", f"{s.flops / 1e12:,.3f} TFLOP", _ms(s.flop_s), "matmuls + attention")
    if s.fixed_s:
        t.add_row("fixed per step", "", _ms(s.fixed_s), "kernel launches + engine host work")
    t.add_row(
        "[bold]ITL (first step)",
        "",
        f"[bold]{_ms(est.itl_s)}",
        f"{s.bound}-bound" + (" + fixed" if s.fixed_s else ""),
    )
    t.add_row(
        "ITL (mean over N)",
        "",
        _ms(est.itl_mean_s),
        f"contexts {est.context}..{est.context + est.new_tokens - 1}",
    )
    p = est.prefill
    t.add_row(
        "[bold]TTFT (prefill)",
        f"{p.flops / 1e12:,.1f} TFLOP",
        f"[bold]{_ms(est.ttft_s)}",
        f"{p.bound}-bound; memory {_ms(p.memory_s)}, FLOPs {_ms(p.flop_s)}",
    )
    t.add_row("[bold]end-to-end", "", f"[bold]{_ms(est.e2e_s)}", f"TTFT + {est.new_tokens} × mean ITL")
    t.add_row(
        "tokens/s",
        f"{est.tokens_per_s:,.1f}",
        "",
        f"decode, whole batch ({est.tokens_per_s_per_sequence:,.1f} per sequence)",
    )
    share = s.kv_bytes / (s.kv_bytes + s.weight_bytes)
    t.add_row(
        "KV overtakes weights",
        f"{est.crossover_tokens:,.0f}",
        "",
        f"batch × (context+1) tokens; at batch {est.batch}: context > {max(est.crossover_context, 0):,.0f} "
        f"(now KV is {100 * share:.1f}% of bytes)",
    )
    t.add_row(
        "memory needed",
        _gb(est.memory_needed_bytes),
        "",
        f"weights + KV for {est.context + est.new_tokens} tokens; GPU has {gpu.memory_bytes / 1e9:,.0f} GB",
    )
    return t


def run(args: argparse.Namespace) -> int:
    moe = None
    if (args.moe_experts is None) != (args.moe_top_k is None):
        raise ValueError("--moe-experts and --moe-top-k go together (e.g. --moe-experts 256 --moe-top-k 8)")
    if args.moe_experts is not None:
        moe = MoERouting(num_experts=args.moe_experts, top_k=args.moe_top_k)
    est = estimate(
        args.model,
        gpu=args.gpu,
        tp=args.tp,
        batch=args.batch,
        context=args.context,
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        kv_dtype=args.kv_dtype,
        weight_dtype=args.weight_dtype,
        choose=backend_for,
        achievable=args.achievable,
        moe=moe,
    )
    if args.json:
        emit_json(est.as_dict())
        return 0
    out = console()
    print_table(out, render(est))
    out.print(f"GPU figures: {est.gpu.source}")
    if est.attention is not None:
        out.print(f"KV term: {est.attention.fit}; backend chosen: {est.attention.selected}")
    for note in est.notes:
        out.print(f"note: {note}")
    return 0
