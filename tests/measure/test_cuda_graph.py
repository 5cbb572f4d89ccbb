"""Timing decode steps the way they are served: eager, or one replayed CUDA graph per step (CUDA only).

On the CPU: the mode's selection (eager by default, ``--timing graph`` refused in one line by ``bench``
and ``tune``), and a CPU measurement that is eager only. On CUDA: a capturable backend is timed both
ways and ranked by graph replay, a non-capturable one eagerly.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # as tests/conftest.py: the interpreter, chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from attnbench.backends.naive import NaiveBackend
from attnbench.backends.triton_paged import TritonPagedBackend
from attnbench.cli import main
from attnbench.core.timing import TIMING_MODES, timing_mode
from attnbench.core.workload import Workload
from attnbench.measure.bench import measure_decode
from attnbench.measure.graph_step import GraphedDecodeStep
from attnbench.measure.synthetic import SyntheticModel


def test_timing_mode_defaults_and_refusals() -> None:
    assert TIMING_MODES == ("eager", "graph")
    assert timing_mode(None, "cpu") == "eager" and timing_mode("eager", "cpu") == "eager"
    assert timing_mode(None, "cuda") == "graph" and timing_mode("eager", "cuda") == "eager"
    with pytest.raises(ValueError, match=r"--timing = 'graph' needs a CUDA device .*use --timing eager"):
        timing_mode("graph", "cpu")
    with pytest.raises(ValueError, match=r"--timing = 'fast' not in \('eager', 'graph'\)"):
        timing_mode("fast", "cuda")


@pytest.mark.parametrize("command", ["bench", "tune"])
@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_graph_timing_on_cpu_is_one_clear_line(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [command, "--model", "tiny-gqa", "--batch", "1", "--context", "32", "--timing", "graph"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "--timing = 'graph' needs a CUDA device" in err and "Traceback" not in err
    assert len(err.splitlines()) == 1, err


def test_cpu_measurement_is_eager_only() -> None:
    w = Workload.uniform("tiny-gqa", batch=2, context=32, dtype="fp32")
    m = measure_decode(NaiveBackend(), w, warmup=1, repeats=2, check=False)
    assert m.timing == "eager" and m.graph_step is None and m.eager_step is m.step
    d = m.as_dict()
    assert d["timing"] == "eager" and d["graph_step"] is None and d["eager_step"] == d["step"]


def test_graph_steps_need_a_capturable_cache_on_cuda() -> None:
    w = Workload.uniform("tiny-gqa", batch=1, context=16, dtype="fp32")
    model = SyntheticModel(NaiveBackend(), w, num_layers=2)
    model.fill(extra_tokens=2)
    assert model.cache is not None and not model.cache.capturable
    with pytest.raises(ValueError, match="not capturable"):
        GraphedDecodeStep(model)
    paged = SyntheticModel(TritonPagedBackend(), w, num_layers=2)
    paged.fill(extra_tokens=2)
    assert paged.cache is not None and paged.cache.capturable
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
            GraphedDecodeStep(paged)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: graph capture and replay")
def test_cuda_times_both_modes_and_ranks_by_graph_replay() -> None:
    w = Workload.uniform("tiny-gqa", batch=2, context=200, dtype="bf16", device="cuda")
    m = measure_decode(TritonPagedBackend(), w, warmup=2, repeats=5)
    assert m.timing == "graph" and m.step is m.graph_step
    assert m.eager_step is not None and m.eager_step.median_s > 0 and m.graph_step.median_s > 0
    eager = measure_decode(TritonPagedBackend(), w, warmup=2, repeats=5, timing="eager")
    assert eager.timing == "eager" and eager.step is eager.eager_step and eager.graph_step is not None
    naive = measure_decode(NaiveBackend(), w, warmup=2, repeats=5)
    assert naive.timing == "eager" and naive.graph_step is None and "not capturable" in naive.note
