"""Options and helpers shared by the subcommands."""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import math
import os
import shlex
import signal
import sys
import threading
from collections.abc import Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from rich import box
from rich.console import Console, RenderableType
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from attnbench.device import AUTO, resolve_device
from attnbench.shapes import list_presets, load_shape
from attnbench.workload import Workload, parse_int_list, parse_tokens

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
    "render_text",
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


# -- tables ------------------------------------------------------------------------------------------
# A command's table fits 80 columns with realistic content (model and backend names, configs): its
# default columns are the few that answer the command's question, the rest come with --wide and all
# of it with --json. A value too long for its column wraps (between words, else inside the word);
# no cell is ever cut short with "…". Tests check a table with truncated_cells().


def cli_table(title: str | None, columns: Sequence[str], *, right: Collection[str] = ()) -> Table:
    """An empty table with ``columns`` (headers; those in ``right`` right-aligned, the rest left)
    whose every column folds a value too long for it onto the next line instead of cutting it with
    "…". ``title`` is rich markup (escape data in it). Print it with :func:`print_table`."""
    table = Table(title=title)
    for header in columns:
        table.add_column(header, justify="right" if header in right else "left", overflow="fold")
    return table


def print_table(out: Console, table: Table) -> None:
    """Print ``table`` on ``out`` as wide as the console: its columns share the width so that a
    word is split only when the longest words of all columns cannot fit side by side (rich alone
    narrows the widest columns first, even through a backend's name)."""
    out.print(_fit_columns(table, out.width))


def _fit_columns(table: Table, width: int) -> Table:
    """``table``, or a copy with fixed column widths when its columns must wrap to fit ``width``:
    each column gets its longest word, then what is left goes to the columns that need the least
    more to show in full, so that as few columns as possible wrap (the long texts)."""
    if any(c.width is not None for c in table.columns):  # widths chosen by the caller: kept
        return table
    out = Console(file=io.StringIO(), width=width)
    wanted = [
        [Measurement.get(out, out.options, cell) for cell in (column.header, *column.cells)]
        for column in table.columns
    ]
    most = [max(m.maximum for m in ms) for ms in wanted]  # each cell on one line
    least = [  # each cell's longest word on one line
        hi if c.no_wrap else max(m.minimum for m in ms)
        for c, ms, hi in zip(table.columns, wanted, most, strict=True)
    ]
    n = len(table.columns)
    _, pad_right, _, pad_left = table.padding
    frame = n * (pad_left + pad_right) - (0 if table.pad_edge else pad_left + pad_right)
    frame += (n - 1 + (2 if table.show_edge else 0)) if table.box else 0
    room = width - frame
    if sum(most) <= room or sum(least) > room:  # it fits, or whole words cannot: rich folds them
        return table
    widths, spare = list(least), room - sum(least)
    for i in sorted(range(n), key=lambda i: most[i] - least[i]):  # the nearest to whole first
        grant = min(spare, most[i] - least[i])
        widths[i] += grant
        spare -= grant
    fitted = copy.copy(table)
    fitted.columns = [copy.copy(c) for c in table.columns]
    for column, w in zip(fitted.columns, widths, strict=True):
        column.width = w
    return fitted


def add_wide_option(parser: argparse.ArgumentParser, *, adds: str) -> None:
    """``--wide``: the table with every column; ``adds`` says which ones (e.g. ``"the runner-up, the
    default's time"``). The default table fits an 80-column terminal; ``--json`` has everything."""
    parser.add_argument(
        "--wide",
        action="store_true",
        help=f"print every column of the table: {adds.replace('%', '%%')} (the default table fits 80 "
        "columns; --json has all of it)",
    )


def config_text(config: Mapping[str, Any] | None) -> str:
    """A backend config for a table cell, ``page_size=128 kv_splits=auto prefetch=2``: one word per
    setting, so that a narrow column wraps between settings and never inside one; ``-`` for none."""
    return " ".join(f"{k}={v}" for k, v in (config or {}).items()) or "-"


def ms_text(ms: float | None) -> str:
    """A time in milliseconds for a table cell: four significant digits, whole milliseconds from a
    second up, never an exponent (``0.04873``, ``692.3``, ``13290``); ``—`` for none."""
    if ms is None or math.isnan(ms):
        return "—"
    return f"{ms:.4g}" if abs(ms) < 1000 else f"{ms:.0f}"


def render_text(renderable: RenderableType, width: int = 80) -> str:
    """``renderable`` (a table, text, …) as plain text, as the CLI's :func:`console` writes it to a
    file or a pipe ``width`` columns wide: no colour, a table laid out as :func:`print_table` does
    (its lines never longer than ``width``; a title or text longer than that stays one line)."""
    out = Console(
        file=io.StringIO(),
        width=width,
        color_system=None,
        highlight=False,
        soft_wrap=True,
        legacy_windows=False,
    )
    out.print(_fit_columns(renderable, width) if isinstance(renderable, Table) else renderable)
    return out.file.getvalue()  # type: ignore[attr-defined]  # the StringIO given above


