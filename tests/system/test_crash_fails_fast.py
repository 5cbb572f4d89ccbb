"""A test that crashes its process, or hangs, fails ``scripts/test.sh`` at once with its name.

The run is the README's test command itself (two pytest-xdist workers, as CI runs it) on a planted test
file: a segfault (a read of address 0, as a kernel's bad pointer would make) and, with the per-test
timeout lowered to a few seconds, a test that never returns. Either ends the run in seconds, failing,
naming the test, with no worker started again on the same file.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PLANTED = """
import ctypes
import time


def test_passes():
    pass


def test_{name}():
    {body}
"""


def _run(tmp_path: Path, name: str, body: str, *extra: str) -> tuple[subprocess.CompletedProcess[str], float]:
    path = tmp_path / f"test_planted_{name}.py"
    path.write_text(PLANTED.format(name=name, body=body))
    env = os.environ | {"ATTNBENCH_TEST_WORKERS": "2"}
    started = time.monotonic()
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "test.sh"), str(path), "-p", "no:cacheprovider", *extra],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return proc, time.monotonic() - started


@pytest.mark.slow
def test_a_segfaulting_test_fails_the_run_with_its_name(tmp_path: Path) -> None:
    proc, took = _run(tmp_path, "segfaults", "ctypes.string_at(0)")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "crashed while running" in out and "test_planted_segfaults.py::test_segfaults" in out, out
    # one worker crashed, once (the summary repeats its line, in full where CI is set): none replaced it
    crashed = set(re.findall(r"worker '(gw\d+)' crashed while running", out))
    assert len(crashed) == 1, f"the crashed worker was replaced and the file run again: {sorted(crashed)}"
    assert took < 300, f"took {took:.0f} s"


@pytest.mark.slow
def test_a_hanging_test_fails_the_run_at_the_timeout_with_its_name(tmp_path: Path) -> None:
    proc, took = _run(tmp_path, "hangs", "time.sleep(3600)", "--timeout", "5")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "test_planted_hangs.py::test_hangs" in out, out
    assert took < 300, f"took {took:.0f} s"
