"""Helpers for the tuner, results-table and select() tests: registries of planted backends, device
profiles with a stated bandwidth, and results-table entries built from planted step times.

Workers load a planted backend by import path (``helpers.tuning_helpers:RefuseBackend``), so planted backends
live at the top level of a module, here or in the test module that plants them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path

from attnbench.backends.naive import NaiveBackend
from attnbench.core.backend import Backend
from attnbench.core.device import DeviceProfile, fingerprint
from attnbench.core.registry import Registry, Source, load_registry
from attnbench.core.workload import Workload
from attnbench.hookspecs import hookimpl
from attnbench.tables import CandidateResult, ResultsTable, table_path
from attnbench.tables.dispatch import DispatchMap, GridPoint
from attnbench.tables.margin import SWITCH_MARGIN
from attnbench.tuning import KeyResult, TuneOptions, backend_refs, plan_studies, summarize
from attnbench.tuning.refine import RESOLUTION, Measure, grid_point, refine_map


def stated_profile(bandwidth: float = 2e10, **changes: object) -> DeviceProfile:
    """This machine's device profile with its read bandwidth stated, not measured (tests never measure
    it); ``changes`` replace fields of the fingerprint (another device)."""
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return DeviceProfile(fingerprint("cpu") | changes, bandwidth, bandwidth, 1, now)


class _Planted:
    def __init__(self, classes: tuple[type[Backend], ...]) -> None:
        self.classes = classes

    @hookimpl
    def attnbench_backends(self) -> list[type[Backend]]:
        return list(self.classes)


def planted_registry(*classes: type[Backend]) -> Registry:
    """A registry holding only ``classes``, registered through the plugin hook like any backend."""
    reg = load_registry(builtins=False, env={"ATTNBENCH_DISABLE_PLUGIN_AUTOLOAD": "1"})
    plugin = _Planted(classes)
    reg.manager.register(plugin, name="planted")
    reg._add_from(plugin, Source("plugin", "planted", "tests"))
    return reg


class RefuseBackend(NaiveBackend):
    name = "planted_refuse"

    def supports(self, workload: Workload) -> list[str]:
        return ["planted: refuses every workload"]


def planted_result(
    workload: Workload,
    steps: Mapping[str, float | None],
    *,
    profile: DeviceProfile,
    gbps: float = 1.5,
) -> KeyResult:
    """A finished study of ``workload`` with one trial per built-in backend of ``steps`` (in that order,
    each with its default config): its step time in seconds, or ``None`` where the candidate failed the
    correctness gate (with the error it recorded)."""
    (plan,) = plan_studies([workload], backend_refs(only=list(steps)), profile=profile, options=TuneOptions())
    records = []
    for name, step in steps.items():
        config = plan.space.backends[name].cls.default_config()
        if step is not None:
            records.append(CandidateResult(name, config, step_ms=step * 1e3, gbps=gbps, pct_of_bandwidth=7.5))
        else:
            error = {"max_abs": 0.3, "rel_l2": 0.2}
            records.append(
                CandidateResult(name, config, failed="gate", reason="broke tolerance", error=error)
            )
    return KeyResult(plan, records)


def planted_entry(
    workload: Workload, *, flash: float | None, naive: float | None, profile: DeviceProfile
) -> tuple[str, dict]:
    """The results-table row and entry of a flash-vs-naive study with the planted step times (seconds;
    ``None``: failed the gate)."""
    result = planted_result(workload, {"flash": flash, "naive": naive}, profile=profile)
    return result.key.row, summarize(result, profile=profile)


def save_table(folder: Path, rows: Mapping[str, dict], *, profile: DeviceProfile) -> Path:
    """``rows`` written as the results table of ``profile``'s device in ``folder``; returns its path."""
    path = table_path(folder, profile.fingerprint)
    ResultsTable(path, {}).save(dict(rows), profile=profile)
    return path


def build_map(
    measure: Measure,
    *,
    model: str,
    shape_hash: str,
    dtype: str,
    default: str | None,
    batches: Sequence[int],
    contexts: Sequence[int],
    margin: float = SWITCH_MARGIN,
    resolution: float = RESOLUTION,
    refine: bool = True,
    on_point: Callable[[GridPoint], None] | None = None,
) -> DispatchMap:
    """Measure the coarse grid ``batches × contexts`` (every candidate), then refine it: the map the
    tuner builds, from a test's planted ``measure``."""
    m = DispatchMap(model, shape_hash, dtype, default, list(batches), list(contexts), {}, {}, margin)
    coarse = 0
    for b in m.batches:
        for c in m.contexts:
            got = measure(b, c, None)
            coarse += got.evaluations or len(got.times) + len(got.failed)
            for k, cand in got.candidates.items():
                m.candidates.setdefault(k, cand)
            m.points[(b, c)] = point = grid_point(b, c, got, default=default, margin=margin)
            if on_point is not None:
                on_point(point)
    m.refinement = {"evaluations": coarse}
    if refine:
        refine_map(m, measure, resolution=resolution, on_point=on_point)
    else:
        m.refinement |= {"rounds": 0, "points": len(m.points), "complete": True}
    return m
