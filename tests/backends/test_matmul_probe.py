"""The contiguous-matmul probe that `attnbench bench --probe` adds: correct, unregistered, one row."""

from __future__ import annotations

import json

import pytest
import torch

from attnbench import Workload, check, load_registry
from attnbench.backends.matmul_probe import MatmulProbeBackend
from attnbench.cli import main
from attnbench.testing import CASES, run_case


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_probe_passes_the_gate_and_the_ragged_case(dtype: str) -> None:
    run_case(MatmulProbeBackend(), CASES[1], dtype=dtype)  # GQA, ragged prefill then decode
    w = Workload(
        CASES[1].shape, CASES[1].gate_lens, getattr(torch, {"fp32": "float32"}.get(dtype, "bfloat16"))
    )
    result = check(MatmulProbeBackend(), w)
    assert result.passed, result.summary()


def test_probe_is_not_a_tuning_candidate() -> None:
    assert "matmul_probe" not in load_registry().names()


def test_bench_probe_adds_one_row(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "--model", "tiny-gqa", "--batch", "1", "--context", "64", "--dtype", "fp32"]
    argv += ["--backends", "naive", "--probe", "--repeats", "2", "--warmup", "1", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {r["backend"]: r for r in report["results"]}
    assert set(rows) == {"naive", "matmul_probe"}
    assert rows["matmul_probe"]["status"] == "timed" and rows["matmul_probe"]["gbps"] > 0
    assert report["command"].endswith("--probe")
