"""What every test module of this plugin needs first: the plugin and vLLM's CPU build.

Where either is missing a module is skipped with the reason, unless ``ATTNBENCH_REQUIRE_VLLM=1`` (set
by the project's CI): there a missing plugin fails the import and a missing vLLM kernel library fails
the tests that use it — CI never passes by skipping them.
"""

from __future__ import annotations

import os

import pytest

#: set by the project's CI: a missing vLLM fails instead of skipping
REQUIRED = os.environ.get("ATTNBENCH_REQUIRE_VLLM") == "1"


def require_vllm() -> str | None:
    """Call at a test module's import: skips the module where the plugin or vLLM's CPU kernels are
    missing (unless :data:`REQUIRED`); returns why vLLM's kernels are unavailable, else ``None``."""
    try:
        from attnbench_vllm import isa
    except ImportError as err:
        if REQUIRED:
            raise
        pytest.skip(
            f"attnbench-vllm is not installed ({err}); bash scripts/install-vllm.sh", allow_module_level=True
        )
    missing = isa.vllm_error()
    if missing and not REQUIRED:
        pytest.skip(f"vLLM's CPU kernels unavailable: {missing}", allow_module_level=True)
    return missing
