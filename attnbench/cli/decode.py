"""``attnbench decode`` — prompt + N new tokens through the decode loop: TTFT, ITL p50/p90, end-to-end.

Run a prompt of --prompt-len tokens, then decode until --new-tokens tokens exist, through the
synthetic attention-only model (every layer of the model's shape, attention and KV cache only) with
one backend — or, when --model is a checkpoint directory (config.json + safetensors), through the
real model, loaded by transformers, its attention routed through the backend
(attnbench.integrations.transformers; for the MLA latent cache, the DeepSeek latent decoder; random
prompt tokens, greedy). The backend is checked against float64 attention first. Prints TTFT (the
prefill, which yields the first token), ITL p50/p90 over the N-1 decode steps, end-to-end latency
and, beside it, TTFT + (N-1)·ITL (mean, and p50): with the mean the two agree within 10% when the
loop adds nothing of its own; the p50 form also needs a quiet machine.

example: attnbench decode --model llama-3.1-8b --prompt-len 1k --new-tokens 64 --backend flash
"""

from __future__ import annotations

import argparse
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from attnbench.cli.common import (
    add_command,
    add_device_option,
    add_model_option,
    cli_table,
    command_line,
    console,
    emit_json,
    print_table,
    run_options,
    tokens_to_generate,
)
from attnbench.core.backend import Backend
from attnbench.core.device import load_profile
from attnbench.core.registry import load_registry
from attnbench.core.shapes import load_shape, parse_dtype
from attnbench.core.workload import Workload, parse_tokens
from attnbench.correctness.gate import check
from attnbench.measure.bench import CheckFailed, check_workload
from attnbench.measure.decode import SyntheticModel, generate
from attnbench.models import load_model

#: ``e2e`` must be within this fraction of ``TTFT + (N-1)·ITL`` for the check to pass.
E2E_TOLERANCE = 0.10


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "decode", __doc__, parents=[run_options()])
    add_model_option(p, required=True)
    p.add_argument("--prompt-len", "-p", required=True, help="prompt tokens per sequence (k suffix accepted)")
    p.add_argument("--new-tokens", "-n", required=True, help="tokens to generate per sequence (≥ 2)")
    p.add_argument("--batch", "-b", default="1", help="sequences decoded together (default 1)")
    p.add_argument(
        "--backend", default="naive", help="backend name (default naive; see `attnbench backends`)"
    )
    p.add_argument("--dtype", default="bf16", help="compute/KV dtype: bf16, fp16, fp32 (default bf16)")
    add_device_option(p)
    p.add_argument("--warmup-runs", type=int, default=1, help="untimed short runs first (default 1)")
    p.add_argument("--no-check", action="store_true", help="skip the correctness gate (not recommended)")
    p.add_argument("--remeasure", action="store_true", help="measure the device's bandwidth again")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    prompt_len = parse_tokens(args.prompt_len, field="--prompt-len")
    new_tokens = tokens_to_generate(args)
    batch = parse_tokens(args.batch, field="--batch")
    if args.layers is not None and args.layers < 1:
        raise ValueError(f"--layers = {args.layers} must be ≥ 1")
    if args.warmup_runs < 0:
        raise ValueError(f"--warmup-runs = {args.warmup_runs} must be ≥ 0")
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads = {args.threads} must be ≥ 1")
        torch.set_num_threads(args.threads)
    backend = load_registry().get(args.backend)
    shape = load_shape(args.model)
    workload = Workload(
        shape, (prompt_len + new_tokens,) * batch, parse_dtype(args.dtype, field="--dtype"), args.device
    )
    resolution = backend.resolve(workload).require()
    err = Console(stderr=True)
    with err.status("loading device profile…"):
        profile = load_profile(args.device, remeasure=args.remeasure)
    result_check = None
    if not args.no_check:
        with err.status(f"checking {backend.name} against float64 attention…"):
            result_check = check(backend, check_workload(workload, form=backend.kv_form))
        if not result_check.passed:
            raise CheckFailed(result_check)
    checkpoint = _checkpoint_dir(args.model)
    if checkpoint is not None:
        if args.layers is not None:
            raise ValueError(f"--layers applies to the synthetic model; {args.model!r} is a real checkpoint")
        with err.status(f"loading {checkpoint.name} with transformers…"):
            model: Any = _real_model(
                checkpoint, backend, batch=batch, dtype=workload.dtype, device=args.device
            )
        prompt = torch.randint(
            0, model.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(0)
        )
        inputs: dict[str, Any] = {"prompt": prompt}
        kind = (
            "transformers (real model)"
            if backend.kv_form != "latent"
            else "DeepSeek latent decoder (real model)"
        )
        num_layers = materialised = shape.num_layers
    else:
        model = SyntheticModel(backend, workload, num_layers=args.layers)
        inputs = {"prompt_len": prompt_len}
        kind, num_layers = "synthetic attention-only", model.num_layers
    with err.status("warm-up…"):
        for _ in range(args.warmup_runs):
            generate(model, **inputs, new_tokens=min(new_tokens, 4))
    load_start = os.getloadavg()
    with err.status(f"decoding {new_tokens} tokens…"):
        run_ = generate(model, **inputs, new_tokens=new_tokens)
    if checkpoint is None:
        materialised = model.layers_materialised
        model.release()
    report: dict[str, Any] = {
        "command": command_line(args),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": shape.name,
        "model_kind": kind,
        "backend": backend.name,
        "implementation": resolution.implementation,
        "dtype": workload.dtype_name,
        "num_layers": num_layers,
        "layers_materialised": materialised,
        "device": profile.as_dict(),
        "load_avg_start": list(load_start),
        "load_avg_end": list(os.getloadavg()),
        "check": result_check.as_dict() if result_check else None,
        **run_.as_dict(bandwidth=profile.bandwidth),
    }
    report["e2e_within_10pct"] = abs(report["e2e_ratio"] - 1) <= E2E_TOLERANCE
    if args.json:
        emit_json(report)
        return 0
    _print(console(), report)
    return 0


