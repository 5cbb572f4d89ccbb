"""Test-wide setup. Triton kernels run through the interpreter on CPU-only machines: the variable
must be set before triton is first imported, so it is set here, before any test module loads."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest_plugins = ["pytester"]


@pytest.fixture(scope="module")
def one_thread():  # type: ignore[no-untyped-def]
    """Tiny matrices: one torch thread is many times faster than several contending for busy cores
    (``pytestmark = pytest.mark.usefixtures("one_thread")`` in a module of tiny-model tests)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def profile():  # type: ignore[no-untyped-def]
    """This machine's device profile with a stated read bandwidth of 10 GB/s (tests never measure it)."""
    from helpers.tuning_helpers import stated_profile  # imports attnbench: after TRITON_INTERPRET is set

    return stated_profile(1e10)


@pytest.fixture
def cli_json(capsys: pytest.CaptureFixture[str]) -> Callable[..., Any]:
    """``cli_json("decode", "--model", ...)`` runs ``attnbench ... --json`` in this process, asserts
    that it exits 0 and returns the JSON document it printed."""
    from attnbench.cli import main  # not at import time: TRITON_INTERPRET is set first

    def run(*argv: str) -> Any:
        assert main([*argv, "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    return run


@pytest.fixture(autouse=True)
def _torch_threads_restored():  # type: ignore[no-untyped-def]
    """A test that runs the CLI in this process with ``--threads`` (``main([...])`` sets torch's
    thread count, as the command does in its own process) leaves the count as it found it: a CPU
    fingerprint records the threads, so a later test's tuned table would belong to another device."""
    before = torch.get_num_threads()
    yield
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)


@pytest.fixture(autouse=True, scope="session")
def _private_results_location(tmp_path_factory):
    """Tests never read or write the user's own results location: the per-user default points into a
    temporary folder (a test that wants another location passes --results or sets the variable). The
    shipped corpus is off (ATTNBENCH_CORPUS=off): whether it holds this machine's kind must not change
    what a test sees; tests/tables/test_corpus.py switches it on with a corpus of its own."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_DATA_HOME", str(tmp_path_factory.mktemp("xdg-data")))
        mp.delenv("ATTNBENCH_RESULTS_DIR", raising=False)
        mp.setenv("ATTNBENCH_CORPUS", "off")
        yield
