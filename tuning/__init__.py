"""The autotuner (one Optuna study per tuning key) and the per-device results tables.

Typical use is the command line (``attnbench tune``); in Python::

    from attnbench.tuning import tune
    report = tune([Workload.uniform("llama-3.1-8b", batch=8, context="8k")])
    report.entries["llama-3.1-8b@.../bf16/b8/ctx8192"]["winner"]

and, at run time, :func:`attnbench.select` reads the table this writes.
"""

from __future__ import annotations

from attnbench.tuning import study
from attnbench.tuning.key import TuningKey, bucket_distance
from attnbench.tuning.space import (
    DEFAULT_BACKENDS,
    BackendRef,
    Candidate,
    Excluded,
    SearchSpace,
    backend_refs,
    build_space,
    code_hash,
    load_backend_class,
)
from attnbench.tuning.storage import StorageError, repair_journal
from attnbench.tuning.study import *  # noqa: F403  (the study API, as study.__all__ names it)
from attnbench.tuning.table import (
    SWITCH_MARGIN,
    CandidateResult,
    DeviceMismatchError,
    ResultsTable,
    TableEntry,
    TableError,
    TableReadError,
    hardware_id,
    summarize,
    table_path,
)
from attnbench.tuning.tuner import TuneReport, default_results_dir, tune
from attnbench.tuning.worker import Outcome, Worker, WorkerTask, evaluate

__all__ = [
    "DEFAULT_BACKENDS",
    "SWITCH_MARGIN",
    "BackendRef",
    "Candidate",
    "CandidateResult",
    "DeviceMismatchError",
    "Excluded",
    "Outcome",
    "ResultsTable",
    "SearchSpace",
    "StorageError",
    "TableEntry",
    "TableError",
    "TableReadError",
    "TuneReport",
    "TuningKey",
    "Worker",
    "WorkerTask",
    "backend_refs",
    "bucket_distance",
    "build_space",
    "code_hash",
    "default_results_dir",
    "evaluate",
    "hardware_id",
    "load_backend_class",
    "repair_journal",
    "summarize",
    "table_path",
    "tune",
]
__all__ += study.__all__
