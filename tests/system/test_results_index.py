"""results/REFERENCE.md indexes the committed reference runs: every file under results/ is listed
there (a run by its stem with its extensions), every file it lists exists, and every ``results/...``
path that README.md, docs/ and scripts/ quote exists."""

from __future__ import annotations

import fnmatch
import itertools
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
INDEX = "REFERENCE.md"

#: quoted paths that name outputs no committed run has produced, and why
NOT_COMMITTED = {
    "results/gpu/": "scripts/gpu_check.py's output: it needs an NVIDIA GPU, and none has been measured yet",
    "results/validation-smoke": "validate_estimator.py --quick's smoke run, not to be committed",
    "results/calibration-cuda-": "an example of another machine's calibration file",
}

_HEADING = re.compile(r"^#+ `(results/[^`]*/)`\s*$")
_NAME = re.compile(r"`([^`]+)`")
_QUOTED = re.compile(r"(?<![\w./-])results/[\w.{},*<>…/+-]*")
_MARKER = re.compile(r"<!-- ([\w-]+)(?::.*)? -->")


def _expand(pattern: str) -> list[str]:
    """``a.{json,md}`` -> ``a.json``, ``a.md`` (every brace group, in order)."""
    parts = re.split(r"(\{[^{}]+\})", pattern)
    choices = [p[1:-1].split(",") if p.startswith("{") else [p] for p in parts]
    return ["".join(c) for c in itertools.product(*choices)]


def committed(root: Path) -> list[str]:
    """The files under ``root/results`` less the index, as ``results/...`` paths (git's list in a
    checkout, else the folder walked)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "results"], cwd=root, capture_output=True, text=True, check=True
        ).stdout
        files = [f for f in out.split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        files = []
    if not files:
        base = root / "results"
        files = [p.relative_to(root).as_posix() for p in base.rglob("*") if p.is_file()]
    return sorted(f for f in files if f != f"results/{INDEX}")


def listed(root: Path) -> list[str]:
    """The files the index's tables list: each ``## `results/folder/` `` heading, then the
    backquoted names in the first cell of each table row, relative to that folder."""
    folder, names = None, []
    for line in (root / "results" / INDEX).read_text().splitlines():
        heading = _HEADING.match(line)
        if heading:
            folder = heading.group(1)
        elif folder and line.startswith("| `"):
            first = line.split(" | ", 1)[0]
            for name in _NAME.findall(first):
                names += [folder + n for n in _expand(name)]
    return names


def _outside_generated_blocks(text: str) -> str:
    """``text`` less the blocks scripts/docs_tables.py and latency_model_docs.py copy from results
    files (they quote each run's command as it was recorded); the opening marker line is kept."""
    kept, inside = [], None
    for line in text.splitlines():
        if inside is not None:
            inside = None if line.strip() == f"<!-- /{inside} -->" else inside
            continue
        kept.append(line)
        marker = _MARKER.fullmatch(line.strip())
        if marker and marker.group(1) != "example":
            inside = marker.group(1)
    return "\n".join(kept)


def quoted(root: Path) -> list[tuple[str, str]]:
    """(file, path) for every ``results/...`` path in README.md, docs/**/*.md and scripts/*.py."""
    sources = [
        root / "README.md",
        *sorted((root / "docs").rglob("*.md")),
        *sorted((root / "scripts").glob("*.py")),
    ]
    found = []
    for src in sources:
        text = src.read_text()
        if src.suffix == ".md":
            text = _outside_generated_blocks(text)
        for m in _QUOTED.finditer(text):
            path = m.group(0).rstrip(".,;:")
            found.append((src.relative_to(root).as_posix(), path))
    return found


def resolves(root: Path, path: str, files: list[str]) -> bool:
    """Whether a quoted path names something committed: a file or folder, a pattern (``{a,b}``,
    ``*``, ``<placeholder>``, ``…``, a format string's ``{}``) matching a file, or a prefix the script completes (its ``--out``
    stem)."""
    if any(path.startswith(prefix) for prefix in NOT_COMMITTED):
        return True
    for variant in _expand(path):
        pattern = re.sub(r"<[^<>]*>|…|\{\}", "*", variant)
        if (root / pattern.rstrip("/")).exists() and "*" not in pattern:
            return True
        if any(fnmatch.fnmatchcase(f, pattern) or fnmatch.fnmatchcase(f, pattern + "*") for f in files):
            return True
    return False


def test_every_committed_results_file_is_in_the_index() -> None:
    names = set(listed(ROOT))
    unlisted = [f for f in committed(ROOT) if f not in names]
    assert not unlisted, f"results/{INDEX} does not list: {unlisted}"


def test_every_file_the_index_lists_exists() -> None:
    missing = [f for f in listed(ROOT) if not (ROOT / f).is_file()]
    assert not missing, f"results/{INDEX} lists files that are not there: {missing}"


def test_every_results_path_the_docs_and_scripts_quote_exists() -> None:
    files = committed(ROOT)
    broken = [f"{src}: {path}" for src, path in quoted(ROOT) if not resolves(ROOT, path, files)]
    assert not broken, "quoted results paths that name nothing committed:\n" + "\n".join(broken)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A repository with two runs, both indexed, one quoted by a doc."""
    (tmp_path / "results" / "cpu" / "bench").mkdir(parents=True)
    for name in ("a.json", "a.md", "b.json"):
        (tmp_path / "results" / "cpu" / "bench" / name).write_text("{}\n")
    (tmp_path / "results" / INDEX).write_text(
        "# Committed reference runs\n\n## `results/cpu/bench/`\n\n| file | what |\n| --- | --- |\n"
        "| `a.{json,md}` | a run |\n| `b.json` | another |\n"
    )
    (tmp_path / "docs").mkdir()
    (tmp_path / "scripts").mkdir()
    (tmp_path / "README.md").write_text("See `results/cpu/bench/a.md`.\n")
    (tmp_path / "docs" / "x.md").write_text(
        "<!-- block -->\nFrom `results/old-name.md`: a copied block\n<!-- /block -->\n"
    )
    return tmp_path


def test_the_checks_catch_what_is_planted(tree: Path) -> None:
    files = committed(tree)
    assert sorted(listed(tree)) == files == [f"results/cpu/bench/{n}" for n in ("a.json", "a.md", "b.json")]
    assert all(resolves(tree, p, files) for _, p in quoted(tree))  # the generated block is not read

    (tree / "results" / "cpu" / "bench" / "c.png").write_text("")  # a file the index does not list
    assert set(committed(tree)) - set(listed(tree)) == {"results/cpu/bench/c.png"}

    (tree / "results" / "cpu" / "bench" / "b.json").unlink()  # a file the index lists, gone
    assert [f for f in listed(tree) if not (tree / f).is_file()] == ["results/cpu/bench/b.json"]

    (tree / "scripts" / "s.py").write_text(
        'DEFAULT = "results/cpu/bench/a"  # a stem\nOLD = "results/a.json"\n'
    )
    files = committed(tree)
    assert [p for _, p in quoted(tree) if not resolves(tree, p, files)] == ["results/a.json"]
