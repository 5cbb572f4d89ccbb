"""Each subpackage's public names are re-exported from its ``__init__`` with ``__all__``: a name that code
in another part of the project (attnbench's other subpackages, the built-in backends, the tuner, the
plugins, the scripts) imports from one of its modules is importable from the subpackage itself, so a
module can move without breaking its users. Modules that need an optional extra are imported directly
and are not re-exported (importing the subpackage must not need the extra)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUBPACKAGES = ["core", "correctness", "cost", "kernels", "measure", "selection", "tables", "tuning", "models"]
#: modules that import transformers (the transformers extra), so their subpackage cannot re-export them
NEEDS_EXTRA = {"attnbench.measure.e2e", "attnbench.cost.generation", "attnbench.cost.generation_calibration"}
USERS = ["attnbench", "backends", "tuning", "plugins", "scripts"]


def _home(path: Path) -> str | None:
    rel = path.relative_to(ROOT).with_suffix("").parts
    if rel[0] in ("backends", "tuning"):
        return f"attnbench.{rel[0]}"
    return f"attnbench.{rel[1]}" if rel[0] == "attnbench" and len(rel) > 2 else None


def _used_outside() -> dict[str, set[tuple[str, str]]]:
    """Per subpackage, (module, name) pairs imported from its modules by code outside it."""
    used: dict[str, set[tuple[str, str]]] = {}
    for folder in USERS:
        for path in (ROOT / folder).rglob("*.py"):
            if ".venv" in path.parts or "build" in path.parts:
                continue
            here = _home(path)
            for node in ast.walk(ast.parse(path.read_text())):
                if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module):
                    continue
                parts = node.module.split(".")
                if parts[0] != "attnbench" or len(parts) < 3:
                    continue
                sub = ".".join(parts[:2])
                if sub == here or node.module in NEEDS_EXTRA:
                    continue
                used.setdefault(sub, set()).update(
                    (node.module, a.name) for a in node.names if not a.name.startswith("_")
                )
    return used


USED = _used_outside()


def test_the_scan_sees_imports() -> None:
    assert ("attnbench.core.registry", "load_registry") in USED["attnbench.core"]


@pytest.mark.parametrize("name", SUBPACKAGES)
def test_public_names_are_reexported(name: str) -> None:
    package = importlib.import_module(f"attnbench.{name}")
    exported = set(getattr(package, "__all__", ()))
    for listed in exported:
        assert hasattr(package, listed), (
            f"attnbench.{name}.__all__ names {listed!r}, which it does not define"
        )
    missing = sorted(
        f"{module}.{n}" for module, n in USED.get(f"attnbench.{name}", set()) if n not in exported
    )
    assert not missing, f"attnbench.{name} is imported from outside but does not re-export: {missing}"
    for module, n in USED.get(f"attnbench.{name}", set()):
        assert getattr(package, n) is getattr(importlib.import_module(module), n), (module, n)
