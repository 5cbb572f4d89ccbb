"""Import one of the repository's ``scripts/*.py`` as a module, for tests of its functions."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"  # tests/helpers/ → the repository


def load_script(name: str) -> ModuleType:
    """``scripts/<name>.py`` as a fresh module named ``name``."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec and spec.loader, f"no script {name}.py in {SCRIPTS}"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
