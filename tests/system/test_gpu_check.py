"""scripts/gpu_check.py: a clear refusal without CUDA, and the whole pipeline on tiny CPU shapes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.script_module import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"


def _load_script():
    return load_script("gpu_check")


#: what the GPU machine lacks: a ``sitecustomize`` that makes these imports fail in the child process
_ABSENT = ("optuna", "flash_attn", "vllm", "flashinfer", "psycopg", "psycopg2", "sqlalchemy", "alembic")
_BLOCKER = f"""import sys
class _Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {_ABSENT!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (absent on the GPU machine)")
sys.meta_path.insert(0, _Absent())
"""


def _absent_env(folder: Path) -> dict[str, str]:
    """The environment of a child process in which none of :data:`_ABSENT` imports (``folder`` holds
    the ``sitecustomize``)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(_BLOCKER)
    path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def _run(*args: str, timeout: float = 600, absent: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run the script; with ``absent`` (a folder), as on the GPU machine: none of :data:`_ABSENT`."""
    env = {**os.environ} if absent is None else _absent_env(absent)
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_exits_with_a_clear_message(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    proc = _run("--out", str(out))
    assert proc.returncode == 2, proc.stderr
    assert "no CUDA device" in proc.stderr and "Nothing was measured" in proc.stderr
    assert not out.exists()


def test_help_explains_the_check() -> None:
    proc = _run("--help", timeout=120)
    assert proc.returncode == 0
    assert "--budget-s" in proc.stdout and "correctness" in proc.stdout.lower()


def test_pipeline_on_tiny_cpu_shapes(tmp_path: Path) -> None:
    """--device cpu exists only for this test: checks, times (naive), skips timing of interpreted Triton.
    It runs as on the GPU machine, where Optuna, flash-attn, vLLM, FlashInfer and the database
    drivers are not installed (a ``sitecustomize`` makes importing them fail)."""
    out = tmp_path / "check.json"
    proc = _run(
        "--device", "cpu", "--model", "tiny-gqa", "--batches", "1,2", "--contexts", "40",
        "--backends", "naive,triton_paged", "--layers", "2", "--repeats", "3", "--default-configs-only",
        "--out", str(out), absent=tmp_path / "absent",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["command"].startswith("python scripts/gpu_check.py --device cpu")
    assert report["device"]["fingerprint"]["kind"] == "cpu" and report["device"]["copy_bandwidth"] > 0
    checked = {e["backend"]: e for e in report["correctness"]}
    assert checked["naive"]["passed"]
    triton_on_cpu = checked["triton_paged"].get("runnable", True)  # only in the interpreter (no CUDA here)
    assert triton_on_cpu == (not torch.cuda.is_available())
    if triton_on_cpu:
        assert checked["triton_paged"]["passed"] and checked["triton_paged"]["interpreted"]
    else:
        assert "TRITON_INTERPRET" in " ".join(checked["triton_paged"]["reasons"])
    by = {(m["backend"], m["batch"]): m for m in report["measurements"]}
    assert set(by) == {("naive", 1), ("naive", 2)} | (
        {("triton_paged", 1), ("triton_paged", 2)} if triton_on_cpu else set()
    )
    for b in (1, 2):
        naive = by["naive", b]
        assert naive["timed"] and naive["step"]["median_s"] > 0 and naive["gbps"] > 0
        assert naive["pct_of_bandwidth"] > 0 and len(naive["load_avg"]) == 3
        assert naive["check"]["passed"]
        if triton_on_cpu:  # interpreted: checked, never timed
            assert not by["triton_paged", b]["timed"] and "interpreted" in by["triton_paged", b]["note"]
    assert "decode step" in proc.stdout and "correctness" in proc.stdout


def test_target_summary() -> None:
    gc = _load_script()

    def m(batch: int, context: int, pct: float) -> dict:
        return {
            "backend": "triton_paged",
            "batch": batch,
            "context": context,
            "timed": True,
            "pct_of_bandwidth": pct,
        }

    assert gc.target_summary([])["met"] is None
    small = m(1, 1024, 10.0)  # below 256k tokens: not part of the target
    assert gc.target_summary([small, m(8, 32768, 85.0), m(32, 8192, 81.0)])["met"] is True
    res = gc.target_summary([m(32, 32768, 79.9), m(8, 32768, 90.0)])
    assert res["met"] is False and "NOT met" in res["text"] and "b32×32k: 79.9%" in res["text"]


def test_the_absent_modules_are_absent_in_the_child(tmp_path: Path) -> None:
    """The blocker of the pipeline test works: the child cannot import Optuna (it is installed here)."""
    env = _absent_env(tmp_path / "absent")
    code = "import optuna"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode != 0 and "absent on the GPU machine" in proc.stderr
    ok = subprocess.run(
        [sys.executable, "-c", "import attnbench, attnbench.tables.table; attnbench.select"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr[-2000:]
