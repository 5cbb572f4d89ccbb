"""scripts/validate_generation.py: a fresh calibration predicts the rows of an e2e report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.script_module import load_script, refusal

from attnbench.cli import main

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")


def test_predicts_every_row_of_a_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save = tmp_path / "run"
    argv = ["e2e", "--model", "tiny-qwen2", "--prompt", "24", "--new-tokens", "4", "--dtype", "fp32",
            "--threads", "1", "--paths", "sdpa,cpu_decode", "--save", str(save)]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(save.with_suffix(".json").read_text())
    assert report["calibration"]["format"] == 1  # what the run's own predictions came from
    capsys.readouterr()
    out = tmp_path / "check"
    assert (
        load_script("validate_generation").main(
            ["--runs", str(save.with_suffix(".json")), "--out", str(out), "--max-seconds", "2"]
        )
        == 0
    )
    rec = json.loads(out.with_suffix(".json").read_text())
    assert [(r["path"], r["prompt_len"]) for r in rec["rows"]] == [("sdpa", 24), ("cpu_decode", 24)]
    for r in rec["rows"]:
        assert r["ttft_pred_s"] > 0 and r["itl_pred_s"] > 0
        assert r["itl_err"] == pytest.approx(r["itl_pred_s"] / r["itl_p50_s"] - 1)
    s = rec["summary"]
    assert s["figures"] == 4 and s["within"] == sum(
        abs(r[k]) <= 0.15 for r in rec["rows"] for k in ("ttft_err", "itl_err")
    )
    assert "Within ±15%" in out.with_suffix(".md").read_text()


def test_refuses_bad_input(tmp_path: Path) -> None:
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    argv = ["--runs", str(bad), "--out", str(tmp_path / "o")]
    with pytest.raises(SystemExit, match="is not an `attnbench e2e` report"):
        load_script("validate_generation").main(argv)
    with pytest.raises(SystemExit, match="does not exist; accepted"):
        load_script("validate_generation").main(
            ["--runs", str(tmp_path / "missing.json"), "--out", str(tmp_path / "o")]
        )
    assert "--threads 0 must be ≥ 1" in refusal("validate_generation", [*argv, "--threads", "0"])
    assert "--max-seconds 0.0 must be > 0" in refusal("validate_generation", [*argv, "--max-seconds", "0"])
