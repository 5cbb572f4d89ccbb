"""scripts/docs_tables.py: the generated blocks of the docs are copied from results files, whole or one
``#### section`` of them, and the docs as committed hold what the results files say."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.script_module import load_script

ROOT = Path(__file__).resolve().parents[2]


def test_a_section_is_what_its_heading_holds(tmp_path: Path) -> None:
    tables = load_script("docs_tables")
    results = tmp_path / "r.md"
    results.write_text("# Title\n\nheader line\n\n#### a\n\n| x |\n\n#### b\n\n| y |\n| z |\n")
    assert tables._body(results) == "header line\n\n#### a\n\n| x |\n\n#### b\n\n| y |\n| z |"
    assert tables._body(results, "a") == "| x |"
    assert tables._body(results, "b") == "| y |\n| z |"  # the last section runs to the end
    assert tables._source("results/r.md#b") == (tables.ROOT / "results/r.md", "b")


def test_the_committed_docs_hold_their_results_blocks() -> None:
    tables = load_script("docs_tables")
    for name, (doc, sources) in tables.BLOCKS.items():
        content = (ROOT / doc).read_text()
        block = content.split(f"<!-- {name} -->\n", 1)[1].split(f"<!-- /{name} -->", 1)[0]
        for source in sources:
            path, section = tables._source(source)
            assert path.exists(), f"{source} (copied into {doc}) does not exist"
            assert f"From `{source}`:\n\n{tables._body(path, section)}" in block, (
                f"{doc}: the {name} block is not what {source} holds: run python scripts/docs_tables.py"
            )


def test_a_missing_section_is_named_with_those_there(tmp_path: Path) -> None:
    tables = load_script("docs_tables")
    results = tmp_path / "r.md"
    results.write_text("# Title\n\n#### a\n\n| x |\n")
    with pytest.raises(ValueError, match=r"r.md: no '#### b' section \(it has: a\)"):
        tables._body(results, "b")
