"""scripts/cpu_writer_cost.py: bad input is refused in one line; a tiny run writes its report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.cpu_kernel import require_kernel
from helpers.script_module import load_script, refusal


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--batch", "8"], "--batch '8': at least two different batches"),
        (["--batch", "8,8"], "--batch '8,8': at least two different batches"),
        (["--batch", "0,8"], "--batch '0' must be > 0"),
        (["--batch", "1,x"], "--batch 'x' is not a token count"),
        (["--rounds", "0"], "argument --rounds: 0: must be a whole number ≥ 1"),
        (["--calls", "1.5"], "argument --calls: '1.5': must be a whole number ≥ 1"),
    ],
)
def test_bad_input_names_the_option_and_what_is_accepted(argv: list[str], message: str) -> None:
    assert message in refusal("cpu_writer_cost", argv)


def test_a_tiny_run_reports_each_cache_per_call_and_per_token(tmp_path: Path) -> None:
    kernel = require_kernel()
    out = tmp_path / "writer"
    assert (
        load_script("cpu_writer_cost").main(
            ["--batch", "1,2", "--calls", "3", "--rounds", "1", "--out", str(out)]
        )
        == 0
    )
    report = json.loads(out.with_suffix(".json").read_text())
    caches = [row["cache"] for row in report["rows"]]
    assert caches == ["cpu_decode (bf16)", "cpu_decode_fp8"][: 1 + (kernel.fp8_level >= 1)]
    for row in report["rows"]:
        assert set(row["us_per_call"]) == {"1", "2"} and all(t > 0 for t in row["us_per_call"].values())
    assert report["command"].startswith("python scripts/cpu_writer_cost.py --batch 1,2")
    assert "| cpu_decode (bf16) |" in out.with_suffix(".md").read_text()
