"""The dispatch map: measured times on a rectilinear batch × context grid, and a fast lookup.

``attnbench tune`` measures a coarse grid of (batch, context) points for one model and dtype, then
adds grid lines where neighbouring points have different winners (:mod:`attnbench.tuning.refine`).
The result is one JSON file per device (``dispatch-<kind>-<device>-<hardware id>.json`` beside the
results table), readable without Optuna::

    {"format": 1, "device": {"hardware_id": ..., "fingerprint_id": ...}, "maps": {
      "llama-3.1-8b@90c2…/bf16": {"model": ..., "shape_hash": ..., "dtype": "bf16",
        "default": "flash[num_splits=0]", "switch_margin": 0.05,
        "batches": [1, 3, 8], "contexts": [512, 1448, 4096],
        "candidates": {"flash[num_splits=0]": {"backend": "flash", "config": {...}, "lossy": ""}, ...},
        "points": [{"batch": 1, "context": 512, "winner": ..., "tie": false, "load_avg": [...],
                    "times": {"flash[num_splits=0]": {"median_ms": .., "lo_ms": .., "hi_ms": .., "samples": 15}},
                    "failed": {"naive": "gate: ..."}}, ...],
        "refinement": {...}}}}

:meth:`DispatchMap.lookup` interpolates every candidate's time (median and interval) bilinearly in
log-log space between the four grid points around (batch, context), then decides by the one margin
policy (:func:`attnbench.tables.margin.decide`). Outside the grid it extends the trend between the
first and last grid lines (linear in log-log space) and says it extrapolates. It reads no file and
imports no torch: a map loaded once answers in microseconds (what a cell needs is made once, the
per-call part is :mod:`attnbench.tables.lookup`).
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnbench.tables.files import locked, write_atomically
from attnbench.tables.lookup import Basis, Cell, Lookup, answer, make_cell
from attnbench.tables.margin import SWITCH_MARGIN, Interval, decide

__all__ = [
    "FORMAT",
    "Basis",
    "DispatchMap",
    "GridPoint",
    "Lookup",
    "MapCandidate",
    "dispatch_path",
    "load_maps",
    "map_key",
    "merge_maps",
    "save_maps",
]

FORMAT = 1


def map_key(model: str, shape_hash: str, dtype: str) -> str:
    """The key of one map inside a device's dispatch file: ``model@shape_hash/dtype``."""
    return f"{model}@{shape_hash}/{dtype}"


@dataclass(frozen=True)
class MapCandidate:
    """A candidate of the map: backend and config; ``lossy`` says what a lossy cache loses."""

    backend: str
    config: dict[str, Any] = field(default_factory=dict)
    lossy: str = ""

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"backend": self.backend, "config": dict(self.config)}
        if self.lossy:
            out["lossy"] = self.lossy
        return out


@dataclass(frozen=True)
class GridPoint:
    """One measured grid point: every candidate's interval, the failures and the decided winner."""

    batch: int
    context: int
    times: dict[str, Interval]
    winner: str | None = None
    tie: bool = False
    failed: dict[str, str] = field(default_factory=dict)
    load_avg: tuple[float, ...] = ()
    reason: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "batch": self.batch,
            "context": self.context,
            "winner": self.winner,
            "tie": self.tie,
            "reason": self.reason,
            "times": {k: v.as_dict() for k, v in self.times.items()},
            "failed": dict(self.failed),
            "load_avg": [round(x, 2) for x in self.load_avg],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GridPoint:
        return cls(
            batch=int(d["batch"]),
            context=int(d["context"]),
            times={k: Interval.from_dict(v) for k, v in (d.get("times") or {}).items()},
            winner=d.get("winner"),
            tie=bool(d.get("tie", False)),
            failed={str(k): str(v) for k, v in (d.get("failed") or {}).items()},
            load_avg=tuple(d.get("load_avg") or ()),
            reason=str(d.get("reason", "")),
        )


