"""The schema of a results-table entry: typed, validated, and defined once.

:class:`TableEntry` is one tuned key (winner, runner-up, default, every candidate, provenance);
:class:`CandidateResult` is one candidate in it, and the one record of a trial from the worker to the
table: the worker builds it from its measurement, the study stores its :meth:`~CandidateResult.as_dict`
with the Optuna trial, and :meth:`~CandidateResult.from_dict` reads it back there, from the worker's
pipe and from the table file. :mod:`attnbench.tables.table` re-exports both and
validates every entry it reads or writes through them, so a file that does not validate (truncated,
hand-broken) is refused with the field and the rule, and moved aside by the next ``tune``.

Extending the schema (later features: calibration errors, a lossy flag, …): add a field **with a
default** to the dataclass, read it in ``from_dict`` with ``c.get(name, type, required=False)`` (or
``c.number``) and write it in ``as_dict`` only when set. Old tables then still load, and fields this
version does not know are kept in ``extra`` and written back unchanged, so a newer attnbench's table
survives an older one's save.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal, overload

from attnbench.tables.margin import Interval

#: What a user gets without tuning: the first of these that can run the workload (a table entry's
#: ``default``, the candidate every other must beat by the switch margin).
DEFAULT_BACKENDS = ("flash", "naive")


@dataclass(frozen=True)
class Candidate:
    """One point of a search space: a backend and a complete config."""

    backend: str
    config: Mapping[str, Any]

    def label(self) -> str:
        cfg = ",".join(f"{k}={v}" for k, v in sorted(self.config.items()))
        return f"{self.backend}[{cfg}]" if cfg else self.backend

    def ident(self) -> str:
        return json.dumps([self.backend, sorted(self.config.items())], default=str)


__all__ = ["DEFAULT_BACKENDS", "Candidate", "CandidateResult", "TableEntry", "TableError", "validate_entries"]


class TableError(ValueError):
    """A results table that cannot be used (unreadable, invalid, or from another device)."""


class _Check:
    """Validation helpers: each names the field (``entries.<row>.winner.step_ms``) and the rule."""

    def __init__(self, data: Any, where: str) -> None:
        if not isinstance(data, Mapping):
            raise TableError(f"field {where!r} must be a mapping, got {type(data).__name__}")
        self.data, self.where = data, where

    def _fail(self, name: str, rule: str) -> TableError:
        value = self.data.get(name, "<missing>")
        return TableError(f"field '{self.where}.{name}' = {value!r}: {rule}")

    def get(
        self, name: str, kind: type | tuple[type, ...], *, required: bool = True, default: Any = None
    ) -> Any:
        if name not in self.data or self.data[name] is None:
            if required:
                raise self._fail(name, "is missing")
            return default
        value = self.data[name]
        ok = isinstance(value, kind) and not (isinstance(value, bool) and bool not in _tuple(kind))
        if not ok:
            names = " or ".join(k.__name__ for k in _tuple(kind))
            raise self._fail(name, f"must be {names}")
        return value

    @overload
    def number(self, name: str, *, required: Literal[True] = ..., positive: bool = ...) -> float: ...
    @overload
    def number(self, name: str, *, required: bool, positive: bool = ...) -> float | None: ...
    def number(self, name: str, *, required: bool = True, positive: bool = False) -> float | None:
        """The field as a finite number (positive if asked); None only for a missing optional one."""
        value = self.get(name, (int, float), required=required)
        if value is not None and (not math.isfinite(value) or (positive and value <= 0)):
            raise self._fail(name, "must be a finite" + (" positive" if positive else "") + " number")
        return value

    def extra(self, known: set[str]) -> dict[str, Any]:
        return {k: v for k, v in self.data.items() if k not in known}


def _tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _known(cls: type) -> set[str]:
    return {f.name for f in fields(cls)} - {"extra"}


@dataclass(frozen=True)
class CandidateResult:
    """One candidate of a tuned key: measured (``step_ms``) or failed (``failed`` + ``reason``).

    The one record of a trial: the worker builds it, the study keeps it, the table writes it. A
    finalist re-timed beside the others (``retimed``) keeps its study time in ``study_ms`` and its
    re-timed median in ``step_ms``; ``study_interval`` is the study run's approximate interval of
    its median (from its 10th-90th percentiles), which picks the finalists. ``missing``: the default
    backend had no trial (e.g. excluded). ``merged``: kept from the entry tuned then (its time is from
    that run). ``extra`` keeps fields this version does not know (written by a newer attnbench), so a
    save never drops them.
    """

    backend: str
    config: dict[str, Any] = field(default_factory=dict)
    step_ms: float | None = None
    gbps: float | None = None
    pct_of_bandwidth: float | None = None
    implementation: str | None = None
    failed: str | None = None
    reason: str | None = None
    error: dict[str, Any] | None = None
    missing: bool = False
    gate: dict[str, Any] | None = None  # the correctness gate's numbers: error, calibration, ratios
    lossy: str | None = None  # what a lossy cache loses, e.g. "fp8 e4m3 K/V"
    #: the finalists' interleaved time: {median_ms, lo_ms, hi_ms, samples} (bootstrap interval of the median)
    interval: dict[str, Any] | None = None
    study_ms: float | None = None  # a re-timed finalist's time in the study; a pruned one's running median
    study_interval: dict[str, Any] | None = None  # the study's approximate interval, same form
    retimed: bool = False
    retime_failed: str | None = None
    merged: str | None = None  # when the entry it was kept from was tuned
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.step_ms is not None and not self.failed

    @property
    def candidate(self) -> Candidate:
        return Candidate(self.backend, self.config)

    @property
    def value(self) -> float | None:
        """The step time in seconds (``None`` for a failure)."""
        return self.step_ms / 1e3 if self.ok and self.step_ms is not None else None

    @property
    def kind(self) -> str:
        """The failure's kind (``gate``, ``crash``, …), ``""`` when measured."""
        return self.failed or ""

    def search_interval(self) -> Interval:
        """The study time with its spread (exact when none is known), to pick the finalists by."""
        if self.study_interval is not None:
            return Interval.from_dict(self.study_interval)
        return Interval.exact(self.study_ms or self.step_ms or 0.0)

    @classmethod
    def from_dict(cls, data: Any, *, where: str) -> CandidateResult:
        c = _Check(data, where)
        out = cls(
            backend=c.get("backend", str),
            config=dict(c.get("config", Mapping, required=False, default={})),
            step_ms=c.number("step_ms", required=False, positive=True),
            gbps=c.number("gbps", required=False),
            pct_of_bandwidth=c.number("pct_of_bandwidth", required=False),
            implementation=c.get("implementation", str, required=False),
            failed=c.get("failed", str, required=False),
            reason=c.get("reason", str, required=False),
            error=c.get("error", Mapping, required=False),
            missing=c.get("missing", bool, required=False, default=False),
            gate=c.get("gate", Mapping, required=False),
            lossy=c.get("lossy", str, required=False),
            interval=c.get("interval", Mapping, required=False),
            study_ms=c.number("study_ms", required=False, positive=True),
            study_interval=c.get("study_interval", Mapping, required=False),
            retimed=c.get("retimed", bool, required=False, default=False),
            retime_failed=c.get("retime_failed", str, required=False),
            merged=c.get("merged", str, required=False),
            extra=c.extra(_known(cls)),
        )
        for name in ("interval", "study_interval"):
            if getattr(out, name) is not None:
                _interval(getattr(out, name), where=f"{where}.{name}")
        if not out.missing and "config" not in c.data:
            raise c._fail("config", "is missing")
        if not out.missing and out.failed is None and out.step_ms is None:
            raise TableError(f"field '{where}' has neither 'step_ms' (measured) nor 'failed' (its verdict)")
        return out

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"backend": self.backend}
        if self.missing:
            return out | {"missing": True} | self.extra
        out["config"] = dict(self.config)
        for f in fields(self):
            value = getattr(self, f.name)
            if (
                f.name not in ("backend", "config", "missing", "extra")
                and value is not None
                and value is not False
            ):
                out[f.name] = value
        return out | self.extra


