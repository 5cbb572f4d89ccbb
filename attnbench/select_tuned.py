"""``select()`` from what ``tune`` measured: the dispatch map of a model and dtype, else the nearest
tuned entry of the results table.

:class:`TunedIndex` is built once per version of the device's files (the table and the dispatch map,
read through :mod:`attnbench.tuning.table`'s and :mod:`attnbench.tuning.dispatch`'s typed API) and
answers every later call from memory. Whether a candidate can run here (registered, runnable, not
interpreted, lossy only when allowed, never after failing the gate) is asked by the caller through
``why_not(backend, lossy) -> str`` ('' when it may be chosen).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from attnbench.choice import Choice, Rejected
from attnbench.tuning.dispatch import DispatchMap, map_key
from attnbench.tuning.table import CandidateResult, ResultsTable, TableEntry
from attnbench.workload import Workload, bucket

__all__ = ["TunedIndex", "WhyNot"]

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
    def beyond(self, workload: Workload, shape_hash: str) -> str:
        """Why ``workload`` lies outside the tuned region of its model and dtype ('' inside): its
        batch or context bucket outside the tuned buckets (or the map's grid lines)."""
        key = map_key(workload.shape.name, shape_hash, workload.dtype_name)
        return self.beyond_at(key, workload.shape.name, workload.dtype_name, workload.batch, workload.context)

    def outside(self, key: str, batch: int, context: int) -> bool:
        """Whether (batch, context) lies outside the tuned region of map key ``key`` (see :meth:`beyond`)."""
        region = self.region.get(key)
        if region is None:
            return True
        (b0, b1), (c0, c1), buckets = region
        if buckets:
            batch, context = bucket(batch), bucket(context)
        return not (b0 <= batch <= b1 and c0 <= context <= c1)

    def beyond_at(self, key: str, model: str, dtype: str, batch: int, context: int) -> str:
        """:meth:`beyond` for map key ``key`` (of ``model`` and ``dtype``) at (batch, context)."""
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
    def map_for(self, workload: Workload, shape_hash: str) -> DispatchMap | None:
        return self.maps.get(map_key(workload.shape.name, shape_hash, workload.dtype_name))

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
        source_name: str,
    ) -> Choice | None:
        """The map's choice at the exact (batch, context) of ``workload``, or ``None`` (no candidate
        measured at the four corners of the cell that may run here). ``refused`` maps every candidate
        label of ``m`` to why it may not be chosen here ('' when it may); ``rejected`` is
        :meth:`refusals` of it (computed when not given)."""
        look = m.lookup(batch, context, allowed=lambda label, _c: not refused[label])
        if look.label is None or look.candidate is None:
            return None
        out = list(self.refusals(m, refused) if rejected is None else rejected)
        chosen = look.predicted[look.label]
        for label, t in sorted(look.predicted.items(), key=lambda kv: kv[1].median_ms):
            if label != look.label:
                c = m.candidates[label]
                rel = t.median_ms / chosen.median_ms - 1
                why = (
                    f"interpolated {t.median_ms:.4g} ms ({rel:+.1%} vs the chosen {chosen.median_ms:.4g} ms)"
                )
                out.append(Rejected(c.backend, why, c.config, t.median_ms))
        return Choice(
            backend=look.candidate.backend,
            config=dict(look.candidate.config),
            source="tuned",
            workload=workload,
            reason=f"dispatch map: {look.reason}",
            rejected=out,
            step_ms=chosen.median_ms,
            table=source_name,
            lossy=look.candidate.lossy,
            lookup=look,
            extrapolated=look.extrapolated,
        )

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
                why = f"slower: {c.step_ms:.4g} ms vs {chosen.step_ms:.4g} ms"
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
