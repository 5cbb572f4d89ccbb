"""``select()`` answering from a tuned table imports neither the autotuner nor Optuna: the tuned map
(``attnbench.tables``) is all it reads. Checked in a fresh process, from ``sys.modules``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from helpers.tuning_helpers import planted_entry, save_table, stated_profile

from attnbench.core.workload import Workload

CODE = """
import json, sys
import attnbench
from attnbench.core.workload import Workload
choice = attnbench.select(Workload.uniform("tiny-gqa", batch=1, context=64), results_dir=sys.argv[1], bandwidth=2e10)
loaded = sorted(m for m in sys.modules if m == "optuna" or m.startswith(("optuna.", "attnbench.tuning")))
print(json.dumps({"source": choice.source, "backend": choice.backend, "loaded": loaded}))
"""


def test_select_from_a_tuned_table_loads_no_optuna_and_no_tuner(tmp_path: Path) -> None:
    profile = stated_profile()
    row, entry = planted_entry(
        Workload.uniform("tiny-gqa", batch=1, context=64), flash=4e-3, naive=1e-3, profile=profile
    )
    save_table(tmp_path, {row: entry}, profile=profile)
    proc = subprocess.run(
        [sys.executable, "-c", CODE, str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["source"] == "tuned" and got["backend"] == "naive", got  # it read the planted table
    assert got["loaded"] == [], got["loaded"]
