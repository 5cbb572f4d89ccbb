"""scripts/aot_before_after.py refuses a --before that is not a commit, in one line, before compiling."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "aot_before_after.py"


def test_a_bad_before_commit_is_named() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--before", "nosuchcommit"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert "--before 'nosuchcommit': not a commit of this repository" in proc.stderr
    assert "Traceback" not in proc.stderr