def _checkpoint_dir(model: str) -> Path | None:
    """``model`` as a checkpoint directory with weights (config.json + safetensors), else ``None``."""
    path = Path(model)
    if not path.is_dir() or not (path / "config.json").is_file():
        return None
    return path if any(path.glob("*.safetensors")) else None


def _real_model(checkpoint: Path, backend: Backend, *, batch: int, dtype: torch.dtype, device: str) -> Any:
    """The checkpoint as a :class:`~attnbench.measure.decode.DecodeModel` whose attention runs through ``backend``:
    transformers' own model through the integration, or for a latent-cache backend (``mla``) the
    DeepSeek latent decoder (transformers' module cannot express that form)."""
    if backend.kv_form == "latent":
        return load_model(checkpoint, backend=backend, dtype=dtype, device=device, batch=batch)
    try:  # deferred: transformers is an optional extra, needed only for a checkpoint's own model
        import transformers

        from attnbench.integrations.transformers import TransformersDecodeModel
    except ImportError as err:
        raise ValueError(
            f"--model {str(checkpoint)!r}: running a real model needs transformers ({err})"
        ) from None
    try:
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint))
    except (OSError, KeyError) as err:
        raise ValueError(f"--model {str(checkpoint)!r}: transformers cannot load it: {err}") from None
    # transformers declares PreTrainedModel.to through functools.wraps, which mypy cannot bind as a method
    model = hf.to(device=device, dtype=dtype).eval()  # type: ignore[call-arg]  # see above
    return TransformersDecodeModel(model, backend, batch=batch)


def _print(out: Console, r: dict[str, Any]) -> None:
    if not out.is_terminal:
        out.width = 140
    print_table(out, decode_table(r))
    if r["layers_materialised"] < r["num_layers"]:
        out.print(
            f"{r['layers_materialised']} distinct layer caches are materialised; the {r['num_layers']} layer "
            "calls of a step cycle over them (each still reads its cache from DRAM)."
        )
    out.print(
        f"load average {r['load_avg_start'][0]:.2f} → {r['load_avg_end'][0]:.2f} (shared machine: noisy)"
    )


def decode_table(r: dict[str, Any]) -> Table:
    """The report of ``attnbench decode --json`` as a table (metric, value, note) that fits 80 columns."""
    n = r["new_tokens"]
    table = cli_table(
        escape(
            f"measured: {r['model']} ({r['model_kind']}, {r['num_layers']} layers) · {r['backend']} "
            f"[{r['implementation']}] · {r['dtype']} · batch {r['batch']} · prompt {r['prompt_len']} → +{n} tokens"
        ),
        ["metric", "value", "note"],
        right=["value"],
    )
    check_note = "skipped (--no-check)"
    if r["check"]:
        e = r["check"]["error"]
        check_note = f"rel_l2 {e['rel_l2']:.1e}, max_abs {e['max_abs']:.1e}, cos {e['cosine']:.6f}: pass"
    table.add_row("correctness", "", check_note)
    table.add_row("TTFT", f"{r['ttft_s'] * 1e3:.2f} ms", "prefill; yields the first token")
    table.add_row("ITL p50", f"{r['itl_p50_s'] * 1e3:.2f} ms", f"over {r['decode_steps']} decode steps")
    table.add_row("ITL p90", f"{r['itl_p90_s'] * 1e3:.2f} ms", "")
    table.add_row("ITL mean", f"{r['itl_mean_s'] * 1e3:.2f} ms", "")
    verdict = "[green]within 10%[/green]" if r["e2e_within_10pct"] else "[red]NOT within 10%[/red]"
    table.add_row("end-to-end", f"{r['e2e_s'] * 1e3:.2f} ms", "")
    table.add_row(
        f"TTFT + {r['decode_steps']}·ITL mean",
        f"{r['e2e_check_s'] * 1e3:.2f} ms",
        f"e2e / this = {r['e2e_ratio']:.3f} ({verdict})",
    )
    table.add_row(
        f"TTFT + {r['decode_steps']}·ITL p50",
        f"{(r['ttft_s'] + r['decode_steps'] * r['itl_p50_s']) * 1e3:.2f} ms",
        f"e2e / this = {r['e2e_ratio_p50']:.3f} (informative: slow outlier steps move it)",
    )
    table.add_row("KV bytes / step", f"{r['kv_bytes_per_step'] / 1e6:.1f} MB", "mean over the decode steps")
    pct = r["pct_of_bandwidth"]
    table.add_row(
        "KV GB/s (p50 step)",
        f"{r['gbps']:.2f}",
        f"{pct:.0f}% of measured {r['device']['copy_bandwidth'] / 1e9:.1f} GB/s" if pct is not None else "",
    )
    return table
