"""The faults table in docs/tuning.md names, for every fault, the test that plants it: each named
test file (a path from the repository root) and test must exist, and every tests/**/test_faults_*.py
file must appear in the table."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _faults_section() -> str:
    text = (ROOT / "docs" / "tuning.md").read_text()
    return text.split("\n## Faults\n", 1)[1].split("\n## ", 1)[0]


def test_every_fault_in_the_docs_names_a_test_that_exists():
    rows = [line for line in _faults_section().splitlines() if line.startswith("| ") and "---" not in line][
        1:
    ]
    assert len(rows) >= 10
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 4 and cells[2], row  # fault, what happens, what is lost, test
        assert not re.search(r"`test_\w+\.py", cells[3]), f"name the test file by its path (tests/…): {row}"
        for name, prefix in re.findall(r"`(tests/[\w/]*test_\w+\.py)(?:::(\w+))?", cells[3]):
            path = ROOT / name
            assert path.exists(), f"{name} (named in docs/tuning.md) does not exist"
            if prefix:
                tests = [
                    n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)
                ]
                assert any(t.startswith(prefix) for t in tests), f"no test {prefix}… in {name}"


def test_every_fault_test_file_is_in_the_docs_table():
    section = _faults_section()
    for path in sorted((ROOT / "tests").rglob("test_faults_*.py")):
        if path.name != Path(__file__).name:
            name = path.relative_to(ROOT).as_posix()
            assert f"`{name}" in section, f"{name} is not in the faults table of docs/tuning.md"
