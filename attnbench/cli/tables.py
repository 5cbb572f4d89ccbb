"""The CLI's tables: readable at 80 columns (cells wrap, never end in "…"), and the test helpers
that check it (:func:`truncated_cells`)."""

from __future__ import annotations

import argparse
import copy
import io
import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from rich import box
from rich.console import Console, RenderableType
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

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
