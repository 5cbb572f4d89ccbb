"""What :func:`attnbench.select` returns: the :class:`Choice` (backend, config, why) and the
:class:`Rejected` candidates beside it. Plain data: building one reads no file and allocates nothing.

Each time a choice reports says what it is (:attr:`Choice.step_basis`): *measured* (at a tuned point
or in a tuned entry), *interpolated* (between the tuned points of a dispatch map), or *predicted*
(extrapolated beyond the map's grid, a calibrated step-time model, or the roofline floor).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal, overload

from attnbench.core.backend import Backend
from attnbench.core.registry import Registry, load_registry
from attnbench.core.workload import Workload
from attnbench.tables.dispatch import Basis, Lookup

__all__ = ["Choice", "Rejected"]


@dataclass(frozen=True)
class Rejected:
    """A candidate that was not chosen, and why (with its measured time when there is one)."""

    backend: str
    reason: str
    config: Mapping[str, Any] = field(default_factory=dict)
    step_ms: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "config": dict(self.config),
            "reason": self.reason,
            "step_ms": self.step_ms,
        }


class _Completable:
    """A list field of :class:`Choice` that may be completed on its first read.

    ``select()`` is called per batch and its explanation is rarely read, so the dispatch map's
    account of the slower candidates (one :class:`Rejected` with a formatted reason each) is made only
    when :attr:`Choice.rejected` is read (:meth:`Choice.reject_later`). A dataclass field whose default
    is a descriptor is set and read through it (see the ``dataclasses`` documentation).
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot, self.later = f"_{name}", f"_{name}_later"

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> tuple[()]: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> list[Rejected]: ...
    def __get__(self, obj: object | None, owner: type | None = None) -> tuple[()] | list[Rejected]:
        if obj is None:  # the class's view: the field's default
            return ()
        d = obj.__dict__
        later = d.get(self.later)
        if later is not None:  # completed once (two threads may both complete it, to equal lists)
            before, more = later
            d[self.slot] = [*before, *more()]
            d.pop(self.later, None)
        return d[self.slot]

    def complete_later(self, obj: object, more: Callable[[], Iterable[Rejected]]) -> None:
        """Add ``more()`` to the list when it is next read."""
        d = obj.__dict__
        d[self.later] = (self.__get__(obj), more)

    def __set__(self, obj: object, value: Iterable[Rejected]) -> None:
        obj.__dict__[self.slot] = list(value)
        obj.__dict__.pop(self.later, None)


