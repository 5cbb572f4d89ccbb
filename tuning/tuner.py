"""``tune()``: plan one study per key, run each in a worker, write the device's results table."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnbench.backend import Backend
from attnbench.device import DeviceProfile, load_profile
from attnbench.registry import Registry
from attnbench.tuning.space import backend_refs
from attnbench.tuning.storage import redact
from attnbench.tuning.study import (
    JOURNAL_NAME,
    KeyResult,
    StudyPlan,
    TrialRecord,
    TuneOptions,
    open_storage,
    plan_studies,
    run_study,
)
from attnbench.tuning.table import SWITCH_MARGIN, ResultsTable, summarize, table_path
from attnbench.tuning.worker import Worker
from attnbench.workload import Workload

__all__ = ["TuneReport", "default_results_dir", "tune"]


def default_results_dir() -> Path:
    """``$ATTNBENCH_RESULTS_DIR``, else ``results/`` in the working directory."""
    import os

    return Path(os.environ.get("ATTNBENCH_RESULTS_DIR") or "results")


@dataclass
class TuneReport:
    results: list[KeyResult]
    entries: dict[str, dict[str, Any]]
    table_path: Path
    storage: str
    messages: list[str] = field(default_factory=list)
    interrupted: bool = False

    @property
    def trials_run(self) -> int:
        return sum(r.ran for r in self.results)


def tune(
    workloads: Sequence[Workload],
    *,
    registry: Registry | None = None,
    backends: Sequence[str] | None = None,
    extra_backends: Sequence[type[Backend]] = (),
    results_dir: str | Path | None = None,
    storage: str | None = None,
    options: TuneOptions | None = None,
    profile: DeviceProfile | None = None,
    margin: float = SWITCH_MARGIN,
    command: str = "",
    on_plan: Callable[[list[StudyPlan]], None] | None = None,
    on_trial: Callable[[StudyPlan, TrialRecord, bool], None] | None = None,
) -> TuneReport:
    """Tune every key that ``workloads`` fall in, and merge the winners into the device's table.

    Args:
        registry: where the candidate backends come from (default: the full registry).
        backends: only these registry names (default: all).
        extra_backends: more backend classes (importable by path) to consider.
        results_dir: where the table and the embedded study journal live (default ``results/``).
        storage: an Optuna RDB URL instead of the embedded journal.
        on_plan / on_trial: progress hooks (called with the plans, then after each trial).

    Ctrl-C stops after marking the running trial interrupted; what was measured is kept in the
    study and written to the table (entries marked ``complete: false``), and ``interrupted`` is set.
    """
    options = options or TuneOptions()
    results = Path(results_dir) if results_dir is not None else default_results_dir()
    profile = profile or load_profile(workloads[0].device if workloads else "cpu")
    refs = backend_refs(registry, only=backends, extra=extra_backends)
    plans = plan_studies(workloads, refs, profile=profile, options=options)
    if on_plan is not None:
        on_plan(plans)
    report = TuneReport(
        [],
        {},
        table_path(results, profile.fingerprint),
        redact(storage) if storage else str(results / JOURNAL_NAME),
    )
    store = open_storage(
        storage, results_dir=results, heartbeat_s=options.heartbeat_s, messages=report.messages
    )
    table = ResultsTable(report.table_path, {})
    with Worker(memory_limit_bytes=options.memory_limit_bytes) as worker:
        for plan in plans:
            try:
                result = run_study(
                    plan, storage=store, worker=worker, profile=profile, options=options, on_trial=on_trial
                )
            except KeyboardInterrupt:
                report.interrupted = True
                break
            report.results.append(result)
            if result.records:
                entry = summarize(result, profile=profile, margin=margin, command=command)
                report.entries[plan.key.row] = entry
                report.messages += table.save({plan.key.row: entry}, profile=profile)
            if result.interrupted:
                report.interrupted = True
                break
    return report
