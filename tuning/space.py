"""The search space of one tuning key, built from the backends' declared tunables.

The backend is a categorical parameter; each backend's tunables are parameters conditional on it
(named ``"<backend>.<tunable>"``). Backends whose ``supports()`` refuses the workload, or whose
kernels would run in an interpreter (checked, never timed), are left out and listed with the reason.

Backends travel to worker processes as import paths (``"package.module:Class"``), so a backend
registered only in a test's registry, or by a plugin, is found by the worker the same way.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from attnbench.core.backend import Backend, Tunable
from attnbench.core.plugin_call import ask_many
from attnbench.core.registry import Registry, load_registry
from attnbench.core.workload import Workload
from attnbench.tables.table_schema import DEFAULT_BACKENDS, Candidate

__all__ = [
    "BackendRef",
    "Excluded",
    "SearchSpace",
    "backend_refs",
    "build_space",
]


_PRIMITIVE = (bool, int, float, str, type(None))


@dataclass(frozen=True)
class BackendRef:
    """A backend by registry name, with the import path a worker process loads it from."""

    name: str
    ref: str
    cls: type[Backend]

    @classmethod
    def of(cls, backend: type[Backend]) -> BackendRef:
        qual = backend.__qualname__
        if "<locals>" in qual or backend.__module__ == "__main__":
            raise ValueError(
                f"backend {backend.name!r} ({backend.__module__}.{qual}) cannot be loaded by a worker "
                "process: define it at the top level of an importable module"
            )
        return cls(backend.name, f"{backend.__module__}:{qual}", backend)


def backend_refs(
    registry: Registry | None = None,
    *,
    only: Sequence[str] | None = None,
    extra: Iterable[type[Backend]] = (),
) -> list[BackendRef]:
    """Backends of ``registry`` (default: the full registry), optionally only the names in ``only``."""
    registry = registry if registry is not None else load_registry()
    refs = [BackendRef.of(e.cls) for e in registry] + [BackendRef.of(c) for c in extra]
    if only is not None:
        by_name = {r.name: r for r in refs}
        unknown = [n for n in only if n not in by_name]
        if unknown:
            raise ValueError(f"unknown backend {unknown[0]!r}; registered: {', '.join(by_name) or 'none'}")
        refs = [by_name[n] for n in only]
    return refs


@dataclass(frozen=True)
class Excluded:
    backend: str
    reasons: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "reason": "; ".join(self.reasons)}


@dataclass
class SearchSpace:
    """Runnable backends with their tunables for one workload, plus the backends left out and why."""

    workload: Workload
    backends: dict[str, BackendRef]
    tunables: dict[str, tuple[Tunable, ...]]
    excluded: list[Excluded] = field(default_factory=list)
    default_backend: str | None = None

    # -- enumeration -----------------------------------------------------------------------------
    def candidates(self) -> list[Candidate]:
        """The full grid: the default candidate first, then each backend's default, then the rest."""
        out: list[Candidate] = []
        for name, ref in self.backends.items():
            base, names = ref.cls.default_config(), [t.name for t in self.tunables[name]]
            grid = itertools.product(*(t.choices for t in self.tunables[name]))
            out += [Candidate(name, {**base, **dict(zip(names, g, strict=True))}) for g in grid]
        first = [self.default_candidate()] if self.default_backend else []
        defaults = [Candidate(n, self.backends[n].cls.default_config()) for n in self.backends]
        ordered: dict[str, Candidate] = {}  # by ident, the first of each
        for c in [*first, *defaults, *out]:
            ordered.setdefault(c.ident(), c)
        return list(ordered.values())

    def canonical(self, candidate: Candidate) -> Candidate:
        """``candidate`` as this space holds it: its config through its backend's ``canonical_config``
        for this workload (``cpu_decode``'s ``kv_splits=1`` is ``auto`` where ``auto`` runs one split),
        so that a table's or another key's config finds its equal here; as it is where the backend is
        not in this space or its hook fails."""
        ref = self.backends.get(candidate.backend)
        if ref is None:
            return candidate
        try:
            return Candidate(candidate.backend, ref.cls().canonical_config(self.workload, candidate.config))
        except Exception:  # a plugin's hook that fails: the config as given (it is then simply not found)
            return candidate

    def size(self) -> int:
        return sum(math.prod(len(t.choices) for t in self.tunables[name]) for name in self.backends)

    def default_candidate(self) -> Candidate:
        if self.default_backend is None:
            raise ValueError(
                f"no default backend ({', '.join(DEFAULT_BACKENDS)}) can run {self.workload.describe()}"
            )
        return Candidate(self.default_backend, self.backends[self.default_backend].cls.default_config())

    def space_id(self, code: str) -> str:
        """Hash of the space (backends, their tunables' choices) and the backends' code."""
        body = {
            n: [[t.name, [repr(c) for c in t.choices]] for t in self.tunables[n]]
            for n in sorted(self.backends)
        }
        return hashlib.sha256(json.dumps([body, code], sort_keys=True).encode()).hexdigest()[:10]

    # -- Optuna ----------------------------------------------------------------------------------
    def suggest(self, trial: Any) -> Candidate:
        """Ask ``trial`` (an Optuna trial) for a backend, then for that backend's parameters."""
        name = trial.suggest_categorical("backend", list(self.backends))
        config = self.backends[name].cls.default_config()
        for t in self.tunables[name]:
            config[t.name] = _suggest_choice(trial, f"{name}.{t.name}", t.choices)
        return Candidate(name, config)

    def params(self, candidate: Candidate) -> dict[str, Any]:
        """The Optuna params that make :meth:`suggest` return ``candidate`` (for ``enqueue_trial``)."""
        params: dict[str, Any] = {"backend": candidate.backend}
        for t in self.tunables[candidate.backend]:
            value = candidate.config[t.name]
            params[f"{candidate.backend}.{t.name}"] = value if _primitive(t.choices) else repr(value)
        return params

    def candidate_from_params(self, params: Mapping[str, Any]) -> Candidate | None:
        """The candidate a trial's params (or an enqueued trial's fixed params) stand for."""
        name = params.get("backend")
        if name not in self.backends:
            return None
        config = self.backends[name].cls.default_config()
        for t in self.tunables[name]:
            key = f"{name}.{t.name}"
            if key in params:
                value = params[key]
                config[t.name] = (
                    value if _primitive(t.choices) else {repr(c): c for c in t.choices}.get(value, value)
                )
        return Candidate(name, config)

    def describe(self) -> dict[str, Any]:
        return {
            "backends": {n: {t.name: list(t.choices) for t in self.tunables[n]} for n in self.backends},
            "excluded": [e.as_dict() for e in self.excluded],
            "default": self.default_candidate().label() if self.default_backend else None,
            "size": self.size(),
        }


