"""``attnbench.select()``: the backend and config to use for a workload on this device.

From the device's tuned results table when it holds the model and dtype (the nearest bucket in batch
and context, measured in octaves). Outside the tuned region (batch or context bucket beyond the tuned
ones, or nothing tuned) the device's calibrated step-time models choose when ``attnbench calibrate``
wrote them (:mod:`attnbench.calibrated`), else a roofline heuristic: the candidate that reads the
fewest KV-cache bytes per step wins, ties going to the default backend (``flash``, else ``naive``) —
what a user gets without tuning. A candidate that failed the correctness gate is never chosen, and a table
tuned on another device is refused::

    >>> choice = attnbench.select(model="llama-3.1-8b", batch=8, context="8k", dtype="bf16")
    >>> choice.backend, choice.config, choice.source
    ('flash', {'num_splits': 0}, 'tuned')
    >>> backend = choice.build()
    >>> print(choice.explain())
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from attnbench.backend import Backend
from attnbench.registry import Registry, load_registry
from attnbench.workload import Workload

__all__ = ["Choice", "Rejected", "select"]


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
        registry = registry if registry is not None else load_registry()
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
        }

    def explain(self) -> str:
        cfg = ", ".join(f"{k}={v}" for k, v in self.config.items()) or "no tunables"
        lines = [
            f"chosen: {self.backend} ({cfg}) for {self.workload.describe()} [{self.source}]",
            f"  why: {self.reason}",
        ]
        if self.engine_setting:
            lines.append(f"  engine setting: {self.engine_setting}")
        lines.append(f"  accuracy: {self._accuracy()}")
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


def select(
    workload: Workload | None = None,
    *,
    model: str | None = None,
    batch: int | None = None,
    context: int | str | None = None,
    dtype: str | torch.dtype = "bf16",
    device: str = "cpu",
    results_dir: str | Path | None = None,
    table: str | Path | None = None,
    registry: Registry | None = None,
    bandwidth: float | None = None,
    allow_lossy: bool = False,
) -> Choice:
    """The backend and config to use for ``workload`` (or ``model`` + ``batch`` + ``context`` + ``dtype``).

    Args:
        results_dir: where the tuned tables live (default ``$ATTNBENCH_RESULTS_DIR`` or ``results/``).
        table: a specific table file instead (refused with :class:`~attnbench.tuning.DeviceMismatchError`
            when tuned on another device).
        registry: the backends to choose from (default: the full registry).
        bandwidth: bytes/s for the heuristic's roofline (default: the device profile's, measured once).
        allow_lossy: a lossy KV cache (``Backend.lossy``, e.g. fp8 K/V) may be chosen — from the table
            when it was measured fastest, never by the heuristic; the choice then says it is lossy.
    """
    from attnbench.calibrated import beyond_tuned, calibrated_choice
    from attnbench.calibration import CalibrationError, find_calibration
    from attnbench.device import fingerprint
    from attnbench.tuning.table import DeviceMismatchError, ResultsTable, TableError, table_path
    from attnbench.tuning.tuner import default_results_dir

    if workload is None:
        missing = [n for n, v in (("model", model), ("batch", batch), ("context", context)) if v is None]
        if missing:
            raise ValueError(
                f"select: give a workload, or model, batch and context (missing: {', '.join(missing)})"
            )
        workload = Workload.uniform(model, batch=batch, context=context, dtype=dtype, device=device)  # type: ignore[arg-type]
    registry = registry if registry is not None else load_registry()
    fp = fingerprint(workload.device)
    path = Path(table) if table is not None else table_path(Path(results_dir or default_results_dir()), fp)
    notes: list[str] = []
    loaded: ResultsTable | None
    try:
        loaded = ResultsTable.load(path, fingerprint=fp)
    except DeviceMismatchError:
        raise  # another device's table: refused, never used
    except TableError as err:
        if table is not None:
            raise
        notes.append(f"{err}; ignoring it (re-run `attnbench tune` to rewrite it)")
        loaded = None
    failed_gate = _gate_failures(loaded, workload) if loaded else {}
    choice = _from_table(loaded, workload, registry, allow_lossy=allow_lossy) if loaded else None
    outside = beyond_tuned(loaded, workload)
    if outside:  # the measured map wins inside the tuned region; beyond it, the calibrated model
        lossy = [] if allow_lossy else [e.name for e in registry if _stores_lossily(e.cls)]
        try:
            calibration = find_calibration(fp, results_dir=path.parent)
        except CalibrationError as err:
            notes.append(f"{err}; ignoring it (re-run `attnbench calibrate`)")
            calibration = None
        calibrated = calibrated_choice(
            workload,
            registry,
            calibration=calibration,
            failed_gate=failed_gate,
            why_outside=outside,
            skip=lossy,
        )
        choice = calibrated or choice
    if choice is None:
        choice = _heuristic(workload, registry, failed_gate=failed_gate, bandwidth=bandwidth)
    choice.warnings = notes + choice.warnings
    choice.engine_setting = _engine_setting(registry, choice)
    for w in choice.warnings:
        warnings.warn(w, stacklevel=2)
    return choice


# --------------------------------------------------------------------------------------------------
# tuned
# --------------------------------------------------------------------------------------------------
def _runnable(registry: Registry, name: str, workload: Workload) -> str:
    """Empty when ``name`` is registered, supports ``workload`` and is not interpreted; else why not."""
    if name not in registry:
        return f"not registered now (registered: {', '.join(registry.names())})"
    from attnbench.probe import ask

    answers = ask(registry.entry(name).cls, workload)  # plugin code: bounded in time, answer cached
    if answers.reasons:
        return "cannot run this workload: " + "; ".join(answers.reasons)
    if answers.interpreted:
        return "would run interpreted here (never timed, never chosen)"
    return ""


def _from_table(table: Any, workload: Workload, registry: Registry, *, allow_lossy: bool) -> Choice | None:
    from attnbench.tuning.key import TuningKey, bucket_distance
    from attnbench.tuning.space import code_hash

    shape_hash = workload.shape.fingerprint()
    rows = [
        (row, e)
        for row, e in table.entries.items()
        if e.get("model") == workload.shape.name
        and e.get("shape_hash") == shape_hash
        and e.get("dtype") == workload.dtype_name
        and e.get("winner")
    ]
    if not rows:
        return None

    def distance(item: tuple[str, dict]) -> tuple[float, int, int]:
        key = TuningKey.from_row(item[0], device="")
        d = bucket_distance(key, batch=workload.batch, context=workload.context)
        return (round(d, 9), -key.context_bucket, -key.batch_bucket)

    row, entry = min(rows, key=distance)
    dist = distance((row, entry))[0]
    candidates = [c for c in entry.get("candidates", [])]
    measured = [dict(c) for c in candidates]
    rejected: list[Rejected] = [
        Rejected(x["backend"], f"excluded when tuned: {x['reason']}") for x in entry.get("excluded", [])
    ]
    for c in candidates:
        if c.get("step_ms") is None:
            rejected.append(
                Rejected(
                    c["backend"], f"failed when tuned ({c.get('failed')}): {c.get('reason', '')}", c["config"]
                )
            )
    winner = entry["winner"]
    others = sorted(
        (c for c in candidates if c.get("step_ms") is not None and c != winner), key=lambda c: c["step_ms"]
    )
    ordered = [winner, *others]
    chosen = None
    for c in ordered:
        why_not = _runnable(registry, c["backend"], workload)
        lossy = c.get("lossy") or (registry.entry(c["backend"]).cls.lossy if c["backend"] in registry else "")
        if not why_not and lossy and not allow_lossy:
            why_not = f"lossy ({lossy}): chosen only with allow_lossy=True (--allow-lossy)"
        if why_not:
            rejected.append(Rejected(c["backend"], why_not, c["config"], c.get("step_ms")))
            continue
        chosen = c
        break
    if chosen is None:
        return None
    for c in ordered:
        if c is not chosen and not any(
            r.backend == c["backend"] and dict(r.config) == c["config"] for r in rejected
        ):
            if (
                c.get("step_ms") is not None
                and chosen.get("step_ms") is not None
                and c["step_ms"] < chosen["step_ms"]
            ):
                why = f"faster by {chosen['step_ms'] / c['step_ms'] - 1:.1%}, under the {entry.get('switch_margin', 0):.0%} switch margin over the default"
            else:
                why = f"slower: {c['step_ms']:.4g} ms vs {chosen['step_ms']:.4g} ms"
            rejected.append(Rejected(c["backend"], why, c["config"], c["step_ms"]))
    reason = (
        entry.get("decision", "tuned winner")
        if chosen is winner
        else "tuned winner cannot run here; next fastest"
    )
    warns = [w for w in table.warnings if w.startswith(row)]
    classes = [registry.entry(c["backend"]).cls for c in candidates if c["backend"] in registry]
    if classes and entry.get("code_hash") and code_hash(classes) != entry["code_hash"]:
        warns.append(
            f"{row}: backend code changed since tuning (code hash {entry['code_hash']} → {code_hash(classes)}); consider re-tuning"
        )
    if not entry.get("complete", True):
        warns.append(f"{row}: the tuning run was interrupted; not every candidate was measured")
    return Choice(
        backend=chosen["backend"],
        config=dict(chosen["config"]),
        lossy=chosen.get("lossy")
        or (registry.entry(chosen["backend"]).cls.lossy if chosen["backend"] in registry else ""),
        gate=chosen.get("gate"),
        source="tuned",
        workload=workload,
        reason=reason,
        rejected=rejected,
        measured=measured,
        tuned_key=row,
        distance_octaves=dist,
        step_ms=chosen.get("step_ms"),
        table=table.path.name,
        warnings=warns,
    )


def _engine_setting(registry: Registry, choice: Choice) -> str | None:
    """The engine settings that run the chosen kernel in its engine (``None``: not an engine's kernel).

    A backend that wraps an engine's kernel declares ``engine_setting(config) -> str`` (the plugin
    checks the names against the installed engine, e.g. vLLM's attention-backend enum); see
    docs/engines.md.
    """
    if choice.backend not in registry:
        return None
    setting = getattr(registry.get(choice.backend), "engine_setting", None)
    if not callable(setting):
        return None
    try:
        return str(setting(choice.config))
    except Exception as err:  # e.g. the installed engine lacks the name: say so, keep the choice
        choice.warnings.append(
            f"{choice.backend}: cannot name its engine setting ({type(err).__name__}: {err})"
        )
        return None


def _gate_failures(table: Any, workload: Workload) -> dict[str, str]:
    """Backends that failed the correctness gate in this device's table at this dtype."""
    out: dict[str, str] = {}
    for row, e in table.entries.items():
        if e.get("dtype") != workload.dtype_name:
            continue
        for c in e.get("candidates", []):
            if c.get("failed") in ("gate", "nan"):
                out.setdefault(c["backend"], f"failed the correctness gate when tuning {row}")
    return out


# --------------------------------------------------------------------------------------------------
# heuristic
# --------------------------------------------------------------------------------------------------
def _kv_bytes(backend: Backend, workload: Workload) -> int:
    """KV bytes one step reads with ``backend``'s cache layout (scales included), over all layers."""
    from attnbench.costmodel import backend_kv_bytes_per_token, kv_bytes_per_step

    per_token = backend_kv_bytes_per_token(backend, workload)
    return int(kv_bytes_per_step(per_token, tokens=workload.total_tokens + workload.batch))


def _stores_lossily(cls: type[Backend]) -> bool:
    """A backend that declares a lossy cache (``Backend.lossy``, e.g. ``"fp8 e4m3 K/V"``)."""
    return bool(getattr(cls, "lossy", ""))


def _heuristic(
    workload: Workload, registry: Registry, *, failed_gate: dict[str, str], bandwidth: float | None
) -> Choice:
    from attnbench.tuning.space import DEFAULT_BACKENDS

    rejected: list[Rejected] = []
    scored: list[tuple[int, int, str]] = []
    lossy: list[str] = []
    for i, entry in enumerate(registry):
        why_not = _runnable(registry, entry.name, workload) or failed_gate.get(entry.name, "")
        if why_not:
            rejected.append(Rejected(entry.name, why_not))
            continue
        if _stores_lossily(entry.cls):
            lossy.append(entry.name)
            continue
        rank = (
            DEFAULT_BACKENDS.index(entry.name)
            if entry.name in DEFAULT_BACKENDS
            else len(DEFAULT_BACKENDS) + i
        )
        scored.append((_kv_bytes(registry.get(entry.name), workload), rank, entry.name))
    rejected += [
        Rejected(
            n,
            f"lossy ({registry.entry(n).cls.lossy}): chosen only from a tuned table with allow_lossy=True, "
            "never by the heuristic",
        )
        for n in lossy
    ]
    if not scored:
        raise LookupError(
            f"no registered backend can run {workload.describe()}: "
            + "; ".join(f"{r.backend}: {r.reason}" for r in rejected)
        )
    least = min(b for b, _, _ in scored)
    # within 1 % of the fewest bytes is a tie on the roofline: the default backend's order decides
    ties = sorted((rank, name, b) for b, rank, name in scored if b <= least * 1.01)
    _, name, nbytes = ties[0]
    if bandwidth is None:
        from attnbench.device import load_profile

        bandwidth = load_profile(workload.device).bandwidth
    from attnbench.costmodel import StepCost, roofline

    memory_only = StepCost(form="any", kv_bytes=nbytes, io_bytes=0.0, weight_bytes=0.0, flops=0.0)
    estimate = roofline(memory_only, bandwidth=bandwidth, peak_flops=float("inf")).floor_s * 1e3
    for b, _, other in scored:
        if other != name:
            why = (
                f"reads {b / nbytes:.2f}× the KV bytes"
                if b > least * 1.01
                else "same KV bytes; not first in the default order"
            )
            rejected.append(Rejected(other, why))
    reason = (
        f"no tuned entry for {workload.shape.name} {workload.dtype_name} on this device; roofline: a step reads "
        f"{nbytes / 1e6:.4g} MB of KV cache, ≥ {estimate:.4g} ms at {bandwidth / 1e9:.3g} GB/s; "
        f"{name} reads the fewest bytes"
        + (" (tie broken by the default order flash, naive)" if len(ties) > 1 else "")
    )
    config = registry.entry(name).cls.default_config()
    return Choice(name, config, "heuristic", workload, reason, rejected=rejected, estimate_ms=estimate)
