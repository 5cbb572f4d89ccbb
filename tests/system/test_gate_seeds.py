"""scripts/gate_seeds.py: a tiny run reports each cell's failures, worst share of the bound and the
multiple its worst seed needs (its refusals: test_script_refusals.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.script_module import load_script

from attnbench.core.backend import Tolerance
from attnbench.correctness.gate import CheckResult
from attnbench.correctness.reference import ErrorStats


def test_a_tiny_run_writes_its_report(tmp_path: Path) -> None:
    out = tmp_path / "seeds"
    argv = ["--backend", "naive", "--seeds", "2", "--long-seeds", "0", "--dtypes", "fp32", "--cases", "mha"]
    assert load_script("gate_seeds").main([*argv, "--single", "--out", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    (cell,) = report["cells"]
    assert (cell["case"], cell["dtype"], cell["seeds"], cell["fails"], cell["single"]) == (
        "mha",
        "fp32",
        2,
        0,
        True,
    )
    assert 0 < cell["worst_share"] <= 1 and cell["multiple"] == 2.0
    assert cell["needed_multiple"] <= 2.0 and cell["multiple_for_0.8"] > cell["needed_multiple"]
    assert report["command"].startswith("python scripts/gate_seeds.py --backend naive --seeds 2")
    assert "| fp32 | mha |" in out.with_suffix(".md").read_text()


def test_the_needed_multiple_puts_the_worst_metric_at_the_share_asked() -> None:
    """Bounds are ``multiple × calibration + floor``: a max_abs error of 5 against a calibration of 1,
    a floor of 1 (×2 bound 3), needs ×4 to pass and ×5.25 to stay at 0.8 of its bound."""
    needed = load_script("gate_seeds").needed_multiple
    r = CheckResult(
        backend="b",
        config={},
        workload="w",
        seed=1,
        error=ErrorStats(5.0, 1e-9, 1.0, 0, 4),
        tolerance=Tolerance(max_abs=3.0, rel_l2=1.0, min_cosine=0.5),
        failures=["max_abs 5 > 3"],
        calibration=ErrorStats(1.0, 1e-9, 1.0, 0, 4),
        multiple=2.0,
    )
    assert needed(r, 1.0) == pytest.approx(4.0) and needed(r, 0.8) == pytest.approx(5.25)