@dataclass
class Choice:
    """What :func:`select` chose for ``workload`` and why."""

    backend: str
    config: dict[str, Any]
    source: Literal["tuned", "calibrated", "heuristic"]
    workload: Workload
    reason: str
    #: the candidates not chosen, and why (completed on first read, see :meth:`reject_later`)
    rejected: _Completable = _Completable()
    measured: list[dict[str, Any]] = field(default_factory=list)  # tuned candidates with their times
    tuned_key: str | None = None
    distance_octaves: float | None = None
    #: the chosen candidate's step from what was tuned; :attr:`step_basis` says whether it was
    #: measured, interpolated between tuned points, or extrapolated beyond them
    step_ms: float | None = None
    estimate_ms: float | None = None  # predicted: the calibrated model, or the roofline floor (heuristic)
    table: str | None = None
    warnings: list[str] = field(default_factory=list)
    #: when the backend is an engine's kernel (e.g. vLLM's): the engine's settings that run it there
    engine_setting: str | None = None
    #: what a lossy cache loses (e.g. "fp8 e4m3 K/V"); empty for exact attention
    lossy: str = ""
    #: the correctness gate's numbers for the choice when it was tuned (error, calibration, ratios)
    gate: dict[str, Any] | None = None
    #: from the dispatch map: the lookup (cell, corners, interpolated times); see :attr:`dispatch`
    lookup: Lookup | None = field(default=None, repr=False)
    #: the point lies outside the tuned grid (the map's nearest edge answered)
    extrapolated: bool = False
    #: the registry the choice was made from (:meth:`build` uses it)
    registry: Registry | None = field(default=None, repr=False, compare=False)
    #: where the tuned answer came from the shipped corpus (no table of this device here): the device
    #: it was measured on, in words (:attr:`attnbench.tables.corpus.CorpusEntry.label`); else ""
    corpus: str = ""

    def copy_for(self, workload: Workload, **changes: Any) -> Choice:
        """This choice for ``workload``, with ``changes`` (fields by name): ``dataclasses.replace``
        without running ``__init__`` again (``select()`` copies a bucket's choice per call); its lists
        are copies, so the copy's can change alone."""
        made = object.__new__(Choice)
        made.__dict__.update(self.__dict__)
        made.workload = workload
        made.rejected = self.rejected  # a copy (see _Completable)
        made.measured = list(self.measured)
        made.warnings = list(self.warnings)
        for name, value in changes.items():
            if name not in _FIELDS:
                raise TypeError(f"Choice.copy_for: no field {name!r}; fields: {', '.join(_FIELDS)}")
            setattr(made, name, value)
        return made

    def reject_later(self, more: Callable[[], Iterable[Rejected]]) -> None:
        """Add ``more()`` to :attr:`rejected` when it is next read (explanations cost only when read)."""
        _REJECTED.complete_later(self, more)

    @property
    def step_basis(self) -> Basis | None:
        """What :attr:`step_ms` is: ``"measured"`` (at a tuned grid point of the dispatch map, or in
        the tuned entry :attr:`tuned_key`, which may be another bucket than the workload's),
        ``"interpolated"`` (between the tuned points around the workload), ``"extrapolated"`` (beyond
        the tuned grid, the map's trend extended: a prediction); ``None`` without a :attr:`step_ms`."""
        if self.step_ms is None:
            return None
        if self.lookup is not None:
            return self.lookup.basis
        return "measured"

    def _estimate_basis(self) -> Literal["calibrated", "roofline"] | None:
        """What :attr:`estimate_ms` predicts from: the calibrated model, or the roofline floor."""
        if self.estimate_ms is None:
            return None
        return "calibrated" if self.source == "calibrated" else "roofline"

    def _step_line(self) -> str | None:
        """The chosen candidate's time, saying whether it was measured, interpolated or predicted."""
        if self.step_ms is not None:
            basis, t = self.step_basis, f"{self.step_ms:.4g} ms"
            look = self.lookup
            if look is not None and basis == "measured":
                b, c = look.point or (self.workload.batch, self.workload.context)
                return f"measured step: {t} (at the tuned point batch {b}, context {c})"
            if look is not None and basis == "interpolated":
                b0, b1, c0, c1 = look.cell
                return (
                    f"interpolated step: {t} (between the tuned points of batch {b0}..{b1} × context "
                    f"{c0}..{c1}; not measured at this batch and context)"
                )
            if basis == "extrapolated":
                return (
                    f"predicted step: {t} (extrapolated beyond the tuned grid of the dispatch map; "
                    "not measured)"
                )
            if self.distance_octaves:
                return (
                    f"measured step: {t} (in the tuned entry {self.distance_octaves:.2g} octaves away, "
                    "not at this batch and context)"
                )
            return f"measured step: {t} (in the tuned entry)"
        if self.estimate_ms is not None:
            if self.source == "calibrated":
                return f"predicted by the calibrated model: {self.estimate_ms:.4g} ms (not measured)"
            return (
                f"predicted by the roofline floor: ≥ {self.estimate_ms:.4g} ms (KV bytes / memory bandwidth; "
                "not measured)"
            )
        return None

    def _accuracy(self) -> str:
        """One line: exact or lossy, with the gate's measured error where the table has it."""
        g = self.gate or {}
        err, cal = g.get("error") or {}, g.get("calibration") or {}
        measured = ""
        if err.get("rel_l2") is not None:
            measured = f"; gate: rel_l2 {err['rel_l2']:.3g} against float64"
            if cal.get("rel_l2") and not self.lossy:
                measured += f" ({err['rel_l2'] / cal['rel_l2']:.2g}× the calibration error {cal['rel_l2']:.3g}, ×{g.get('multiple', 2):g} allowed)"
        if self.lossy:
            return f"lossy ({self.lossy}), error against exact attention{measured or ': not measured here'}"
        return "exact" + measured

    def build(self, registry: Registry | None = None) -> Backend:
        """A fresh instance of the chosen backend (pass :attr:`config` to ``create_cache``)."""
        if registry is None:
            registry = self.registry if self.registry is not None else load_registry()
        return registry.get(self.backend)

    def as_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "config": self.config,
            "source": self.source,
            "workload": self.workload.describe(),
            "reason": self.reason,
            "tuned_key": self.tuned_key,
            "distance_octaves": self.distance_octaves,
            "step_ms": self.step_ms,
            "step_basis": self.step_basis,
            "estimate_ms": self.estimate_ms,
            "estimate_basis": self._estimate_basis(),
            "measured": self.measured,
            "rejected": [r.as_dict() for r in self.rejected],
            "table": self.table,
            "warnings": self.warnings,
            "engine_setting": self.engine_setting,
            "lossy": self.lossy,
            "gate": self.gate,
            "dispatch": self.dispatch,
            "cell": list(self.lookup.cell) if self.lookup else None,
            "extrapolated": self.extrapolated,
            "corpus": self.corpus or None,
        }

    @property
    def dispatch(self) -> str | None:
        """The dispatch map's account of the choice: its cell and corners, every candidate's
        interpolated time (``None`` when the map did not answer). Written only when read."""
        return self.lookup.explain() if self.lookup is not None else None

    def explain(self) -> str:
        cfg = ", ".join(f"{k}={v}" for k, v in self.config.items()) or "no tunables"
        lines = [
            f"chosen: {self.backend} ({cfg}) for {self.workload.describe()} [{self.source}]",
            f"  why: {self.reason}",
        ]
        if self.corpus:
            lines.append(f"  source: corpus ({self.corpus}; not measured here)")
        if self.engine_setting:
            lines.append(f"  engine setting: {self.engine_setting}")
        lines.append(f"  accuracy: {self._accuracy()}")
        if self.dispatch:
            lines += ["  " + line for line in self.dispatch.splitlines()]
        if self.tuned_key:
            where = (
                "exact bucket" if not self.distance_octaves else f"{self.distance_octaves:.2g} octaves away"
            )
            lines.append(f"  tuned entry: {self.tuned_key} ({where}) in {self.table}")
        step = self._step_line()
        if step:
            lines.append(f"  {step}")
        if self.measured:
            lines.append("  measured:")
            for m in self.measured:
                cfg_m = ",".join(f"{k}={v}" for k, v in m.get("config", {}).items())
                t = (
                    f"{m['step_ms']:.4g} ms"
                    if m.get("step_ms") is not None
                    else f"FAILED ({m.get('failed')})"
                )
                lines.append(f"    {m['backend']}{f'[{cfg_m}]' if cfg_m else ''}: {t}")
        if self.rejected:
            lines.append("  rejected:")
            lines += [f"    {r.backend}: {r.reason}" for r in self.rejected]
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)


_FIELDS = frozenset(f.name for f in fields(Choice))
_REJECTED: _Completable = vars(Choice)["rejected"]
