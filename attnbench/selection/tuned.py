"""``select()`` from what ``tune`` measured: the dispatch map of a model and dtype, else the nearest
tuned entry of the results table.

:class:`TunedIndex` is built once per version of the device's files (the table and the dispatch map,
read through :mod:`attnbench.tables.table`'s and :mod:`attnbench.tables.dispatch`'s typed API) and
answers every later call from memory; :class:`Location` keeps the files as last read
(:class:`TunedFiles`) and reads them again when ``tune`` rewrote them. Whether a candidate can run here (registered, runnable, not
interpreted, lossy only when allowed, never after failing the gate) is asked by the caller through
``why_not(backend, lossy) -> str`` ('' when it may be chosen).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from attnbench.core.locations import check_table_file
from attnbench.core.workload import Workload, bucket
from attnbench.cost.fit import Calibration, CalibrationError
from attnbench.selection.choice import Choice, Rejected
from attnbench.tables.corpus import CorpusEntry
from attnbench.tables.dispatch import DispatchMap, Lookup, load_maps, map_key
from attnbench.tables.table import CandidateResult, DeviceMismatchError, ResultsTable, TableEntry, TableError

__all__ = [
    "Location",
    "TunedFiles",
    "TunedIndex",
    "WhyNot",
    "entry_choice",
    "file_signature",
    "slower_in_map",
]

#: ``why_not(backend, lossy)``: why a candidate may not be chosen here ('' when it may).
WhyNot = Callable[[str, str], str]


@dataclass(frozen=True)
class _Row:
    row: str
    entry: TableEntry
    log_batch: float
    log_context: float


@dataclass
class TunedIndex:
    """One device's table and dispatch maps, indexed by model, shape hash and dtype."""

    table: ResultsTable | None
    maps: Mapping[str, DispatchMap] = field(default_factory=dict)
    rows: dict[str, list[_Row]] = field(default_factory=dict)  # map_key → tuned entries with a winner
    #: backend → why, for candidates that failed the gate anywhere in the table, per dtype
    gate_failures: dict[str, dict[str, str]] = field(default_factory=dict)
    #: map_key → (batch range, context range, compared in buckets?) of the tuned region
    region: dict[str, tuple[tuple[int, int], tuple[int, int], bool]] = field(default_factory=dict)

    @classmethod
    def build(cls, table: ResultsTable | None, maps: Mapping[str, DispatchMap]) -> TunedIndex:
        index = cls(table, dict(maps))
        for row, entry in (table.typed() if table is not None else {}).items():
            for c in entry.candidates:
                if c.failed in ("gate", "nan"):
                    index.gate_failures.setdefault(entry.dtype, {}).setdefault(
                        c.backend, f"failed the correctness gate when tuning {row}"
                    )
            if entry.winner is not None:
                key = map_key(entry.model, entry.shape_hash, entry.dtype)
                index.rows.setdefault(key, []).append(
                    _Row(row, entry, math.log2(entry.batch_bucket), math.log2(entry.context_bucket))
                )
        for key, rows in index.rows.items():
            bs = [r.entry.batch_bucket for r in rows]
            cs = [r.entry.context_bucket for r in rows]
            index.region[key] = ((min(bs), max(bs)), (min(cs), max(cs)), True)
        for key, m in index.maps.items():
            if m.batches and m.contexts:
                index.region[key] = (
                    (min(m.batches), max(m.batches)),
                    (min(m.contexts), max(m.contexts)),
                    False,
                )
        return index

    # -- where the tuned region ends ---------------------------------------------------------------
    def outside(self, key: str, batch: int, context: int, *, buckets: tuple[int, int] | None = None) -> bool:
        """Whether (batch, context) lies outside the tuned region of map key ``key`` (see :meth:`beyond_at`);
        ``buckets``: their buckets, when the caller has them."""
        region = self.region.get(key)
        if region is None:
            return True
        (b0, b1), (c0, c1), in_buckets = region
        if in_buckets:
            batch, context = buckets if buckets is not None else (bucket(batch), bucket(context))
        return not (b0 <= batch <= b1 and c0 <= context <= c1)

    def beyond_at(self, key: str, model: str, dtype: str, batch: int, context: int) -> str:
        """Why (batch, context) lies outside the tuned region of map key ``key`` (of ``model`` and
        ``dtype``; '' inside): its batch or context bucket outside the tuned buckets (or the map's grid
        lines)."""
        region = self.region.get(key)
        if region is None:
            return f"no tuned entry for {model} {dtype}"
        bs, cs, buckets = region
        b, c, what = batch, context, ""
        if buckets:
            b, c, what = bucket(b), bucket(c), " bucket"
        if bs[0] <= b <= bs[1] and cs[0] <= c <= cs[1]:
            return ""
        out = []
        if not bs[0] <= b <= bs[1]:
            out.append(f"batch{what} {b} outside the tuned {bs[0]}..{bs[1]}")
        if not cs[0] <= c <= cs[1]:
            out.append(f"context{what} {c} outside the tuned {cs[0]}..{cs[1]}")
        return "; ".join(out)

    # -- the dispatch map --------------------------------------------------------------------------
    @staticmethod
    def refusals(m: DispatchMap, refused: Mapping[str, str]) -> tuple[Rejected, ...]:
        """The candidates of ``m`` that may not be chosen here, with why (``refused``: label → why)."""
        return tuple(
            Rejected(m.candidates[label].backend, why, m.candidates[label].config)
            for label, why in refused.items()
            if why
        )

    def from_map(
        self,
        m: DispatchMap,
        workload: Workload,
        batch: int,
        context: int,
        *,
        refused: Mapping[str, str],
        rejected: tuple[Rejected, ...] | None = None,
        eligible: frozenset[str] | None = None,
        source_name: str,
    ) -> Choice | None:
        """The map's choice at the exact (batch, context) of ``workload``, or ``None`` (no candidate
        measured at the four corners of the cell that may run here). ``refused`` maps every candidate
        label of ``m`` to why it may not be chosen here ('' when it may); ``rejected`` is
        :meth:`refusals` of it and ``eligible`` the labels it allows (both computed when not given;
        a caller that asks often passes them, made once). The slower candidates, with their times,
        join :attr:`Choice.rejected` only when it is read."""
        if eligible is None:
            eligible = frozenset(label for label in m.candidates if not refused[label])
        look = m.lookup(batch, context, eligible=eligible)
        if look.label is None or look.candidate is None or look.chosen is None:
            return None
        chosen = look.chosen
        choice = Choice(
            backend=look.candidate.backend,
            config=dict(look.candidate.config),
            source="tuned",
            workload=workload,
            reason=f"dispatch map ({look.basis}): {look.reason}",
            rejected=self.refusals(m, refused) if rejected is None else rejected,
            step_ms=chosen.median_ms,
            table=source_name,
            lossy=look.candidate.lossy,
            lookup=look,
            extrapolated=look.extrapolated,
        )
        choice.reject_later(lambda: slower_in_map(m, look))
        return choice

    def gate_of(
        self, workload: Workload, shape_hash: str, backend: str, config: Mapping[str, object]
    ) -> dict | None:
        """The gate's numbers for ``backend`` with ``config`` in the nearest tuned entry, if it has them."""
        near = self.nearest(workload, shape_hash)
        if near is None:
            return None
        match = (c for c in near[0].entry.candidates if c.backend == backend and c.config == dict(config))
        return next((c.gate for c in match if c.gate), None)

    # -- the nearest table entry -------------------------------------------------------------------
    def nearest(self, workload: Workload, shape_hash: str) -> tuple[_Row, float] | None:
        """The tuned entry nearest ``workload`` in octaves (batch + context), with that distance."""
        key = map_key(workload.shape.name, shape_hash, workload.dtype_name)
        return self.nearest_at(key, workload.batch, workload.context)

    def nearest_at(self, key: str, batch: int, context: int) -> tuple[_Row, float] | None:
        """:meth:`nearest` for map key ``key`` at (batch, context)."""
        rows = self.rows.get(key)
        if not rows:
            return None
        lb, lc = math.log2(batch), math.log2(context)
        best = min(
            rows,
            key=lambda r: (
                round(abs(r.log_batch - lb) + abs(r.log_context - lc), 9),
                -r.entry.context_bucket,
                -r.entry.batch_bucket,
            ),
        )
        return best, abs(best.log_batch - lb) + abs(best.log_context - lc)


