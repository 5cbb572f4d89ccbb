"""The pieces of ``select()`` on their own, over planted resolutions (no registry, no files): the
roofline heuristic, the calibrated choice beyond the tuned region, the Choice record, and the file
signatures the tuned index watches."""

from __future__ import annotations

from pathlib import Path

import pytest

from attnbench.core.resolution import Resolution
from attnbench.core.workload import Workload
from attnbench.cost.fit import Calibration, Fit
from attnbench.selection.choice import Choice, Rejected
from attnbench.selection.fitted import calibrated_choice
from attnbench.selection.heuristic import rank, runnable_reason
from attnbench.selection.tuned import file_signature

W = Workload.uniform("tiny-gqa", batch=2, context=1024, dtype="fp32")


def _res(name: str, per_token: int, **fields) -> tuple[str, Resolution, dict]:
    return name, Resolution(name, W, {}, kv_bytes_per_token=per_token, **fields), {}


def test_runnable_reason() -> None:
    assert runnable_reason(_res("a", 1)[1]) == ""
    assert "cannot run this workload: no" in runnable_reason(_res("a", 1, reasons=("no",))[1])
    assert "interpreted" in runnable_reason(_res("a", 1, interpreted=True)[1])


def test_the_heuristic_picks_the_fewest_kv_bytes_and_never_a_lossy_cache() -> None:
    ranking = rank(
        [
            _res("naive", 200),
            _res("small", 100),
            _res("fp8", 50, lossy="fp8"),
            _res("broken", 10, reasons=("x",)),
        ],
        failed_gate={},
        describe="tiny",
    )
    assert ranking.name == "small" and ranking.per_token == 100 and not ranking.tie
    why = {r.backend: r.reason for r in ranking.rejected}
    assert (
        why["naive"] == "reads 2.00× the KV bytes" and "lossy" in why["fp8"] and "cannot run" in why["broken"]
    )
    choice = ranking.choice(W, bandwidth=1e10)
    assert choice.source == "heuristic" and choice.backend == "small" and choice.estimate_ms > 0
    with pytest.raises(ValueError, match="bandwidth"):
        ranking.choice(W, bandwidth=0)


def test_the_heuristic_breaks_a_tie_by_the_default_order_and_refuses_when_none_can_run() -> None:
    tie = rank([_res("naive", 100), _res("flash", 100)], failed_gate={}, describe="tiny")
    assert tie.name == "flash" and tie.tie
    with pytest.raises(LookupError, match="no registered backend can run tiny: naive: failed"):
        rank([_res("naive", 100)], failed_gate={"naive": "failed"}, describe="tiny")


def test_the_calibrated_choice_is_the_lowest_predicted_step() -> None:
    def fit(name: str, s_per_byte: float) -> Fit:
        return Fit(name, "fp32", None, 1e-6, 0.0, s_per_byte, 6, 64.0, 0.01, 0.02)

    cal = Calibration(device={}, fits=[fit("slow", 1e-9), fit("fast", 1e-10)], points=[])
    resolutions = [(*_res(n, 100), "any") for n in ("slow", "fast", "unfitted")]
    choice = calibrated_choice(W, resolutions, calibration=cal, failed_gate={}, why_outside="beyond")
    assert isinstance(choice, Choice) and choice.backend == "fast" and choice.source == "calibrated"
    assert "outside the tuned region (beyond)" in choice.reason
    rejected = {r.backend: r for r in choice.rejected}
    assert rejected["slow"].step_ms is not None and rejected["slow"].step_ms > choice.estimate_ms
    assert "no calibrated model" in rejected["unfitted"].reason
    assert calibrated_choice(W, resolutions, calibration=None, failed_gate={}, why_outside="") is None


def test_a_choice_copies_for_another_workload_and_says_what_its_step_is() -> None:
    c = Choice("naive", {"a": 1}, "tuned", W, "planted", rejected=[Rejected("flash", "slower")], step_ms=1.5)
    assert c.step_basis == "measured"
    other = Workload.uniform("tiny-gqa", batch=1, context=64, dtype="fp32")
    copy = c.copy_for(other, step_ms=None)
    assert copy.workload == other and copy.backend == "naive" and copy.step_basis is None
    with pytest.raises(TypeError, match="no field 'nope'"):
        c.copy_for(other, nope=1)
    assert c.as_dict()["backend"] == "naive"


def test_file_signature_follows_a_files_changes(tmp_path: Path) -> None:
    path = tmp_path / "table.yaml"
    assert file_signature(path) is None
    path.write_text("a")
    first = file_signature(path)
    assert first is not None and first[1] == 1
    path.write_text("abc")
    assert file_signature(path, was=first) != first
    path.unlink()
    assert file_signature(path, was=first) is None
