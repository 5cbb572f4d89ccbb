"""``attnbench backends`` — list registered backends and whether each can run a workload.

List every registered backend (built-in and plugins), where it comes from, the implementation it
would use, and — with --model — whether it can run that workload or why not. Plugins that failed to
load are listed with their error.
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.markup import escape
from rich.table import Table

from attnbench.cli.common import (
    add_query_command,
    add_wide_option,
    cli_table,
    console,
    emit_json,
    print_table,
    workloads_from_args,
)
from attnbench.core.backend import Backend
from attnbench.core.plugin_call import ask
from attnbench.core.registry import load_registry
from attnbench.core.workload import Workload


def register(sub: argparse._SubParsersAction) -> None:
    p = add_query_command(sub, "backends", __doc__)
    add_wide_option(p, adds="the tunables, or with --model the implementation in a column of its own")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    reg = load_registry()
    workload = workloads_from_args(args)[0] if args.model else None
    rows = []
    for entry in reg:
        row = {
            "name": entry.name,
            "source": str(entry.source),
            "kind": entry.source.kind,
            "plugin": entry.source.plugin,
            "distribution": entry.source.distribution,
            "version": entry.source.version,
            "description": entry.cls.description,
            "tunables": {t.name: list(t.choices) for t in entry.cls.tunables},
        }
        if workload is not None:
            row |= {"workload": workload.describe(), **_status(entry.create(), workload)}
        rows.append(row)
    failures = [f.as_dict() for f in reg.failures]
    if args.json:
        emit_json(
            {
                "backends": rows,
                "broken_plugins": failures,
                "skipped_plugins": reg.skipped,
                "unmatched_allow_list": reg.unmatched,
                "plugin_autoload_disabled": reg.autoload_disabled,
            }
        )
        return 0
    out = console()
    print_table(out, backends_table(rows, workload=workload.describe() if workload else None, wide=args.wide))
    for f in reg.failures:
        out.print(f"[red]broken[/red] {escape(str(f))}")
    if reg.autoload_disabled:
        out.print("plugins not loaded: ATTNBENCH_DISABLE_PLUGIN_AUTOLOAD is set (built-in backends only)")
    if reg.skipped:
        out.print(f"skipped (not in ATTNBENCH_PLUGINS): {', '.join(reg.skipped)}")
    if reg.unmatched:
        out.print(f"[yellow]ATTNBENCH_PLUGINS names no installed plugin:[/yellow] {', '.join(reg.unmatched)}")
    return 0


def backends_table(rows: list[dict[str, Any]], *, workload: str | None = None, wide: bool = False) -> Table:
    """The rows of ``attnbench backends --json`` as a table that fits 80 columns.

    Without a workload: name, source and description (``wide`` adds the tunables). With one (its
    ``describe()``): name, source and whether it can run it — ``runnable: <implementation>`` or
    ``cannot run: <reasons>`` (``wide`` gives the implementation a column of its own)."""
    if workload is None:
        title = "registered backends"
        columns = ["name", "source", "description", *(["tunables"] if wide else [])]
    else:
        title = escape(f"backends for {workload}")
        columns = ["name", "source", *(["implementation"] if wide else []), "status"]
    table = cli_table(title, columns)
    for row in rows:
        cells = {"name": row["name"], "source": row["source"], "description": row["description"]}
        cells["tunables"] = ", ".join(f"{k}∈{v}" for k, v in row["tunables"].items()) or "-"
        if workload is not None:
            cells["implementation"] = row["implementation"]
            if not row["runnable"]:
                cells["status"] = "cannot run: " + "; ".join(row["reasons"])
            else:
                how = "runnable (interpreted: checked, never timed)" if row["interpreted"] else "runnable"
                cells["status"] = how if wide else f"{how}: {row['implementation']}"
        table.add_row(*(escape(str(cells[c])) for c in columns))
    return table


def _status(backend: Backend, workload: Workload) -> dict[str, Any]:
    """Whether ``backend`` can run ``workload``; a backend that raises here is reported, not fatal."""

    answers = ask(type(backend), workload)  # plugin code: in a child process, bounded in time
    return {
        "runnable": not answers.reasons,
        "reasons": list(answers.reasons),
        "implementation": answers.implementation,
        "interpreted": bool(not answers.reasons and answers.interpreted),
    }