# --------------------------------------------------------------------------------------------------
# the device's files, as last read, and whether `tune` rewrote them
# --------------------------------------------------------------------------------------------------
Signature = tuple[int, int, int] | None  # (inode, size, mtime ns) of a file, None when missing
#: a folder last modified longer ago than this (ns) when its files were checked is *settled*: any later
#: change of its entries (an atomic rewrite is a rename into it) gives it a later modification time,
#: even on a file system whose clock ticks coarsely, so one ``os.stat`` of the folder tells
_SETTLED_NS = 2_000_000_000


def file_signature(path: Path, *, was: Signature = None) -> Signature:
    """(inode, size, mtime ns) of a file, ``None`` when missing (``was``: its last signature)."""
    if was is None and not os.access(path, os.F_OK):  # still missing: no exception raised per call
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _folder_id(path: str) -> tuple[int, int] | None:
    """(inode, mtime ns) of a folder, ``None`` when it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns)


@dataclass
class TunedFiles:
    """One device's tuned files in one results folder, as last read: its table, dispatch map and
    calibration (read on first need), and what was learnt from them."""

    paths: tuple[Path, Path, Path]  # table, dispatch map, calibration
    signature: tuple[Signature, Signature, Signature]
    index: TunedIndex
    notes: list[str]
    templates: dict  # per-entry choices and per-map plans (made again with the files)
    folders: tuple[str, ...]  # the folders holding the three files (one, unless a table was named)
    #: the folders' identities when the files were last checked, when every folder was settled then
    settled: tuple[tuple[int, int] | None, ...] | None = None
    checked_at: float = 0.0
    calibration: tuple[Calibration | None, str] | None = None

    def unchanged(self) -> bool:
        """No entry of the folders changed since the files were checked (one ``os.stat`` each)."""
        if self.settled is None:
            return False
        if len(self.folders) == 1:
            return _folder_id(self.folders[0]) == self.settled[0]
        return tuple(_folder_id(f) for f in self.folders) == self.settled

    def calibration_now(self) -> tuple[Calibration | None, str]:
        """The calibration beside the files and a note on why it is ignored, if it is (read on first
        need, and again when rewritten)."""
        hit = self.calibration
        if hit is None:
            cal, note = None, ""
            if self.signature[2] is not None:
                try:
                    cal = Calibration.load(self.paths[2])
                except CalibrationError as err:
                    note = f"{err}; ignoring it (re-run `attnbench calibrate`)"
            hit = self.calibration = (cal, note)
        return hit


@dataclass
class Location:
    """Where one results location keeps a device's files, and what they held when last read."""

    table: Path
    map: Path
    calibration: Path
    explicit: bool  # the table file was named (--table): it must exist
    files: TunedFiles | None = None
    #: the shipped corpus's entry standing in for this device's table, which ``local`` does not hold yet
    corpus: CorpusEntry | None = None
    local: Path | None = None

    def load(self, *, fingerprint: dict, hardware_id: str, recheck_s: float = 0.0) -> TunedFiles:
        """What the files hold, read again when one was rewritten: one ``os.stat`` of their folder
        when it has settled, else of the files too (see :class:`attnbench.selection.select.Selector`);
        ``recheck_s`` > 0 checks at most that often. Another device's table or map is refused
        (:class:`~attnbench.tables.DeviceMismatchError`); an unreadable one is ignored with a note,
        unless the table was named."""
        files = self.files
        now = time.monotonic() if recheck_s else 0.0
        if files is not None:
            if recheck_s and now - files.checked_at < recheck_s:
                return files
            if files.unchanged():  # the common case: one os.stat
                files.checked_at = now
                return files
        table_file, map_file, cal_file = self.table, self.map, self.calibration
        # the folders first: a change after this is seen by the next call; the shipped corpus's files
        # are part of the installed package, so only the calibration's folder (the results location) is
        watched = (cal_file,) if self.corpus is not None else (table_file, map_file, cal_file)
        folders = tuple(dict.fromkeys(str(p.parent) for p in watched))
        ids = tuple(_folder_id(f) for f in folders)
        wall = time.time_ns()
        settled = ids if all(i is not None and wall - i[1] > _SETTLED_NS for i in ids) else None
        was = files.signature if files is not None else (None, None, None)
        signature = (
            file_signature(table_file, was=was[0]),
            file_signature(map_file, was=was[1]),
            file_signature(cal_file, was=was[2]),
        )
        if files is not None and files.signature[:2] == signature[:2]:
            if files.signature[2] != signature[2]:  # read again when needed, its rankings made again
                files.calibration = None
                files.templates = {k: v for k, v in files.templates.items() if k[0] != "calibrated"}
            files.signature, files.settled, files.checked_at = signature, settled, now
            return files
        if self.explicit and signature[0] is None:
            check_table_file(table_file)  # removed since: one clear line
        notes: list[str] = []
        try:
            loaded: ResultsTable | None = ResultsTable.load(table_file, fingerprint=fingerprint)
        except DeviceMismatchError:
            raise  # another device's table: refused, never used
        except TableError as err:
            if self.explicit:
                raise
            notes.append(f"{err}; ignoring it (re-run `attnbench tune` to rewrite it)")
            loaded = None
        try:
            maps = load_maps(map_file, hardware_id=hardware_id)
        except ValueError as err:
            if "another device" in str(err):
                raise DeviceMismatchError(f"{err}; refusing another device's map") from None
            notes.append(f"{err}; ignoring it (re-run `attnbench tune` to rewrite it)")
            maps = {}
        files = self.files = TunedFiles(
            paths=(table_file, map_file, cal_file),
            signature=signature,
            index=TunedIndex.build(loaded, maps),
            notes=notes,
            templates={},
            folders=folders,
            settled=settled,
            checked_at=now,
        )
        return files