def _primitive(choices: Sequence[Any]) -> bool:
    return all(isinstance(c, _PRIMITIVE) for c in choices)


def _suggest_choice(trial: Any, name: str, choices: Sequence[Any]) -> Any:
    if _primitive(choices):
        return trial.suggest_categorical(name, list(choices))
    by_repr = {repr(c): c for c in choices}  # Optuna stores only primitives: go through repr
    return by_repr[trial.suggest_categorical(name, list(by_repr))]


def build_space(
    workload: Workload,
    refs: Sequence[BackendRef],
    *,
    allow_interpreted: bool = False,
    allow_lossy: bool = False,
) -> SearchSpace:
    """The space for ``workload``: every backend in ``refs`` that can run it and is not interpreted.

    A lossy cache (``Backend.lossy``, e.g. fp8 K/V) takes part only with ``allow_lossy``.
    """
    backends: dict[str, BackendRef] = {}
    tunables: dict[str, tuple[Tunable, ...]] = {}
    excluded: list[Excluded] = []

    # plugin code answers in a child process, bounded in time (a hang holding the GIL included)
    for ref, answers in zip(refs, ask_many([r.cls for r in refs], workload), strict=True):
        reasons = list(answers.reasons)
        if not reasons and answers.interpreted and not allow_interpreted:
            reasons = ["kernels would run in an interpreter here: checked for correctness, never timed"]
        lossy = answers.lossy
        if not reasons and lossy and not allow_lossy:
            reasons = [f"lossy ({lossy}): competes only with --allow-lossy or --accuracy-budget"]
        if reasons:
            excluded.append(Excluded(ref.name, tuple(reasons)))
        else:
            backends[ref.name], tunables[ref.name] = ref, answers.tunables
    # the first default backend that can run it, else the first backend that can
    default = next((n for n in (*DEFAULT_BACKENDS, *backends) if n in backends), None)
    return SearchSpace(workload, backends, tunables, excluded, default)
