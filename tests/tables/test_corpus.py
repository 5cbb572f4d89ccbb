"""The shipped corpus: a device with no table of its own gets the tuned answer of a known device of the
same hardware id, marked as not measured here; its own table, once tuned, wins; ``ATTNBENCH_CORPUS=off``
and a device of another hardware id get nothing from it."""

from __future__ import annotations

import pytest
from helpers.tuning_helpers import planted_entry, save_table, stated_profile

from attnbench.core.workload import Workload
from attnbench.selection.select import Selector
from attnbench.tables import ResultsTable, corpus
from attnbench.tables.dispatch import load_maps


@pytest.fixture
def planted_corpus(tmp_path, monkeypatch):
    """A corpus holding one table of this device (naive measured fastest) and an empty results folder."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    p = stated_profile()
    w = Workload.uniform("tiny-gqa", batch=1, context=1024)
    save_table(folder, dict([planted_entry(w, flash=3e-3, naive=1e-3, profile=p)]), profile=p)
    monkeypatch.setattr(corpus, "CORPUS_DIR", folder)
    monkeypatch.delenv(corpus.CORPUS_ENV, raising=False)
    results = tmp_path / "results"
    results.mkdir()
    return results, p


def test_no_table_here_the_corpus_answers_and_says_so(planted_corpus) -> None:
    results, _ = planted_corpus
    choice = Selector().select(model="tiny-gqa", batch=1, context=1024, dtype="bf16", results_dir=results)
    assert choice.source == "tuned" and choice.backend == "naive"
    assert choice.corpus.startswith("AMD") or choice.corpus  # the device in words
    assert "source: corpus (" in choice.explain() and "not measured here" in choice.explain()
    assert choice.as_dict()["corpus"] == choice.corpus


def test_switched_off_the_corpus_is_not_read(planted_corpus, monkeypatch) -> None:
    results, _ = planted_corpus
    sel = Selector()
    assert sel.select(model="tiny-gqa", batch=1, context=1024, results_dir=results).corpus
    monkeypatch.setenv(corpus.CORPUS_ENV, "off")
    choice = sel.select(model="tiny-gqa", batch=1, context=1024, results_dir=results)
    assert choice.corpus == "" and choice.source == "heuristic"


def test_this_devices_own_table_wins_once_tuned(planted_corpus) -> None:
    results, p = planted_corpus
    sel = Selector()
    assert sel.select(model="tiny-gqa", batch=1, context=1024, results_dir=results).backend == "naive"
    w = Workload.uniform("tiny-gqa", batch=1, context=1024)
    save_table(results, dict([planted_entry(w, flash=1e-3, naive=3e-3, profile=p)]), profile=p)
    choice = sel.select(model="tiny-gqa", batch=1, context=1024, results_dir=results)
    assert choice.backend == "flash" and choice.corpus == ""


def test_another_hardware_id_gets_nothing(tmp_path, monkeypatch) -> None:
    folder = tmp_path / "corpus"
    folder.mkdir()
    other = stated_profile(threads=999)  # another thread count: another hardware id
    w = Workload.uniform("tiny-gqa", batch=1, context=1024)
    save_table(folder, dict([planted_entry(w, flash=3e-3, naive=1e-3, profile=other)]), profile=other)
    monkeypatch.setattr(corpus, "CORPUS_DIR", folder)
    assert len(corpus.corpus_entries(folder)) == 1
    choice = Selector().select(model="tiny-gqa", batch=1, context=1024, results_dir=tmp_path)
    assert choice.corpus == "" and choice.source == "heuristic"


def test_the_shipped_entries_read_as_select_reads_them() -> None:
    entries = corpus.corpus_entries(corpus.CORPUS_DIR)
    assert entries, "the package ships a corpus"
    assert len({e.hardware_id for e in entries}) == len(entries)  # one entry per device kind
    for e in entries:
        table = ResultsTable.load(e.table, fingerprint=e.fingerprint)  # refuses another device's
        assert table.typed() and e.updated and e.fingerprint.get("torch")
        if e.map.exists():
            assert load_maps(e.map, hardware_id=e.hardware_id)


def test_a_bad_setting_is_refused_naming_it(planted_corpus, monkeypatch) -> None:
    results, _ = planted_corpus
    monkeypatch.setenv(corpus.CORPUS_ENV, "of")
    with pytest.raises(ValueError, match=r"ATTNBENCH_CORPUS = 'of' is not a setting \(accepted: off"):
        Selector().select(model="tiny-gqa", batch=1, context=1024, results_dir=results)
    assert corpus.corpus_enabled({corpus.CORPUS_ENV: "ON"}) and not corpus.corpus_enabled(
        {corpus.CORPUS_ENV: "0"}
    )
