"""Results tables: the switch margin, merging, atomic writes, corrupt files, other devices, versions."""

from __future__ import annotations

import pytest
import yaml
from helpers.tuning_helpers import planted_result, stated_profile

from attnbench.core.device import fingerprint
from attnbench.core.workload import Workload
from attnbench.tables import DeviceMismatchError, ResultsTable, TableError, table_path
from attnbench.tuning import KeyResult, summarize

W = Workload.uniform("tiny-gqa", batch=1, context=512, dtype="fp32")


def _result(flash: float | None, naive: float | None, *, workload: Workload = W) -> KeyResult:
    return planted_result(workload, {"flash": flash, "naive": naive}, profile=stated_profile())


def test_the_default_is_kept_unless_beaten_by_the_margin():
    assert _result(flash=1e-3, naive=1e-3).plan.space.default_backend == "flash"
    kept = summarize(_result(flash=1.03e-3, naive=1.00e-3), profile=stated_profile())
    assert kept["winner"]["backend"] == "flash" and "only 3.0% faster" in kept["decision"]
    assert kept["runner_up"]["backend"] == "naive" and kept["margin"] < 0
    switched = summarize(_result(flash=1.2e-3, naive=1.0e-3), profile=stated_profile())
    assert switched["winner"]["backend"] == "naive" and switched["margin"] == pytest.approx(0.2)
    assert switched["default"]["step_ms"] == pytest.approx(1.2) and switched["winner"]["gbps"] == 1.5


def test_a_failed_candidate_never_wins():
    entry = summarize(_result(flash=None, naive=2e-3), profile=stated_profile())
    assert entry["winner"]["backend"] == "naive" and entry["runner_up"] is None
    assert "the default failed (gate)" in entry["decision"]
    failed = next(c for c in entry["candidates"] if c["backend"] == "flash")
    assert failed["failed"] == "gate" and failed["error"]["rel_l2"] == 0.2
    none = summarize(_result(flash=None, naive=None), profile=stated_profile())
    assert none["winner"] is None and none["decision"] == "no candidate passed the correctness gate"


def test_tables_merge_and_are_written_atomically(tmp_path):
    profile = stated_profile()
    path = table_path(tmp_path, profile.fingerprint)
    a = summarize(_result(flash=1e-3, naive=2e-3), profile=profile)
    b = summarize(
        _result(flash=1e-3, naive=2e-3, workload=Workload.uniform("tiny-gqa", batch=8, context=64)),
        profile=profile,
    )
    ResultsTable(path, {}).save({"row-a": a}, profile=profile)
    ResultsTable(path, {}).save({"row-b": b}, profile=profile)
    table = ResultsTable.load(path, fingerprint=profile.fingerprint)
    assert set(table.entries) == {"row-a", "row-b"} and not table.warnings
    assert table.device["bandwidth_gbps"] == 20.0 and table.meta["torch"]
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".tmp"] == []
    assert path.read_text().startswith("# attnbench tuning table")


def test_a_corrupt_table_is_moved_aside_never_overwritten(tmp_path):
    profile = stated_profile()
    path = table_path(tmp_path, profile.fingerprint)
    path.write_text("entries: [this is: not: a table")
    with pytest.raises(TableError, match="not valid YAML"):
        ResultsTable.load(path, fingerprint=profile.fingerprint)
    messages = ResultsTable(path, {}).save(
        {"row": summarize(_result(1e-3, 2e-3), profile=profile)}, profile=profile
    )
    (aside,) = [p for p in tmp_path.iterdir() if ".corrupt-" in p.name]
    assert aside.read_text() == "entries: [this is: not: a table"
    assert "moved it aside" in messages[0] and aside.name in messages[0]
    assert set(ResultsTable.load(path, fingerprint=profile.fingerprint).entries) == {"row"}


def test_another_devices_table_is_refused(tmp_path):
    other = stated_profile(name="Some Other CPU", threads=96)
    path = table_path(tmp_path, other.fingerprint)
    ResultsTable(path, {}).save({"row": summarize(_result(1e-3, 2e-3), profile=other)}, profile=other)
    with pytest.raises(DeviceMismatchError, match="tuned on 'Some Other CPU'.*Refusing"):
        ResultsTable.load(path, fingerprint=fingerprint("cpu"))


def test_other_library_versions_warn(tmp_path):
    profile = stated_profile()
    path = table_path(tmp_path, profile.fingerprint)
    ResultsTable(path, {}).save({"row": summarize(_result(1e-3, 2e-3), profile=profile)}, profile=profile)
    data = yaml.safe_load(path.read_text())
    data["entries"]["row"]["versions"]["torch"] = "1.0.0"
    path.write_text(yaml.safe_dump(data))
    table = ResultsTable.load(path, fingerprint=profile.fingerprint)
    assert len(table.warnings) == 1 and "torch 1.0.0 →" in table.warnings[0]
