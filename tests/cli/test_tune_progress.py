"""``attnbench tune`` in a log: a line per finished study when stdout is not a terminal, and
``--profile``'s split of the wall time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ARGS = ["tune", "--model", "tiny-gqa", "--batch", "1", "--context", "32,64", "--dtype", "fp32",
        "--backends", "naive", "--repeats", "3", "--samples", "3"]  # fmt: skip


def _tune(results: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """``attnbench tune`` with ``ARGS`` and ``flags`` in a child process; it must succeed."""
    proc = subprocess.run(
        [sys.executable, "-m", "attnbench", *ARGS, "--results", str(results), *flags],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_a_log_gets_a_line_per_study_and_the_profile_its_table(tmp_path: Path) -> None:
    proc = _tune(tmp_path, "--profile")
    lines = proc.stdout.splitlines()
    studies = [x for x in lines if x.startswith(("[1/2] ", "[2/2] "))]
    assert len(studies) == 2, proc.stdout[-3000:]  # a pipe: no bar drawn, a line per key instead
    assert all("naive" in x and " ms " in x and "trials" in x for x in studies), studies
    # and a line as each study ends, before the finalists' re-timing that follows all studies
    ended = [i for i, x in enumerate(lines) if x.startswith(("study 1/2 done: ", "study 2/2 done: "))]
    assert len(ended) == 2 and max(ended) < lines.index(studies[0]), proc.stdout[-3000:]
    assert all("trials (" in lines[i] and "pruned" in lines[i] for i in ended), proc.stdout[-3000:]
    assert any("where the time went" in x for x in lines), proc.stdout[-3000:]
    for phase in ("gate", "samples", "bookkeeping", "worker start-up"):  # a row of the table each
        assert any(x.strip("│ ").startswith(phase + " ") for x in lines), (phase, proc.stdout[-3000:])


def test_json_carries_the_time_split(tmp_path: Path) -> None:
    proc = _tune(tmp_path, "--json")
    profile = json.loads(proc.stdout)["profile"]
    assert profile["wall_s"] > 0 and sum(profile["phases"].values()) <= profile["wall_s"] + 0.05
    assert profile["by_backend"]["naive"]["gate"] > 0
