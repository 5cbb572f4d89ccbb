"""The autotuner (one Optuna study per tuning key) and the per-device results tables.

Typical use is the command line (``attnbench tune``); in Python::

    from attnbench.tuning import tune
    report = tune([Workload.uniform("llama-3.1-8b", batch=8, context="8k")])
    report.entries["llama-3.1-8b@.../bf16/b8/ctx8192"]["winner"]

and, at run time, :func:`attnbench.select` reads the table this writes.

The study, its storage and the tuner need Optuna; their names are imported on first use, so that
reading a results table (``select()``, ``attnbench.tables.table``) and checking or timing a backend
work where Optuna is not installed (the GPU check runs on such a machine).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from attnbench.core.registry import code_hash, load_backend_class
from attnbench.tuning.interleave import Finalist, retime
from attnbench.tuning.space import (
    BackendRef,
    Excluded,
    SearchSpace,
    backend_refs,
    build_space,
)
from attnbench.tuning.summary import candidate_label, summarize
from attnbench.tuning.supervisor import Worker
from attnbench.tuning.worker import Outcome, WorkerTask, evaluate

if TYPE_CHECKING:  # what __getattr__ below imports on first use, for type checkers
    from attnbench.tuning.storage import StorageError, repair_journal
    from attnbench.tuning.study import (
        JOURNAL_NAME,
        KeyResult,
        StudyPlan,
        TuneOptions,
        open_storage,
        plan_studies,
        run_study,
    )
    from attnbench.tuning.tuner import TuneReport, tune

__all__ = [
    "JOURNAL_NAME",
    "BackendRef",
    "Excluded",
    "Finalist",
    "KeyResult",
    "Outcome",
    "SearchSpace",
    "StorageError",
    "StudyPlan",
    "TuneOptions",
    "TuneReport",
    "Worker",
    "WorkerTask",
    "backend_refs",
    "build_space",
    "candidate_label",
    "code_hash",
    "evaluate",
    "load_backend_class",
    "open_storage",
    "plan_studies",
    "repair_journal",
    "retime",
    "run_study",
    "summarize",
    "tune",
]
#: names of the Optuna-backed modules, imported on first use (``attnbench.tuning.tune``...)
_LAZY = dict.fromkeys(("StorageError", "repair_journal"), "storage")
_LAZY |= dict.fromkeys(("TuneReport", "tune"), "tuner")
_STUDY = ("JOURNAL_NAME", "KeyResult", "StudyPlan", "TuneOptions", "open_storage")
_LAZY |= dict.fromkeys((*_STUDY, "plan_studies", "run_study"), "study")


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'attnbench.tuning' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"attnbench.tuning.{module}"), name)
    globals()[name] = value
    return value
