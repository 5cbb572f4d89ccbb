"""Options and helpers shared by the subcommands."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import shlex
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TextIO

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from attnbench.cli.tables import (  # re-exported: the commands import the table helpers from here
    add_wide_option,
    cli_table,
    config_text,
    ms_text,
    print_table,
    render_text,
    truncated_cells,
)
from attnbench.core.device import AUTO, available_memory, fingerprint, resolve_device
from attnbench.core.shapes import list_presets, load_shape
from attnbench.core.workload import Workload, parse_int_list, parse_tokens

__all__ = [
    "add_command",
    "add_device_option",
    "add_model_option",
    "add_query_command",
    "add_wide_option",
    "add_workload_options",
    "cli_table",
    "command_line",
    "config_text",
    "console",
    "emit_json",
    "json_stdout",
    "ms_text",
    "print_table",
    "progress_bar",
    "render_text",
    "run_line",
    "run_options",
    "run_record",
    "sigterm_as_interrupt",
    "timing_options",
    "truncated_cells",
    "workloads_from_args",
    "write_report",
]


def add_command(
    sub: argparse._SubParsersAction, name: str, doc: str | None, **kwargs: Any
) -> argparse.ArgumentParser:
    """The parser of subcommand ``name``, described by its module's docstring: the first line, after
    the dash, is the ``--help`` line; the paragraphs after it are the description, but for a last one
    that starts with ``example:``, which is the epilog."""
    head, _, body = (doc or "").strip().partition("\n")
    help_line = head.partition(" — ")[2].rstrip(".") or head
    description, _, example = body.strip().rpartition("\n\nexample: ")
    if not description:  # no example paragraph
        description, example = body.strip(), ""
    epilog = "example: " + " ".join(example.split()) if example else None
    return sub.add_parser(name, help=help_line, description=description or None, epilog=epilog, **kwargs)


def console() -> Console:
    """Rich console on stderr-safe stdout; plain text when not a terminal."""
    return Console(highlight=False, soft_wrap=True)


def progress_bar(**kwargs: Any) -> Progress:
    """The progress bar of a long command: what runs now, the bar, done/total, time elapsed."""
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), **kwargs
    )


def add_model_option(
    parser: argparse.ArgumentParser, *, required: bool = False, default: str | None = None
) -> None:
    parser.add_argument(
        "--model",
        "-m",
        required=required,
        default=default,
        help=f"preset ({', '.join(list_presets())}), a checkpoint directory (config.json + safetensors), a Hugging Face config.json or a shape YAML",
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
    add_device_option(parser)


def add_query_command(
    sub: argparse._SubParsersAction, name: str, doc: str | None, *, model_required: bool = False
) -> argparse.ArgumentParser:
    """The parser of a command that answers about workloads without running them (``backends``,
    ``select``): :func:`add_command` with ``--model`` and the workload options at one batch and a 4k
    context (``--batch 1 --context 4096``)."""
    p = add_command(sub, name, doc)
    add_model_option(p, required=model_required)
    add_workload_options(p, batch="1", context="4096")
    return p


def add_device_option(parser: argparse.ArgumentParser, *, what: str = "torch device") -> None:
    """``--device``, default ``auto``: CUDA when torch sees a GPU, else CPU (resolved when parsed)."""
    parser.add_argument(
        "--device",
        default=AUTO,
        type=resolve_device,
        help=f"{what}: auto (CUDA when available, else cpu; the default), cuda, cuda:N or cpu",
    )


def timing_options(
    *, warmup: int = 2, repeats: int = 10, max_seconds: float | None = None
) -> argparse.ArgumentParser:
    """A parent parser (``parents=[...]``): how decode steps are timed, shared by ``bench`` and ``tune``."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument(
        "--warmup", type=int, default=warmup, help=f"untimed decode steps first (default {warmup})"
    )
    p.add_argument(
        "--repeats", type=int, default=repeats, help=f"timed decode steps (median; default {repeats})"
    )
    p.add_argument(
        "--max-seconds",
        type=float,
        default=max_seconds,
        metavar="S",
        help="stop sampling a candidate's steps after S seconds, keeping at least 3 samples"
        + (f" (default {max_seconds:g})" if max_seconds is not None else " (default: no limit)"),
    )
    return p