@dataclass(frozen=True)
class TableEntry:
    """The winner of one tuned key, with the runner-up, the default and every candidate measured."""

    model: str
    shape_hash: str
    dtype: str
    batch_bucket: int
    context_bucket: int
    measured_at: dict[str, int]
    winner: CandidateResult | None
    decision: str
    runner_up: CandidateResult | None
    margin: float | None
    default: CandidateResult | None
    switch_margin: float
    candidates: list[CandidateResult]
    excluded: list[dict[str, Any]]
    complete: bool
    study: str
    trials: int
    search: str
    space_size: int
    device_fingerprint_id: str
    code_hash: str
    versions: dict[str, str]
    tuned_at: str
    load_avg: list[float]
    command: str | None = None
    tie: bool = False  # a challenger was faster by the medians but not by the margin beyond the intervals
    code_hashes: dict[str, str] = field(default_factory=dict)  # each backend's own code hash (merging)
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Any, *, where: str) -> TableEntry:
        c = _Check(data, where)

        def cand(name: str) -> CandidateResult | None:
            value = c.get(name, Mapping, required=False)
            return None if value is None else CandidateResult.from_dict(value, where=f"{where}.{name}")

        def count(name: str) -> int:
            value = c.get(name, int)
            if value < 1:
                raise c._fail(name, "must be ≥ 1")
            return value

        for name in ("winner", "runner_up", "margin", "default"):  # present, even when null
            if name not in c.data:
                raise c._fail(name, "is missing")
        candidates = [
            CandidateResult.from_dict(x, where=f"{where}.candidates[{i}]")
            for i, x in enumerate(c.get("candidates", list))
        ]
        entry = cls(
            model=c.get("model", str),
            shape_hash=c.get("shape_hash", str),
            dtype=c.get("dtype", str),
            batch_bucket=count("batch_bucket"),
            context_bucket=count("context_bucket"),
            measured_at=dict(c.get("measured_at", Mapping)),
            winner=cand("winner"),
            decision=c.get("decision", str),
            runner_up=cand("runner_up"),
            margin=c.number("margin", required=False),
            default=cand("default"),
            switch_margin=c.number("switch_margin"),
            candidates=candidates,
            excluded=list(c.get("excluded", list)),
            complete=c.get("complete", bool),
            study=c.get("study", str),
            trials=c.get("trials", int),
            search=c.get("search", str),
            space_size=c.get("space_size", int),
            device_fingerprint_id=c.get("device_fingerprint_id", str),
            code_hash=c.get("code_hash", str),
            versions=dict(c.get("versions", Mapping)),
            tuned_at=c.get("tuned_at", str),
            load_avg=list(c.get("load_avg", list)),
            command=c.get("command", str, required=False),
            tie=c.get("tie", bool, required=False, default=False),
            code_hashes=dict(c.get("code_hashes", Mapping, required=False, default={})),
            extra=c.extra(_known(cls)),
        )
        if entry.trials != len(candidates):
            raise c._fail("trials", f"says {entry.trials} candidates but {len(candidates)} are listed")
        if entry.winner is not None and not entry.winner.ok:
            raise TableError(f"field '{where}.winner' has no measured step_ms: a failed candidate never wins")
        return entry

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            if f.name == "extra":
                continue
            value = getattr(self, f.name)
            if isinstance(value, CandidateResult):
                value = value.as_dict()
            elif f.name == "candidates":
                value = [x.as_dict() for x in value]
            if f.name == "command" and value is None:
                continue
            out[f.name] = value
        return out | self.extra


def _interval(data: Mapping[str, Any], *, where: str) -> None:
    c = _Check(data, where)
    med, lo, hi = (c.number(k, positive=k == "median_ms") for k in ("median_ms", "lo_ms", "hi_ms"))
    if not lo <= med <= hi:
        raise TableError(f"field '{where}' = {dict(data)!r}: needs lo_ms ≤ median_ms ≤ hi_ms")


def validate_entries(entries: Any) -> dict[str, TableEntry]:
    """Every entry of a table's ``entries`` mapping as a :class:`TableEntry`; :class:`TableError` if one is not."""
    if not isinstance(entries, Mapping):
        raise TableError(f"field 'entries' must be a mapping, got {type(entries).__name__}")
    return {str(row): TableEntry.from_dict(e, where=f"entries.{row}") for row, e in entries.items()}
