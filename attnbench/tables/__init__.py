"""The tuned map: what ``attnbench tune`` measured, in the form every reader takes it.

- :mod:`~attnbench.tables.key` — the tuning key (device, shape, dtype, batch and context buckets);
- :mod:`~attnbench.tables.table_schema` — a table entry and its candidates, typed and validated;
- :mod:`~attnbench.tables.table` — the per-device results table (YAML), read and written safely;
- :mod:`~attnbench.tables.dispatch` — the dispatch map (a batch × context grid of measured times);
- :mod:`~attnbench.tables.lookup` — its per-call lookup (what ``select()`` runs);
- :mod:`~attnbench.tables.margin` — times with confidence intervals and the one margin policy;
- :mod:`~attnbench.tables.files` — atomic writes under a lock;
- :mod:`~attnbench.tables.corpus` — the shipped corpus: known devices' tables for a machine not tuned yet.

``attnbench.tuning`` writes these; ``attnbench.selection`` and ``attnbench.cost`` read them. Nothing here
imports the autotuner or Optuna.
"""

from __future__ import annotations

from attnbench.tables.corpus import (
    CORPUS_DIR,
    CORPUS_ENV,
    CorpusEntry,
    corpus_enabled,
    corpus_entries,
    corpus_entry,
)
from attnbench.tables.dispatch import (
    Basis,
    DispatchMap,
    GridPoint,
    Lookup,
    MapCandidate,
    dispatch_path,
    load_maps,
    map_key,
    merge_maps,
    save_maps,
)
from attnbench.tables.files import locked, write_atomically
from attnbench.tables.key import TuningKey, bucket_distance
from attnbench.tables.margin import (
    NEAR_ENOUGH,
    SWITCH_MARGIN,
    Interval,
    Verdict,
    beats,
    bootstrap_median,
    decide,
    finalists,
    in_doubt,
    median_time,
    sample_rounds,
    too_wide,
    undecided,
)
from attnbench.tables.table import (
    DeviceMismatchError,
    ResultsTable,
    TableReadError,
    hardware_id,
    table_path,
    versions,
)
from attnbench.tables.table_schema import (
    DEFAULT_BACKENDS,
    Candidate,
    CandidateResult,
    TableEntry,
    TableError,
    validate_entries,
)

__all__ = [
    "CORPUS_DIR",
    "CORPUS_ENV",
    "DEFAULT_BACKENDS",
    "NEAR_ENOUGH",
    "SWITCH_MARGIN",
    "Basis",
    "Candidate",
    "CandidateResult",
    "CorpusEntry",
    "DeviceMismatchError",
    "DispatchMap",
    "GridPoint",
    "Interval",
    "Lookup",
    "MapCandidate",
    "ResultsTable",
    "TableEntry",
    "TableError",
    "TableReadError",
    "TuningKey",
    "Verdict",
    "beats",
    "bootstrap_median",
    "bucket_distance",
    "corpus_enabled",
    "corpus_entries",
    "corpus_entry",
    "decide",
    "dispatch_path",
    "finalists",
    "hardware_id",
    "in_doubt",
    "load_maps",
    "locked",
    "map_key",
    "median_time",
    "merge_maps",
    "sample_rounds",
    "save_maps",
    "table_path",
    "too_wide",
    "undecided",
    "validate_entries",
    "versions",
    "write_atomically",
]
