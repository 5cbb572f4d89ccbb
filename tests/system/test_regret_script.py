"""scripts/regret.py: a saved run is rendered again from its measured times, with the medians alone beside
the regret (what the regret's interval rule counts as a tie is there in figures)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.script_module import load_script, refusal


def _row(where: str, selected: float, best: float, regret: float) -> dict:
    times = {
        "chosen": {"median_ms": selected, "lo_ms": selected * 0.9, "hi_ms": selected * 1.1, "samples": 15},
        "fastest": {"median_ms": best, "lo_ms": best * 0.9, "hi_ms": best * 1.1, "samples": 15},
    }
    return {
        "workload": f"w {where}",
        "where": where,
        "times": times,
        "timed_candidates": 2,
        "best": "fastest",
        "selected": "chosen",
        "map_lookup": "chosen",
        "source": "tuned",
        "regret": regret,
        "speedup_vs_default": 2.0,
    }


def test_a_saved_run_is_rendered_again_with_the_medians_alone(tmp_path: Path) -> None:
    regret = load_script("regret")
    # a tie by the intervals (regret 1.0) whose medians are 8 % apart, and an exact pick
    rows = [_row("tuned", 1.08, 1.0, 1.0), _row("between", 2.0, 2.0, 1.0)]
    saved = {
        "command": "python scripts/regret.py --exhaustive",
        "date": "2026-12-06T12:00:00+00:00",
        "machine": {"host": "h", "cpus": 2, "platform": "Linux"},
        "device": {"fingerprint": {"name": "cpu"}},
        "load_avg_start": [0.5, 0.5, 0.5],
        "load_avg_end": [1.0, 1.0, 1.0],
        "points": rows,
        "summary": regret.summarize(rows, used=10, dense=100, targets=regret.EXHAUSTIVE_TARGETS),
    }
    path = tmp_path / "run.json"
    path.write_text(json.dumps(saved))
    assert regret.main(["--render", str(path)]) == 0
    s = json.loads(path.read_text())["summary"]
    assert s["regret_max"] == 1.0 and s["meets_targets"]
    assert abs(s["median_ratio_max"] - 1.08) < 1e-9 and s["median_ratio_median"] > 1.0
    md = path.with_suffix(".md").read_text()
    assert "by the medians alone (no interval rule): median 1.040, p90" in md and "max 1.080" in md
    assert "| 1.000 | 1.080 | 2.000 | 2 |" in md  # the row: regret, medians, × vs default, candidates


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (None, "cannot be read"),
        ("{not json", "is not JSON"),
        ('{"a": 1}', "holds no saved run (no points, summary)"),
    ],
)
def test_render_refuses_what_is_not_a_saved_run_in_one_line(tmp_path: Path, content, why) -> None:
    path = tmp_path / "run.json"
    if content is not None:
        path.write_text(content)
    message = refusal("regret", ["--render", str(path)])
    assert f"--render {path}: {why}" in message and "expected a JSON file this script wrote" in message