@dataclass
class DispatchMap:
    """Measured grid for one model shape and dtype on one device."""

    model: str
    shape_hash: str
    dtype: str
    default: str | None
    batches: list[int]
    contexts: list[int]
    candidates: dict[str, MapCandidate]
    points: dict[tuple[int, int], GridPoint]
    switch_margin: float = SWITCH_MARGIN
    refinement: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.add_lines()  # sorts the lines, each once, and takes their logs
        self._log_cache: dict[
            tuple[int, int], tuple[GridPoint, dict[str, tuple[float, float, float, int]]]
        ] = {}
        #: (corner keys, eligible labels) → (corner points, candidates, their count, the cell): see _cell
        self._cells: dict[tuple, tuple[tuple, dict, int, Cell]] = {}

    def add_lines(self, *, batches: Sequence[int] = (), contexts: Sequence[int] = ()) -> None:
        """Add grid lines (their points are measured separately, see ``complete()``)."""
        self.batches = sorted(set(self.batches) | set(batches))
        self.contexts = sorted(set(self.contexts) | set(contexts))
        self._lb = [math.log(b) for b in self.batches]
        self._lc = [math.log(c) for c in self.contexts]

    @property
    def key(self) -> str:
        return map_key(self.model, self.shape_hash, self.dtype)

    def complete(self) -> bool:
        """Every (batch line, context line) point has been measured."""
        return all((b, c) in self.points for b in self.batches for c in self.contexts)

    def _logs(self, key: tuple[int, int]) -> dict[str, tuple[float, float, float, int]] | None:
        """The point's times as logs, computed once per point object (a replaced point is redone)."""
        point = self.points.get(key)
        if point is None:
            return None
        cached = self._log_cache.get(key)
        if cached is None or cached[0] is not point:
            logs = {
                k: (math.log(t.median_ms), math.log(t.lo_ms), math.log(t.hi_ms), t.samples)
                for k, t in point.times.items()
            }
            cached = self._log_cache[key] = (point, logs)
        return cached[1]

    # -- lookup ------------------------------------------------------------------------------------
    @staticmethod
    def _bracket(lines: list[int], logs: list[float], x: float) -> tuple[int, int, float, bool]:
        """Indices of the lines around ``x``, its weight toward the upper one, and whether it lies
        outside the lines. Outside, the weight extends the trend between the first and the last line
        (linear in log-log space): a crossover that the whole tuned range points to is still seen."""
        if len(lines) == 1:
            return 0, 0, 0.0, x != lines[0]
        if x < lines[0] or x > lines[-1]:
            n = len(lines) - 1
            return 0, n, (math.log(x) - logs[0]) / (logs[n] - logs[0]), True
        i = min(bisect.bisect_right(lines, x) - 1, len(lines) - 2)
        w = (math.log(x) - logs[i]) / (logs[i + 1] - logs[i])
        return i, i + 1, w, False

    @staticmethod
    def _edge(lines: list[int], logs: list[float], x: float) -> tuple[int, int, float]:
        """The outermost cell on ``x``'s side, with ``x``'s weight extending it (flat on a single line)."""
        if len(lines) < 2:  # one grid line on this axis: no trend to extend, the line's own times
            return 0, 0, 0.0
        i = 0 if x < lines[0] else len(lines) - 2
        return i, i + 1, (math.log(x) - logs[i]) / (logs[i + 1] - logs[i])

    def _cell(self, keys: tuple[tuple[int, int], ...], eligible: frozenset[str] | None) -> Cell:
        """The cell with corners ``keys`` for the ``eligible`` labels (all when ``None``), made once per
        cell and eligible set (the same set object is found without hashing it again); a replaced
        corner point or a changed candidate list makes it again."""
        points, cands = self.points, self.candidates
        corners = (points.get(keys[0]), points.get(keys[1]), points.get(keys[2]), points.get(keys[3]))
        hit = self._cells.get((keys, eligible))
        if hit is not None and hit[0] == corners and hit[1] is cands and hit[2] == len(cands):
            return hit[3]
        present = tuple([points[k] for k in dict.fromkeys(keys) if k in points])
        labels = cands if eligible is None else [label for label in cands if label in eligible]
        made = make_cell(present, [self._logs(k) for k in keys], labels, keys)
        if len(self._cells) > 4096:
            self._cells.clear()
        self._cells[(keys, eligible)] = (corners, cands, len(cands), made)
        return made

    def lookup(
        self,
        batch: int,
        context: int,
        *,
        allowed: Callable[[str, MapCandidate], bool] | None = None,
        eligible: frozenset[str] | None = None,
        margin: float | None = None,
    ) -> Lookup:
        """Interpolate every candidate between the four surrounding grid points, then decide.

        ``allowed(label, candidate)`` filters candidates (e.g. no lossy cache, only registered
        backends); ``eligible``, a set of labels, does the same for a caller that asks many times with
        one filter (``select()``: pass the same set object each time and the cell's work is reused).
        A candidate missing (failed or not measured) at any corner is not eligible in that cell.
        ``margin`` defaults to the map's switch margin.

        Per call, each eligible candidate's median is interpolated; intervals are made for the few
        candidates the margin policy compares, the rest when :attr:`Lookup.predicted` is read.
        """
        if allowed is not None:  # a filter given as a function: asked once per candidate
            ok = frozenset(label for label, c in self.candidates.items() if allowed(label, c))
            eligible = ok if eligible is None else ok & eligible
        i0, i1, wb, xb = self._bracket(self.batches, self._lb, batch)
        j0, j1, wc, xc = self._bracket(self.contexts, self._lc, context)
        b0, b1, c0, c1 = self.batches[i0], self.batches[i1], self.contexts[j0], self.contexts[j1]
        keys = ((b0, c0), (b1, c0), (b0, c1), (b1, c1))
        cell = self._cell(keys, eligible)
        edge_cell = None
        if xb or xc:  # candidates not measured across the whole range: the edge cell's trend instead
            i0, i1, ewb = self._edge(self.batches, self._lb, batch) if xb else (i0, i1, wb)
            j0, j1, ewc = self._edge(self.contexts, self._lc, context) if xc else (j0, j1, wc)
            b0, b1, c0, c1 = self.batches[i0], self.batches[i1], self.contexts[j0], self.contexts[j1]
            edge = ((b0, c0), (b1, c0), (b0, c1), (b1, c1))
            if edge != keys or ewb != wb or ewc != wc:  # else the same cell (one or two lines an axis)
                outer = self._cell(edge, eligible)
                # the union below gives the inner cell's times alone when both hold the same candidates
                if outer.rows is not None and (
                    cell.rows is None or outer.places.keys() != cell.places.keys()
                ):
                    edge_cell = (outer, ewb, ewc)
        return answer(
            cell,
            wb,
            wc,
            edge=edge_cell,
            candidates=self.candidates,
            default=self.default,
            margin=self.switch_margin if margin is None else margin,
            lines=(b0, b1, c0, c1),
            point=(batch, context),
            extrapolated=xb or xc,
        )

    # -- serialisation -----------------------------------------------------------------------------
    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "shape_hash": self.shape_hash,
            "dtype": self.dtype,
            "default": self.default,
            "switch_margin": self.switch_margin,
            "batches": list(self.batches),
            "contexts": list(self.contexts),
            "candidates": {k: c.as_dict() for k, c in self.candidates.items()},
            "points": [self.points[k].as_dict() for k in sorted(self.points)],
            "refinement": self.refinement,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, where: str = "map") -> DispatchMap:
        try:
            points = [GridPoint.from_dict(p) for p in d["points"]]
            return cls(
                model=str(d["model"]),
                shape_hash=str(d["shape_hash"]),
                dtype=str(d["dtype"]),
                default=d.get("default"),
                batches=[int(b) for b in d["batches"]],
                contexts=[int(c) for c in d["contexts"]],
                candidates={
                    str(k): MapCandidate(
                        str(v["backend"]), dict(v.get("config") or {}), str(v.get("lossy", ""))
                    )
                    for k, v in d["candidates"].items()
                },
                points={(p.batch, p.context): p for p in points},
                switch_margin=float(d.get("switch_margin", SWITCH_MARGIN)),
                refinement=dict(d.get("refinement") or {}),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ValueError(f"dispatch map {where!r} is malformed: {type(err).__name__}: {err}") from None


def dispatch_path(table_path: Path) -> Path:
    """The device's dispatch file beside its results table (``tuning-X.yaml`` → ``dispatch-X.json``)."""
    table_path = Path(table_path)
    return table_path.with_name("dispatch-" + table_path.stem.removeprefix("tuning-") + ".json")


def load_maps(path: Path, *, hardware_id: str | None = None) -> dict[str, DispatchMap]:
    """Every map in a device's dispatch file (``{}`` if there is none).

    Raises ``ValueError`` (one line) for a malformed file or, with ``hardware_id``, another device's.
    """
    path = Path(path)
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"dispatch map {path.name} cannot be read: {err}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(
            f"dispatch map {path.name}: format {data.get('format') if isinstance(data, dict) else '?'!r}; this attnbench reads {FORMAT}"
        )
    there = (data.get("device") or {}).get("hardware_id")
    if hardware_id is not None and there != hardware_id:
        raise ValueError(
            f"dispatch map {path.name} was tuned on another device (hardware id {there}, here {hardware_id})"
        )
    return {k: DispatchMap.from_dict(v, where=k) for k, v in (data.get("maps") or {}).items()}