def run_options(*, layers_help: str | None = None) -> argparse.ArgumentParser:
    """A parent parser: ``--layers``, ``--threads`` and ``--json``, shared by ``bench``, ``tune`` and
    ``decode``; ``layers_help`` says what ``--layers`` does where it differs (``tune``'s default)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help=layers_help
        or "layers per decode step of the synthetic model (default: the model's); fewer make a long "
        "context quicker, and the per-layer times are what the backends differ in",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch, here and in any worker (default: torch's choice); part of the device "
        "fingerprint, so each thread count has its own results",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    return p


#: Options named first in :func:`command_line` (what ran), in this order; the rest follow (how).
_FIRST = ("model", "prompt_len", "new_tokens", "batch", "context", "backend", "dtype", "device", "backends")
#: Options never written into a reproduced command: output and storage locations of this machine.
_LOCAL = ("json", "save", "out", "results_dir", "storage")


def positive_int(text: str) -> int:
    """An argparse ``type``: a whole number ≥ 1. argparse's error names the option; this names the value
    and what is accepted (``argument --rounds: 0: must be a whole number ≥ 1``)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a whole number ≥ 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be a whole number ≥ 1")
    return value


def positive_int_list(text: str) -> list[int]:
    """An argparse ``type``: comma-separated whole numbers ≥ 1, ``k`` suffix accepted (``1k,4k``)."""
    try:
        values = parse_int_list(text, field="value")
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected whole numbers ≥ 1, comma-separated (k suffix accepted)"
        )
    return values


def command_line(
    args: argparse.Namespace, *, parser: argparse.ArgumentParser | None = None, prog: str | None = None
) -> str:
    """The command that reproduces this run, rebuilt from the parsed options against the parser's
    defaults (``attnbench bench --model m --batch 1,8 …``): options left at their default are left
    out, and so are output and storage locations (``--save``, ``--results``, ``--storage``, ``--json``).

    Subcommands find their parser in ``args``; a script passes its own ``parser`` and ``prog``
    (``"python scripts/gate_cost.py"``)."""
    parser = parser or args.command_parser
    options = [a for a in parser._actions if a.option_strings and a.dest not in _LOCAL and a.dest != "help"]
    options.sort(key=lambda a: _FIRST.index(a.dest) if a.dest in _FIRST else len(_FIRST))
    parts = [prog or parser.prog]
    for action in options:
        value = getattr(args, action.dest, action.default)
        default = action.default
        if isinstance(default, str) and callable(action.type):
            default = action.type(default)  # argparse converts a string default the same way
        if value == default:
            continue
        flag = max(action.option_strings, key=len)
        if isinstance(value, bool) and action.nargs == 0:
            parts.append(flag)
        else:
            text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
            parts.append(f"{flag} {shlex.quote(text)}")
    return " ".join(parts)


def run_record(*, command: str, load_start: Sequence[float], started: float | None = None) -> dict[str, Any]:
    """What every saved result states about its run: the command, the machine and its CPU's model, torch, the date, the
    load average before and now, and (with ``started``, a ``time.time()``) the seconds it took."""

    record: dict[str, Any] = {
        "command": command,
        "machine": f"{platform.node()} — {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "cpu": fingerprint()["name"],
        "torch": torch.__version__,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "load_avg_start": list(load_start),
        "load_avg_end": list(os.getloadavg()),
    }
    if started is not None:
        record["seconds"] = round(time.time() - started, 1)
    return record


def run_line(record: Mapping[str, Any]) -> str:
    """A :func:`run_record` as a saved result's markdown states it, left for the caller to go on or
    end: ``"`command` — machine, CPU: cpu, torch version, date, load average start → end"``."""
    return (
        f"`{record['command']}` — {record['machine']}, CPU: {record['cpu']}, torch {record['torch']}, "
        f"{record['date']}, load average {record['load_avg_start'][0]:.2f} → {record['load_avg_end'][0]:.2f}"
    )


