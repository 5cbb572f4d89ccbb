"""The wheel ships every package in the tree: pyproject's explicit ``packages`` list names each folder
with an ``__init__.py`` (an editable install imports a folder the list forgets; a wheel leaves it out)."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def _tree_packages() -> set[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set()
    for name, folder in config["package-dir"].items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            found.add(".".join([name, *rel.parts]) if rel.parts else name)
    return found


def test_every_package_folder_is_listed() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    in_tree = _tree_packages()
    assert "attnbench.tables" in in_tree  # the check sees the folders it guards
    assert in_tree - listed == set(), (
        f"packages missing from pyproject's packages list: {sorted(in_tree - listed)}"
    )
    assert listed - in_tree == set(), f"packages listed but not in the tree: {sorted(listed - in_tree)}"
