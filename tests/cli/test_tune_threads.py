"""`attnbench tune --threads N`: the parent's fingerprint and every worker's torch use N threads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from attnbench.backends.naive import NaiveBackend
from attnbench.cli import main


class ThreadsReportingNaive(NaiveBackend):
    """naive, whose implementation() names the torch thread count of the process that asks."""

    name = "threads_reporting_naive"

    def implementation(self, workload: object) -> str:
        return f"torch.matmul[threads={torch.get_num_threads()}]"


@pytest.mark.parametrize("threads", [1, 2])
def test_tune_threads_reach_the_worker(
    threads: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from attnbench.tuning import tune

    before = torch.get_num_threads()
    try:
        assert main(["tune", "--model", "tiny-gqa", "--batch", "1", "--context", "32", "--dtype", "fp32",
                     "--backends", "naive", "--repeats", "2", "--warmup", "1", "--threads", str(threads),
                     "--results", str(tmp_path / "cli"), "--json"]) == 0  # fmt: skip
        report = json.loads(capsys.readouterr().out)
        assert f"threads: {threads}" in Path(report["table"]).read_text()  # the table's fingerprint
        torch.set_num_threads(threads)  # what `--threads` does in the parent, then the tuner's workers
        result = tune(
            [__import__("attnbench").Workload.uniform("tiny-gqa", batch=1, context=32, dtype="fp32")],
            backends=["naive", ThreadsReportingNaive.name],
            extra_backends=[ThreadsReportingNaive],
            results_dir=tmp_path / "api",
        )
    finally:
        torch.set_num_threads(before)
    (entry,) = result.entries.values()
    (cand,) = [c for c in entry["candidates"] if c["backend"] == ThreadsReportingNaive.name]
    assert cand["implementation"] == f"torch.matmul[threads={threads}]"  # asked in the worker


def test_tune_threads_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tune", "--model", "tiny-gqa", "--threads", "0"]) != 0
    assert "--threads 0 must be ≥ 1" in capsys.readouterr().err