def write_report(out: str | Path, report: Mapping[str, Any], markdown: str, *, indent: int = 1) -> None:
    """Write a saved result: ``report`` to ``<out>.json`` and ``markdown`` to ``<out>.md`` (folder made)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=indent) + "\n")
    out.with_suffix(".md").write_text(markdown)


def tokens_to_generate(args: argparse.Namespace) -> int:
    """``--new-tokens`` as a count, refused below 2 (one token from prefill, then decode steps)."""
    new_tokens = parse_tokens(args.new_tokens, field="--new-tokens")
    if new_tokens < 2:
        raise ValueError(
            f"--new-tokens {args.new_tokens!r} must be ≥ 2 (one from prefill, then decode steps)"
        )
    return new_tokens


def workloads_from_args(args: argparse.Namespace) -> list[Workload]:
    shape = load_shape(args.model)
    batches = parse_int_list(args.batch, field="--batch")
    contexts = parse_int_list(args.context, field="--context")
    dtypes = [d.strip() for d in str(args.dtype).split(",") if d.strip()]
    workloads = [
        Workload.uniform(shape, batch=b, context=c, dtype=d, device=args.device)
        for d in dtypes
        for b in batches
        for c in contexts
    ]
    for w in workloads:
        _check_fits(w)
    return workloads


def _check_fits(workload: Workload) -> None:
    """Refuse a workload whose KV cache cannot be allocated even for one layer (e.g. ``--context 200m``)."""
    layers = max(1, int(getattr(workload.shape, "num_layers", 1) or 1))
    one_layer = workload.kv_bytes_per_step() // layers
    available = available_memory(workload.device)
    if available is not None and one_layer > available:
        raise ValueError(
            f"--context/--batch: {workload.describe()} needs {one_layer / 1e9:.3g} GB of KV cache for a single "
            f"layer, more than the {available / 1e9:.3g} GB available on {workload.device}; accepted: a batch "
            "and context whose cache fits in memory"
        )


class _StdoutToStderr(io.TextIOBase):
    """``sys.stdout`` while a ``--json`` command runs: prints go to stderr; ``json_document`` is the
    real stdout, which only :func:`emit_json` writes to."""

    def __init__(self, document: TextIO) -> None:
        self.json_document = document

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


@contextlib.contextmanager
def json_stdout() -> Iterator[None]:
    """Keep stdout for the JSON document alone: file descriptor 1 (where native code and child
    processes write) and ``sys.stdout`` both lead to stderr until the block ends; :func:`emit_json`
    writes to the saved real stdout. A plugin that prints can then never corrupt ``--json`` output."""
    sys.stdout.flush()
    old = sys.stdout
    saved = os.dup(1)
    try:
        on_fd1 = old.fileno() == 1
    except (AttributeError, OSError, ValueError):  # e.g. a test's captured stdout
        on_fd1 = False
    document: TextIO = os.fdopen(saved, "w", closefd=False) if on_fd1 else old
    os.dup2(2, 1)
    sys.stdout = _StdoutToStderr(document)
    try:
        yield
    finally:
        with contextlib.suppress(OSError, ValueError):
            document.flush()
        sys.stdout = old
        os.dup2(saved, 1)
        os.close(saved)


def emit_json(data: Any) -> None:
    out = getattr(sys.stdout, "json_document", sys.stdout)
    json.dump(data, out, indent=2, default=str)
    out.write("\n")
    out.flush()


_STORAGE_CODE = (
    f"{os.sep}optuna{os.sep}storages{os.sep}",
    f"{os.sep}sqlalchemy{os.sep}",
    f"{os.sep}psycopg{os.sep}",
    f"{os.sep}tuning{os.sep}table.py",  # a results table being saved
)


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Treat SIGTERM like Ctrl-C while the block runs (main thread only): the running trial is
    marked interrupted and what was measured is written, as on Ctrl-C. A SIGTERM that arrives inside
    Optuna's storage code or a table save is delivered again 0.1 s later, so a journal line, its lock
    or a table is never left half-done."""

    def interrupt(signum: int, frame: Any) -> None:
        # never in the middle of a storage write (a journal line, its lock, a database call): there,
        # the signal is sent again shortly, once the write is done
        f = frame
        while f is not None:
            if any(part in f.f_code.co_filename for part in _STORAGE_CODE):
                threading.Timer(0.1, os.kill, (os.getpid(), signum)).start()
                return
            f = f.f_back
        raise KeyboardInterrupt

    try:
        old = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: leave SIGTERM alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
