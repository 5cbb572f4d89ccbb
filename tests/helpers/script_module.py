"""Import one of the repository's ``scripts/*.py`` as a module, for tests of its functions."""

from __future__ import annotations

import contextlib
import importlib.util
import io
from pathlib import Path
from types import ModuleType

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"  # tests/helpers/ → the repository


def load_script(name: str) -> ModuleType:
    """``scripts/<name>.py`` as a fresh module named ``name``."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec and spec.loader, f"no script {name}.py in {SCRIPTS}"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def refusal(name: str, argv: list[str]) -> str:
    """What ``scripts/<name>.py``'s ``main(argv)`` writes to stderr as it refuses ``argv`` (asserted:
    it exits with argparse's status 2)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_info:
        load_script(name).main(argv)
    assert exit_info.value.code == 2
    return err.getvalue()
