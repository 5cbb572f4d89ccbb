"""The tuner's modules on their own (no worker runs a candidate): atomic files, tuning keys, the
search space, the study plan, storage helpers, table paths and entries, summaries, and ``tune()``'s
bookkeeping around an empty plan."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers.tuning_helpers import stated_profile

from attnbench.core.locations import REFERENCE_MARKER, ResultsLocationError
from attnbench.core.workload import Workload
from attnbench.tuning.files import locked, write_atomically
from attnbench.tuning.key import TuningKey, bucket_distance
from attnbench.tuning.space import DEFAULT_BACKENDS, Candidate, backend_refs, build_space
from attnbench.tuning.storage import JOURNAL_NAME, redact, repair_journal
from attnbench.tuning.study import TuneOptions, plan_studies
from attnbench.tuning.summary import candidate_label, versions
from attnbench.tuning.table import hardware_id, table_path
from attnbench.tuning.table_schema import TableError, validate_entries
from attnbench.tuning.tuner import TuneReport, tune

W = Workload.uniform("tiny-gqa", batch=3, context=100, dtype="fp32")


def test_write_atomically_takes_the_umasks_mode_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    before = os.umask(0o022)
    try:
        with locked(path):
            write_atomically(path, "a: 1\n")
    finally:
        os.umask(before)
    assert path.read_text() == "a: 1\n" and (path.stat().st_mode & 0o777) == 0o644
    write_atomically(path, b"b", mode=0o600)
    assert path.read_bytes() == b"b" and (path.stat().st_mode & 0o777) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.yaml", "t.yaml.lock"]


def test_a_tuning_key_buckets_the_workload_and_round_trips_its_row() -> None:
    key = TuningKey.for_workload(W, device="dev")
    assert (key.batch_bucket, key.context_bucket, key.dtype) == (4, 128, "fp32")
    assert key.row.startswith("tiny-gqa@") and key.row.endswith("/fp32/b4/ctx128")
    assert TuningKey.from_row(key.row, device="dev") == key
    assert key.representative(W).context_lens == (128,) * 4
    assert bucket_distance(key, batch=4, context=128) == 0
    assert bucket_distance(key, batch=2, context=512) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="not of the form"):
        TuningKey.from_row("nonsense", device="dev")


def test_the_space_puts_the_default_candidate_first_and_plans_one_study_per_key() -> None:
    refs = backend_refs(only=list(DEFAULT_BACKENDS))
    space = build_space(W, refs)
    candidates = space.candidates()
    assert set(space.backends) == set(DEFAULT_BACKENDS) and len(candidates) == space.size()
    assert candidates[0] == space.default_candidate()
    assert Candidate("naive", {"a": 1}).label() == "naive[a=1]"
    assert candidate_label({"backend": "naive", "config": {"a": 1}}) == "naive[a=1]"
    twin = Workload.uniform("tiny-gqa", batch=4, context=120, dtype="fp32")  # the same buckets
    plans = plan_studies([W, twin], refs, profile=stated_profile(), options=TuneOptions())
    assert len(plans) == 1 and plans[0].exhaustive and plans[0].target == space.size()


def test_storage_helpers_hide_the_password_and_repair_a_torn_journal(tmp_path: Path) -> None:
    assert redact("postgresql://u:secret@h/db") == "postgresql://u:***@h/db"
    journal = tmp_path / JOURNAL_NAME
    assert repair_journal(journal) == ""  # missing: nothing to do
    journal.write_bytes(b'{"op_code": 0}\n{"op_co')
    message = repair_journal(journal)
    assert message and journal.read_bytes() == b'{"op_code": 0}\n'
    assert len(list(tmp_path.glob(f"{JOURNAL_NAME}.torn-*"))) == 1


def test_table_paths_ignore_library_versions_and_entries_are_validated(tmp_path: Path) -> None:
    fp = stated_profile().fingerprint
    newer = dict(fp, torch="99.0")
    assert hardware_id(fp) == hardware_id(newer) and table_path(tmp_path, fp) == table_path(tmp_path, newer)
    assert table_path(tmp_path, fp).name.startswith("tuning-cpu-")
    assert validate_entries({}) == {}
    with pytest.raises(TableError, match="'entries' must be a mapping"):
        validate_entries([])
    with pytest.raises(TableError, match="entries.row"):
        validate_entries({"row": {"winner": 3}})
    assert set(versions()) == {"attnbench", "torch", "triton"}


def test_tune_with_nothing_to_tune_writes_nothing_and_refuses_a_reference_folder(tmp_path: Path) -> None:
    report = tune([], results_dir=tmp_path, profile=stated_profile(), samples=0)
    assert isinstance(report, TuneReport) and report.results == [] and report.trials_run == 0
    assert report.table_path.parent == tmp_path and report.storage == str(tmp_path / JOURNAL_NAME)
    assert not report.table_path.exists()
    (tmp_path / REFERENCE_MARKER).write_text("committed runs\n")
    with pytest.raises(ResultsLocationError, match=REFERENCE_MARKER):
        tune([], results_dir=tmp_path, profile=stated_profile(), samples=0)
