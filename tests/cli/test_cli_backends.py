"""`attnbench backends` as a user runs it (subprocess, real entry point)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "attnbench", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=120,
    )


def test_backends_json_lists_naive_and_flash_runnable_on_cpu() -> None:
    proc = _run("backends", "--model", "llama-3.1-8b", "--batch", "1", "--context", "4096", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = {r["name"]: r for r in json.loads(proc.stdout)["backends"]}
    assert rows["naive"]["runnable"] and rows["naive"]["implementation"] == "torch.matmul"
    assert rows["flash"]["runnable"] and rows["flash"]["implementation"] == "torch.sdpa[flash]"
    assert rows["naive"]["source"] == "built-in"


def test_backends_explains_refusal() -> None:
    proc = _run("backends", "--model", "tiny-mla", "--json")
    rows = {r["name"]: r for r in json.loads(proc.stdout)["backends"]}
    assert not rows["flash"]["runnable"]
    assert any("head_dim" in r for r in rows["flash"]["reasons"])


def test_bad_arguments_are_one_line_errors() -> None:
    proc = _run("backends", "--model", "tiny-gqa", "--dtype", "int3")
    assert proc.returncode == 2 and "int3" in proc.stderr and "bf16" in proc.stderr
    proc = _run("backends", "--model", "tiny-gqa", "--context", "lots")
    assert proc.returncode == 2 and "--context 'lots'" in proc.stderr


def test_help_explains() -> None:
    proc = _run("--help")
    assert proc.returncode == 0 and "backends" in proc.stdout and "float64" in proc.stdout
