"""The shipped corpus: tuned maps of known devices, so that a new machine of a known kind has an answer
before it has tuned anything.

Each entry is a results table (and its dispatch map) that ``attnbench tune`` wrote on a device the
project measured, copied unchanged into ``attnbench/tables/corpus/`` (``scripts/corpus.py`` adds one):
its ``device`` block keeps the fingerprint, versions and date it was measured with.

**The rule.** An entry serves a machine whose *hardware id* is the entry's: the same device kind, CPU
or GPU name, architecture, instruction set and thread count (:func:`attnbench.tables.table.hardware_id`,
the fingerprint without software versions). Versions may differ (the entry says which it was measured
with); a machine that differs in any hardware field gets nothing from the corpus, because thread count
and instruction set change which kernel wins. ``select()`` uses an entry only where the results
location holds no table of this device — whatever this machine measured wins — and its
:meth:`~attnbench.selection.choice.Choice.explain` says ``source: corpus (<device>, not measured
here)``. ``ATTNBENCH_CORPUS=off`` switches the corpus off.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnbench.tables.dispatch import dispatch_path
from attnbench.tables.files import load_yaml

__all__ = ["CORPUS_DIR", "CORPUS_ENV", "CorpusEntry", "corpus_enabled", "corpus_entries", "corpus_entry"]

#: where the shipped entries live (package data)
CORPUS_DIR = Path(__file__).resolve().parent / "corpus"
#: ``off`` (or ``0``, ``no``, ``false``) switches the corpus off; unset, ``on``, ``1``, ``yes``, ``true``: on
CORPUS_ENV = "ATTNBENCH_CORPUS"
_OFF = ("0", "off", "no", "false")
_ON = ("", "1", "on", "yes", "true")


@dataclass(frozen=True)
class CorpusEntry:
    """One shipped table: its files, the device it was measured on and when."""

    table: Path
    map: Path
    hardware_id: str
    fingerprint: dict[str, Any]
    updated: str

    @functools.cached_property
    def label(self) -> str:
        """The device in words, e.g. ``AMD EPYC, 2 threads, AVX512, measured 2026-12-02`` (made once:
        ``select()`` names it in every answer from the corpus)."""
        fp = self.fingerprint
        parts = [str(fp.get("name", "?"))]
        if fp.get("threads"):
            parts.append(f"{fp['threads']} thread{'s' if fp['threads'] != 1 else ''}")
        if fp.get("isa"):
            parts.append(str(fp["isa"]))
        versions = ", ".join(f"{k} {fp[k]}" for k in ("torch", "triton") if fp.get(k))
        when = f"measured {self.updated[:10]}" if self.updated else "measured"
        return ", ".join([*parts, f"{when} with {versions}" if versions else when])


def corpus_enabled(environ: Any = None) -> bool:
    """Whether ``ATTNBENCH_CORPUS`` lets the corpus answer; ``ValueError`` naming the value otherwise."""
    value = str((environ if environ is not None else os.environ).get(CORPUS_ENV, "")).strip().lower()
    if value in _OFF:
        return False
    if value in _ON:
        return True
    raise ValueError(
        f"{CORPUS_ENV} = {value!r} is not a setting (accepted: off, 0, no, false to switch the shipped "
        "corpus off; on, 1, yes, true or unset to use it)"
    )


def corpus_entries(folder: Path | None = None) -> tuple[CorpusEntry, ...]:
    """Every entry in ``folder`` (default :data:`CORPUS_DIR`), read once per folder."""
    return _entries(Path(folder or CORPUS_DIR))


@functools.cache
def _entries(folder: Path) -> tuple[CorpusEntry, ...]:
    out = []
    for table in sorted(folder.glob("tuning-*.yaml")):
        head = table.read_text().split("\nentries:", 1)[0]  # the device and meta come first: no entries read
        data = load_yaml(head) or {}
        device = data.get("device") or {}
        if not device.get("hardware_id"):
            continue  # not a results table: nothing to serve
        updated = str((data.get("meta") or {}).get("updated", ""))
        fingerprint = dict(device.get("fingerprint") or {})
        out.append(CorpusEntry(table, dispatch_path(table), str(device["hardware_id"]), fingerprint, updated))
    return tuple(out)


def corpus_entry(hardware_id: str, folder: Path | None = None) -> CorpusEntry | None:
    """The corpus's entry for a device of ``hardware_id`` (the newest where several), else None."""
    found = [e for e in corpus_entries(folder) if e.hardware_id == hardware_id]
    return max(found, key=lambda e: e.updated) if found else None
