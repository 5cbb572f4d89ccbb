"""The tuned map's modules on their own: atomic files, tuning keys, table paths and entries."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers.tuning_helpers import stated_profile

from attnbench.core.workload import Workload
from attnbench.tables.files import locked, write_atomically
from attnbench.tables.key import TuningKey, bucket_distance
from attnbench.tables.lookup import weights
from attnbench.tables.table import hardware_id, table_path, versions
from attnbench.tables.table_schema import TableError, validate_entries

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
    assert TuningKey.from_fields(key.as_dict(), device="dev") == key
    assert key.representative(W).context_lens == (128,) * 4
    assert bucket_distance(key, batch=4, context=128) == 0
    assert bucket_distance(key, batch=2, context=512) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="'model' = None: expected str"):
        TuningKey.from_fields({}, device="dev")


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


def test_the_lookups_corner_weights_are_bilinear_and_sum_to_one() -> None:
    """A dispatch-map cell's four corners, (b0, c0), (b1, c0), (b0, c1), (b1, c1): all weight on the
    corner the point sits at, the mean at the centre, and always a total of one."""
    assert weights(0.0, 0.0) == (1.0, 0.0, 0.0, 0.0)
    assert weights(1.0, 1.0) == (0.0, 0.0, 0.0, 1.0)
    assert weights(0.5, 0.5) == (0.25, 0.25, 0.25, 0.25)
    assert sum(weights(0.3, 0.8)) == pytest.approx(1.0)
    assert weights(0.3, 0.8)[2] == pytest.approx(0.7 * 0.8)