def _merged_point(old: GridPoint, new: GridPoint, *, default: str | None, margin: float) -> GridPoint:
    """One point measured by two runs: the newer times replace the older ones candidate by candidate,
    candidates only the older run measured stay (as results-table entries merge), winner decided again."""
    times = {**old.times, **new.times}
    failed = {k: v for k, v in old.failed.items() if k not in new.times} | dict(new.failed)
    verdict = decide(times, default=default if default in times else None, margin=margin)
    return GridPoint(
        new.batch, new.context, times, verdict.winner, verdict.tie, failed, new.load_avg, verdict.reason
    )


def merge_maps(old: DispatchMap, new: DispatchMap) -> tuple[DispatchMap, str | None]:
    """What a device's file keeps when ``new`` is tuned for ``old``'s key: never less than it had.

    A run whose grid lines lie within the old map's (a narrower run: fewer batches, contexts or
    backends) refreshes the points it measured, candidate by candidate, and keeps the rest; a run
    whose lines include the old map's replaces it; otherwise (the grids overlap only in part, so their
    union would have cells with unmeasured corners) the map with more points is kept. The message,
    if any, says what happened.
    """
    ob, oc, nb, nc = set(old.batches), set(old.contexts), set(new.batches), set(new.contexts)
    if nb >= ob and nc >= oc and set(new.candidates) >= set(old.candidates):
        return new, None
    if nb <= ob and nc <= oc:
        default = old.default if old.default in old.candidates else new.default
        points = dict(old.points)
        for key, p in new.points.items():
            points[key] = (
                _merged_point(points[key], p, default=default, margin=new.switch_margin)
                if key in points
                else p
            )
        merged = DispatchMap(
            new.model, new.shape_hash, new.dtype, default, old.batches, old.contexts,
            {**old.candidates, **new.candidates}, points, new.switch_margin,
            {**old.refinement, "merged_points": sorted(new.points)},
        )  # fmt: skip
        return merged, (
            f"dispatch map {new.key}: {len(new.points)} of its {len(points)} points measured again "
            "(candidate by candidate); the others kept from the earlier run"
        )
    keep = new if len(new.points) >= len(old.points) else old
    return keep, (
        f"dispatch map {new.key}: this run's grid ({len(new.batches)} × {len(new.contexts)} lines) and "
        f"the earlier one ({len(old.batches)} × {len(old.contexts)}) overlap only in part; kept the "
        f"{'new' if keep is new else 'earlier'} one ({len(keep.points)} points). Tune every batch and "
        "context of both in one run to combine them"
    )


def save_maps(
    path: Path,
    maps: Sequence[DispatchMap],
    *,
    device: Mapping[str, Any],
    meta: Mapping[str, Any] | None = None,
) -> list[str]:
    """Merge ``maps`` into the device's dispatch file atomically (a map of the same key is merged by
    :func:`merge_maps`, never shrunk); returns what the merges said."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    messages: list[str] = []
    with locked(path):
        current: dict[str, Any] = {}
        if path.exists():
            try:
                current = (json.loads(path.read_text()).get("maps")) or {}
            except (OSError, ValueError, AttributeError):
                current = {}
        for m in maps:
            if m.key in current:
                try:
                    old = DispatchMap.from_dict(current[m.key], where=m.key)
                except ValueError as err:
                    messages.append(f"{err}; replaced")
                else:
                    m, said = merge_maps(old, m)
                    messages += [said] if said else []
            current[m.key] = m.as_dict()
        body = {
            "format": FORMAT,
            "device": dict(device),
            "meta": dict(meta or {}),
            "maps": dict(sorted(current.items())),
        }
        write_atomically(path, json.dumps(body, indent=1, default=str) + "\n")
    return messages
