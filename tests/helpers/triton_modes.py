"""Triton's import modes for the tests: code run where the interpreter is off, as on a machine without it."""

from __future__ import annotations

import os
import subprocess
import sys


def run_uninterpreted(code: str) -> list[str]:
    """``code`` run by a fresh Python with ``TRITON_INTERPRET=0``; asserts it exits 0 and returns the
    lines it printed."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()
