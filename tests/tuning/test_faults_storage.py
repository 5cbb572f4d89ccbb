"""Faults planted in what the tuner stores: a torn journal line, truncated or invalid tables, the
umask, a failed write, storage URLs that cannot work. Each must lose nothing and say one line."""

from __future__ import annotations

import os
import stat

import optuna
import pytest
import yaml
from helpers.tuning_helpers import planted_entry, save_table, stated_profile

from attnbench.core.device import DeviceProfile
from attnbench.core.workload import Workload
from attnbench.tables import ResultsTable, TableError
from attnbench.tuning import JOURNAL_NAME, StorageError, open_storage

W = Workload.uniform("tiny-gqa", batch=1, context=512, dtype="fp32")


def _entry(profile: DeviceProfile) -> tuple[str, dict]:
    return planted_entry(W, flash=2e-3, naive=1e-3, profile=profile)


def _finished_trials(tmp_path, n: int) -> None:
    storage = open_storage(None, results_dir=tmp_path)
    study = optuna.create_study(study_name="s", storage=storage)
    for i in range(n):
        study.tell(study.ask(), float(i))


# -- the journal ---------------------------------------------------------------------------------
@pytest.mark.parametrize("glued", [False, True], ids=["torn-tail", "torn-line-with-a-later-write"])
def test_a_torn_journal_line_is_set_aside_and_every_finished_trial_kept(tmp_path, glued):
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    _finished_trials(tmp_path, 3)
    journal = tmp_path / JOURNAL_NAME
    with journal.open("ab") as f:
        f.write(b'{"op_code":5,"worker_id":"x","trial_id":2,"sta')  # a write cut short (disk full)
    if glued:  # a later process appended a whole line onto the fragment: every read used to fail
        with journal.open("ab") as f:
            f.write(b'{"op_code":0,"worker_id":"y","study_name":"t","directions":[1]}\n')
    messages: list[str] = []
    storage = open_storage(None, results_dir=tmp_path, messages=messages)
    study = optuna.load_study(study_name="s", storage=storage)
    assert [t.value for t in study.get_trials()] == [0.0, 1.0, 2.0]
    assert len(messages) == 1 and "torn write" in messages[0]
    (aside,) = tmp_path.glob(f"{JOURNAL_NAME}.torn-*")
    assert aside.read_bytes().startswith(b'{"op_code":5,"worker_id":"x"')
    if glued:  # the whole line glued on is kept: its study exists
        assert "t" in [s.study_name for s in optuna.get_all_study_summaries(storage)]
    study.tell(study.ask(), 3.0)  # and the journal is writable again
    assert (
        len(optuna.load_study(study_name="s", storage=open_storage(None, results_dir=tmp_path)).trials) == 4
    )


# -- the table -----------------------------------------------------------------------------------
def _written_table(tmp_path) -> tuple:
    profile = stated_profile()
    return profile, save_table(tmp_path, dict([_entry(profile)]), profile=profile)


def test_a_truncated_table_is_refused_at_every_cut_and_moved_aside_by_the_next_save(tmp_path):
    profile, path = _written_table(tmp_path)
    text = path.read_text()
    whole = text.rstrip("\n")
    accepted = []
    for cut in range(1, len(whole), max(1, len(whole) // 120)):  # ~120 cut points
        path.write_text(text[:cut])
        try:
            ResultsTable.load(path, fingerprint=profile.fingerprint)
        except TableError as err:
            assert "\n" not in str(err)
        else:
            accepted.append(cut)
    assert accepted == []
    path.write_text(text[: len(text) // 2])
    messages = ResultsTable(path, {}).save(dict([_entry(profile)]), profile=profile)
    assert "moved it aside" in messages[0]
    assert len(list(tmp_path.glob("*.corrupt-*.yaml"))) == 1
    assert len(ResultsTable.load(path, fingerprint=profile.fingerprint).typed()) == 1


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda e: e.pop("winner"), "winner"),
        (lambda e: e["winner"].pop("config"), "winner.config"),
        (lambda e: e["winner"].pop("step_ms"), "winner"),
        (lambda e: e.update(batch_bucket="eight"), "batch_bucket"),
        (lambda e: e["candidates"].pop(), "trials"),
        (lambda e: e["winner"].update(step_ms=float("nan")), "step_ms"),
    ],
)
def test_an_entry_that_breaks_the_schema_is_refused_naming_the_field(tmp_path, change, field):
    profile, path = _written_table(tmp_path)
    data = yaml.safe_load(path.read_text())
    change(next(iter(data["entries"].values())))
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(TableError, match=field) as err:
        ResultsTable.load(path, fingerprint=profile.fingerprint)
    assert "\n" not in str(err.value)


def test_tables_follow_the_umask_and_a_failed_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    old = os.umask(0o022)
    try:
        profile, path = _written_table(tmp_path)
        assert stat.S_IMODE(path.stat().st_mode) == 0o644
    finally:
        os.umask(old)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(TableError, match="cannot write results table .*No space left on device"):
        ResultsTable(path, {}).save(dict([_entry(profile)]), profile=profile)
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
    assert ResultsTable.load(path, fingerprint=profile.fingerprint).typed()  # the old table is intact


def test_an_unreadable_table_is_one_line_and_never_moved_aside(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root reads any file: a permission error cannot be planted")
    profile, path = _written_table(tmp_path)
    path.chmod(0)
    with pytest.raises(TableError, match="cannot read results table"):
        ResultsTable.load(path, fingerprint=profile.fingerprint)


# -- storage URLs ----------------------------------------------------------------------------------
def test_storage_urls_that_cannot_work_are_one_line(tmp_path, monkeypatch):
    with pytest.raises(StorageError, match="folder .* does not exist"):
        open_storage(f"sqlite:///{tmp_path}/missing/db.sqlite", results_dir=tmp_path)
    with pytest.raises(StorageError, match="is not a database URL"):
        open_storage("results.db", results_dir=tmp_path)
    import builtins

    real = builtins.__import__

    def no_psycopg(name, *args, **kwargs):
        if name == "psycopg":
            raise ImportError("planted: no psycopg")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_psycopg)
    with pytest.raises(
        StorageError, match=r"driver 'psycopg' is not installed; pip install 'attnbench\[postgres\]'"
    ):
        open_storage("postgresql://u:secret@127.0.0.1:1/db", results_dir=tmp_path)
    monkeypatch.setattr(builtins, "__import__", real)
    with pytest.raises(StorageError, match="cannot open the database") as err:
        open_storage("postgresql://u:secret@127.0.0.1:1/db", results_dir=tmp_path)
    assert "secret" not in str(err.value) and "\n" not in str(err.value)


def test_a_read_only_results_folder_is_one_line(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes anywhere: a read-only folder cannot be planted")
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    with pytest.raises(StorageError, match="cannot use the study journal"):
        open_storage(None, results_dir=folder)
