"""Options and helpers shared by the subcommands."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rich.console import Console

from attnbench.shapes import list_presets, load_shape
from attnbench.workload import Workload, parse_int_list, parse_tokens

__all__ = ["add_model_option", "add_workload_options", "console", "emit_json", "workloads_from_args"]


def console() -> Console:
    """Rich console on stderr-safe stdout; plain text when not a terminal."""
    return Console(highlight=False, soft_wrap=True)


def add_model_option(
    parser: argparse.ArgumentParser, *, required: bool = False, default: str | None = None
) -> None:
    parser.add_argument(
        "--model",
        "-m",
        required=required,
        default=default,
        help=f"preset ({', '.join(list_presets())}) or a path to a Hugging Face config.json or a shape YAML",
    )


def add_workload_options(
    parser: argparse.ArgumentParser, *, batch: str, context: str, dtype: str = "bf16"
) -> None:
    parser.add_argument(
        "--batch", "-b", default=batch, help=f"batch sizes, comma-separated (default {batch})"
    )
    parser.add_argument(
        "--context",
        "-c",
        default=context,
        help=f"context lengths, comma-separated, k/m suffixes (default {context})",
    )
    parser.add_argument(
        "--dtype",
        default=dtype,
        help=f"compute/KV dtypes, comma-separated: bf16, fp16, fp32 (default {dtype})",
    )
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")


def workloads_from_args(args: argparse.Namespace) -> list[Workload]:
    shape = load_shape(args.model)
    batches = parse_int_list(args.batch, field="--batch")
    contexts = parse_int_list(args.context, field="--context")
    dtypes = [d.strip() for d in str(args.dtype).split(",") if d.strip()]
    return [
        Workload.uniform(shape, batch=b, context=c, dtype=d, device=args.device)
        for d in dtypes
        for b in batches
        for c in contexts
    ]


def emit_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


_ = parse_tokens  # re-exported for subcommands
