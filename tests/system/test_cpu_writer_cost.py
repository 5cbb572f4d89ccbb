"""scripts/cpu_writer_cost.py: a tiny run writes its report (its refusals: test_script_refusals.py)."""

from __future__ import annotations

import json
from pathlib import Path

from helpers.cpu_kernel import require_kernel
from helpers.script_module import load_script


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
