"""The tuner's modules on their own (no worker runs a candidate): the search space, the study plan,
storage helpers, summaries, and ``tune()``'s bookkeeping around an empty plan."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.tuning_helpers import stated_profile

from attnbench.core.locations import REFERENCE_MARKER, ResultsLocationError
from attnbench.core.workload import Workload
from attnbench.tables.table_schema import DEFAULT_BACKENDS, Candidate
from attnbench.tuning.space import backend_refs, build_space
from attnbench.tuning.storage import JOURNAL_NAME, redact, repair_journal
from attnbench.tuning.study import TuneOptions, plan_studies
from attnbench.tuning.summary import candidate_label
from attnbench.tuning.tuner import TuneReport, tune

W = Workload.uniform("tiny-gqa", batch=3, context=100, dtype="fp32")


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


def test_tune_with_nothing_to_tune_writes_nothing_and_refuses_a_reference_folder(tmp_path: Path) -> None:
    report = tune([], results_dir=tmp_path, profile=stated_profile(), samples=0)
    assert isinstance(report, TuneReport) and report.results == [] and report.trials_run == 0
    assert report.table_path.parent == tmp_path and report.storage == str(tmp_path / JOURNAL_NAME)
    assert not report.table_path.exists()
    (tmp_path / REFERENCE_MARKER).write_text("committed runs\n")
    with pytest.raises(ResultsLocationError, match=REFERENCE_MARKER):
        tune([], results_dir=tmp_path, profile=stated_profile(), samples=0)
