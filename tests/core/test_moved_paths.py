"""Modules that moved into the concept subpackages keep their old import paths, with a warning.

``attnbench.core.moved.MOVED`` lists them; each old path must give the very module at its new place
and a ``DeprecationWarning`` that names the new path (checked in a fresh interpreter, so that no other
test has imported the old name first).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from attnbench.core.moved import MOVED

_PROBE = """
import importlib, json, warnings
import attnbench
from attnbench.core.moved import MOVED
out = {}
for old, new in MOVED.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module("attnbench." + old)
    target = importlib.import_module("attnbench." + new)
    out[old] = {
        "same": module is target,
        "spec": target.__spec__.name,
        "warned": [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)],
    }
from attnbench.kvcache import ContiguousBackend
import attnbench.selection.select
out["_select_is_function"] = callable(attnbench.select) and not hasattr(attnbench.select, "__path__")
out["_contiguous"] = ContiguousBackend.__module__
print(json.dumps(out))
"""


def test_every_old_path_imports_the_moved_module_and_warns() -> None:
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for old, new in MOVED.items():
        answer = got[old]
        assert answer["same"], f"attnbench.{old} is not attnbench.{new}"
        assert answer["spec"] == f"attnbench.{new}", f"the old path renamed the module: {answer['spec']}"
        assert any(f"attnbench.{new}" in m for m in answer["warned"]), f"no DeprecationWarning for {old}"
    assert got["_contiguous"] == "attnbench.core.kvcache"
    assert got["_select_is_function"], "attnbench.select must stay the function"


def test_no_old_path_is_still_a_file() -> None:
    import attnbench

    root = attnbench.__path__[0]
    left = [old for old in MOVED if os.path.exists(os.path.join(root, old + ".py"))]
    assert not left, f"moved modules still on disk at the old place: {left}"