def truncated_cells(table: Table, width: int = 80) -> list[str]:
    """The cells of ``table`` whose text does not survive rendering ``width`` columns wide, one line
    each (``row 2, column 'winner': 'triton_paged' shown as 'triton_pa…'``); empty when every header
    and cell reads in full.

    A cell survives when the lines rich draws for it, joined by spaces, give back its text (its markup
    rendered, whitespace collapsed): wrapping between words is fine; a word split across lines, an
    ending "…" or an emptied cell is not. Cells that are not text (nested renderables) are not checked.
    The table is drawn with lines between rows and a square box (same widths as rich's default box),
    so a box-less table is checked a little more strictly than it prints."""
    probe = copy.copy(table)  # a shallow copy: the columns and rows are shared, only read
    probe.title = probe.caption = None
    probe.box, probe.show_edge, probe.show_lines = box.SQUARE, True, True
    out = Console(file=io.StringIO(), width=width, color_system=None, legacy_windows=False)
    text = render_text(probe, width)
    blocks: list[list[str]] = []  # the lines of each drawn row (header first), between border lines
    for line in text.splitlines():
        if line.startswith("│"):
            blocks[-1].append(line)
        elif line.startswith(("┌", "├")):
            blocks.append([])
    columns = [list(c.cells) for c in table.columns]
    rows = [[cells[r] if r < len(cells) else "" for cells in columns] for r in range(table.row_count)]
    named = [("header", [c.header for c in table.columns])] if table.show_header else []
    named += [(f"row {r + 1}", row) for r, row in enumerate(rows)]
    if len(blocks) < len(named):
        return [f"the table drew {len(blocks)} rows (header included) for {len(named)}"]
    problems: list[str] = []
    for (where, expected_row), lines in zip(named, blocks[: len(named)], strict=True):
        drawn = [line.split("│")[1:-1] for line in lines]
        if any(len(parts) != len(table.columns) for parts in drawn):
            problems.append(f"{where}: a cell holds '│', so its columns cannot be told apart")
            continue
        for col, expected in enumerate(expected_row):
            if isinstance(expected, str):
                want = out.render_str(expected).plain
            elif isinstance(expected, Text):
                want = expected.plain
            else:
                continue
            want = " ".join(want.split())
            got = " ".join(" ".join(parts[col] for parts in drawn).split())
            if got != want:
                header = table.columns[col].header
                problems.append(f"{where}, column {str(header)!r}: {want!r} shown as {got!r}")
    return problems


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


def run_options() -> argparse.ArgumentParser:
    """A parent parser: ``--layers``, ``--threads`` and ``--json``, shared by ``bench``, ``tune`` and ``decode``."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help="layers per decode step of the synthetic model (default: the model's); fewer make a long "
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
        if isinstance(default, str) and action.type is not None:
            default = action.type(default)  # argparse converts a string default the same way
        if value == default:
            continue
        flag = max(action.option_strings, key=len)
        if isinstance(value, bool) and action.nargs == 0:
            parts.append(flag)
        else:
            parts.append(f"{flag} {shlex.quote(str(value))}")
    return " ".join(parts)


def run_record(*, command: str, load_start: Sequence[float], started: float | None = None) -> dict[str, Any]:
    """What every saved result states about its run: the command, the machine, torch, the date, the
    load average before and now, and (with ``started``, a ``time.time()``) the seconds it took."""
    import platform
    import time
    from datetime import datetime, timezone

    import torch

    record: dict[str, Any] = {
        "command": command,
        "machine": f"{platform.node()} — {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "torch": torch.__version__,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "load_avg_start": list(load_start),
        "load_avg_end": list(os.getloadavg()),
    }
    if started is not None:
        record["seconds"] = round(time.time() - started, 1)
    return record


def write_report(out: str | Path, report: Mapping[str, Any], markdown: str, *, indent: int = 1) -> None:
    """Write a saved result: ``report`` to ``<out>.json`` and ``markdown`` to ``<out>.md`` (folder made)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=indent) + "\n")
    out.with_suffix(".md").write_text(markdown)


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


def _available_bytes(device: str) -> int | None:
    import torch

    if torch.device(device).type == "cuda":
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _check_fits(workload: Workload) -> None:
    """Refuse a workload whose KV cache cannot be allocated even for one layer (e.g. ``--context 200m``)."""
    layers = max(1, int(getattr(workload.shape, "num_layers", 1) or 1))
    one_layer = workload.kv_bytes_per_step() // layers
    available = _available_bytes(workload.device)
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


_ = parse_tokens  # re-exported for subcommands
