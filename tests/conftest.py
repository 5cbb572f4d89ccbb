"""Test-wide setup. Triton kernels run through the interpreter on CPU-only machines: the variable
must be set before triton is first imported, so it is set here, before any test module loads."""

from __future__ import annotations

import os

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


@pytest.fixture(autouse=True, scope="session")
def _private_results_location(tmp_path_factory):
    """Tests never read or write the user's own results location: the per-user default points into a
    temporary folder (a test that wants another location passes --results or sets the variable)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_DATA_HOME", str(tmp_path_factory.mktemp("xdg-data")))
        mp.delenv("ATTNBENCH_RESULTS_DIR", raising=False)
        yield