def slower_in_map(m: DispatchMap, look: Lookup) -> list[Rejected]:
    """The candidates the map's lookup did not choose, fastest first, each with its time and how that
    time was found (measured at this grid point, interpolated between tuned points, or extrapolated)."""
    chosen = look.chosen
    basis = {"extrapolated": "predicted (extrapolated)"}.get(look.basis, look.basis)
    out = []
    for label, t in sorted(look.predicted.items(), key=lambda kv: kv[1].median_ms):
        if label != look.label:
            c = m.candidates[label]
            vs = ""
            if chosen is not None:
                rel = t.median_ms / chosen.median_ms - 1
                vs = f" ({rel:+.1%} vs the chosen {chosen.median_ms:.4g} ms)"
            out.append(Rejected(c.backend, f"{basis} {t.median_ms:.4g} ms{vs}", c.config, t.median_ms))
    return out


def entry_choice(
    row: _Row,
    workload: Workload,
    *,
    why_not: WhyNot,
    lossy_of: Callable[[str], str],
    table_warnings: list[str],
    table_name: str,
) -> Choice | None:
    """The choice a tuned entry gives here: its winner, else the next fastest that may run."""
    entry = row.entry
    assert entry.winner is not None
    rejected = [Rejected(x["backend"], f"excluded when tuned: {x.get('reason', '')}") for x in entry.excluded]
    rejected += [
        Rejected(c.backend, f"failed when tuned ({c.failed}): {c.reason or ''}", c.config)
        for c in entry.candidates
        if not c.ok
    ]
    others = sorted(
        (c for c in entry.candidates if c.ok and c != entry.winner),
        key=lambda c: c.step_ms or math.inf,
    )
    chosen: CandidateResult | None = None
    for c in (entry.winner, *others):
        why = why_not(c.backend, c.lossy or lossy_of(c.backend))
        if why:
            rejected.append(Rejected(c.backend, why, c.config, c.step_ms))
        elif chosen is None:
            chosen = c
        else:
            assert c.step_ms is not None and chosen.step_ms is not None
            if c.step_ms < chosen.step_ms:
                why = (
                    f"faster by {chosen.step_ms / c.step_ms - 1:.1%}, under the "
                    f"{entry.switch_margin:.0%} switch margin over the default"
                )
            else:
                why = f"slower: measured {c.step_ms:.4g} ms vs {chosen.step_ms:.4g} ms in the tuned entry"
            rejected.append(Rejected(c.backend, why, c.config, c.step_ms))
    if chosen is None:
        return None
    warns = [w for w in table_warnings if w.startswith(row.row)]
    if not entry.complete:
        warns.append(f"{row.row}: the tuning run was interrupted; not every candidate was measured")
    return Choice(
        backend=chosen.backend,
        config=dict(chosen.config),
        source="tuned",
        workload=workload,
        reason=entry.decision if chosen is entry.winner else "tuned winner cannot run here; next fastest",
        rejected=rejected,
        measured=[c.as_dict() for c in entry.candidates],
        tuned_key=row.row,
        step_ms=chosen.step_ms,
        table=table_name,
        warnings=warns,
        lossy=chosen.lossy or lossy_of(chosen.backend),
        gate=chosen.gate,
    )
