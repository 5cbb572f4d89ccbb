"""A standing rule of the test suite: the tests mirror the package. Every concept subpackage of
attnbench (``attnbench/<sub>/``, plus ``backends/`` and ``tuning/``, installed as
``attnbench.backends`` and ``attnbench.tuning``) has a folder ``tests/<sub>/``, and every public
module of the subpackage (no leading underscore) is imported by at least one test file of that
folder — by an ``import`` or ``from`` statement, found by parsing the files, not by running them.

Whole-system tests (docs, scripts, module sizes, this rule) live in ``tests/system/``; helpers shared
by every folder (``helpers.tuning_helpers``, ``helpers.fake_plugins``, …) in the package
``tests/helpers/``, importable because ``[tool.pytest.ini_options] pythonpath`` puts ``tests/`` on
``sys.path``; no other module sits at ``tests/``'s top besides ``conftest.py``."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
SUBPACKAGES = (
    "core",
    "kernels",
    "correctness",
    "measure",
    "cost",
    "selection",
    "tables",
    "models",
    "integrations",
    "cli",
)
#: subpackage name -> its source folder
SOURCES = {sub: ROOT / "attnbench" / sub for sub in SUBPACKAGES} | {
    "backends": ROOT / "backends",
    "tuning": ROOT / "tuning",
}
#: folders of tests/ that mirror no subpackage
OWN_FOLDERS = {"system", "helpers"}


def public_modules(sub: str) -> list[str]:
    return sorted(
        f"attnbench.{sub}.{p.stem}" for p in SOURCES[sub].glob("*.py") if not p.stem.startswith("_")
    )


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports by name: ``import a.b``, ``from a.b import c`` (``a.b`` and ``a.b.c``,
    which is a module when ``c`` is one), at any depth of the file (imports inside functions count)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def test_every_subpackage_has_its_test_folder_and_every_test_folder_a_subpackage() -> None:
    for sub, source in SOURCES.items():
        assert (source / "__init__.py").is_file(), f"{source} is not a package"
        assert (TESTS / sub).is_dir(), f"attnbench.{sub} has no tests/{sub}/"
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and not p.name.startswith((".", "__"))}
    assert folders <= set(SOURCES) | OWN_FOLDERS, (
        f"tests/ folders that mirror nothing: {folders - set(SOURCES)}"
    )
    loose = sorted(p.name for p in TESTS.glob("*.py") if p.name != "conftest.py")
    assert not loose, (
        f"modules directly in tests/ (tests in the folder of what they test, helpers in tests/helpers/): {loose}"
    )


def test_every_public_module_is_imported_by_a_test_of_its_own_folder() -> None:
    missing = []
    for sub in SOURCES:
        imported: set[str] = set()
        for path in (TESTS / sub).glob("test_*.py"):
            imported |= imported_modules(path)
        missing += [f"{m} (tests/{sub}/)" for m in public_modules(sub) if m not in imported]
    assert not missing, "public modules that no test of their own folder imports: " + ", ".join(missing)


def test_test_file_names_are_unique_across_folders() -> None:
    """The folders have no ``__init__.py`` (pytest's default import mode imports each test file as a
    top-level module by its base name), so two test files of one name would collide."""
    seen: dict[str, Path] = {}
    for path in sorted(TESTS.rglob("test_*.py")):
        assert path.name not in seen, f"{path.relative_to(ROOT)} and {seen[path.name].relative_to(ROOT)}"
        seen[path.name] = path


def test_the_scan_reads_both_import_forms(tmp_path: Path) -> None:
    probe = tmp_path / "test_probe.py"
    probe.write_text(
        "import attnbench.core.shapes as s\nfrom attnbench.tables import table\n"
        "def f():\n    from attnbench.cost.fit import Fit\n"
    )
    got = imported_modules(probe)
    assert {"attnbench.core.shapes", "attnbench.tables.table", "attnbench.cost.fit"} <= got
