"""Add a measured results table (and its dispatch map) to the shipped corpus, or list the corpus.

    python scripts/corpus.py add results/engines/tuning-cpu-amd-epyc-bd6425d6afe1.yaml
    python scripts/corpus.py list

``add`` copies the table unchanged (and ``dispatch-….json`` beside it, where there is one) into
``attnbench/tables/corpus/`` after reading it as ``select()`` will (:mod:`attnbench.tables.corpus`): an
entry serves machines of the same hardware id where no table of their own exists yet. An entry of
the same hardware id already there is replaced (the corpus keeps one per device kind).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from attnbench.tables import ResultsTable, TableError
from attnbench.tables.corpus import CORPUS_DIR, corpus_entries
from attnbench.tables.dispatch import dispatch_path, load_maps


def add(table: Path) -> int:
    if not table.is_file():
        raise SystemExit(
            f"corpus add: {table}: no such file (a tuning-<device>.yaml that attnbench tune wrote)"
        )
    try:
        loaded = ResultsTable.load(table)
    except TableError as err:
        raise SystemExit(f"corpus add: {table}: {err}") from None
    hw = str(loaded.device.get("hardware_id", ""))
    if not hw or not loaded.typed():
        raise SystemExit(f"corpus add: {table}: no device block or no entries: not a tuned table")
    maps = dispatch_path(table)
    if maps.exists():
        load_maps(maps, hardware_id=hw)  # refuses another device's map
    for old in corpus_entries(CORPUS_DIR):
        if old.hardware_id == hw:
            old.table.unlink()
            old.map.unlink(missing_ok=True)
    CORPUS_DIR.mkdir(exist_ok=True)
    shutil.copyfile(table, CORPUS_DIR / table.name)
    if maps.exists():
        shutil.copyfile(maps, CORPUS_DIR / maps.name)
    print(f"added {table.name}{' and ' + maps.name if maps.exists() else ''} (hardware id {hw})")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("add", help="copy a tuned table (and its map) into the corpus").add_argument(
        "table", type=Path
    )
    sub.add_parser("list", help="the corpus's entries")
    args = p.parse_args(argv)
    if args.command == "add":
        return add(args.table)
    for e in corpus_entries(CORPUS_DIR):
        print(f"{e.hardware_id}  {e.label}  {e.table.name}{'' if e.map.exists() else ' (no map)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
