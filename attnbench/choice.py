"""What :func:`attnbench.select` returns: the :class:`Choice` (backend, config, why) and the
:class:`Rejected` candidates beside it. Plain data: building one reads no file and allocates nothing."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from attnbench.backend import Backend
from attnbench.registry import Registry, load_registry
from attnbench.tuning.dispatch import Lookup
from attnbench.workload import Workload

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


@dataclass
class Choice:
    """What :func:`select` chose for ``workload`` and why."""

    backend: str
    config: dict[str, Any]
    source: Literal["tuned", "calibrated", "heuristic"]
    workload: Workload
    reason: str
    rejected: list[Rejected] = field(default_factory=list)
    measured: list[dict[str, Any]] = field(default_factory=list)  # tuned candidates with their times
    tuned_key: str | None = None
    distance_octaves: float | None = None
    step_ms: float | None = None  # measured at the tuned bucket
    estimate_ms: float | None = None  # calibrated prediction, or the roofline floor (heuristic)
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
            "estimate_ms": self.estimate_ms,
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
        if self.step_ms is not None:
            lines.append(f"  measured step: {self.step_ms:.4g} ms")
        if self.estimate_ms is not None:
            what = "calibrated model" if self.source == "calibrated" else "roofline floor"
            lines.append(f"  {what}: {self.estimate_ms:.4g} ms")
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
