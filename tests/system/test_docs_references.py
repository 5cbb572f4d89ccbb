"""Every repository path and every ``attnbench.…`` name that README.md and docs/ mention exists.

A path is an inline code span that starts with one of the repository's top-level folders
(``backends/csrc/cpu_decode.c``, ``results/cpu/bench/fp8-t1.md``; a benchmark's ``--out`` prefix counts
when its ``.md`` or ``.json`` exists; a ``#anchor``, ``::test`` or ``:line`` suffix is dropped; globs and
placeholders are not checked; a guide's ``File `path`:`` headings are its example project's files). A name is a code span ``attnbench.a.b.c``, or ``a.b.c`` whose first part is
one of attnbench's subpackages (``measure.synthetic.SyntheticModel``): its longest importable module
prefix is imported and the rest looked up on it. Relative Markdown links must reach a file. Docs that
name what no longer exists send a reader to nothing; this keeps them honest as the code moves.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOPS = ("attnbench/", "backends/", "tuning/", "plugins/", "results/", "tests/", "docs/", "scripts/", ".ci/")
SUBPACKAGES = (
    "core", "kernels", "correctness", "measure", "cost", "selection", "models", "integrations", "cli",
    "backends", "tuning",
)  # fmt: skip
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def _path_exists(path: str) -> bool:
    target = ROOT / path
    return target.exists() or any(target.with_name(target.name + ext).exists() for ext in (".md", ".json"))


def _missing(doc: Path) -> list[str]:
    # a guide's "File `path`:" headings name files of its example project, not of this repository
    text = re.sub(r"(?m)^File `[^`]+`:$", "", doc.read_text(encoding="utf-8"))
    out = []
    for match in re.finditer(r"`([^`\s]+)`", text):
        token = match.group(1).rstrip(".,;:)")
        path = re.sub(r":\d+(-\d+)?$", "", token.split("#")[0].split("::")[0])
        if path.startswith(TOPS):
            if not any(c in path for c in "*<>{}[]|$…") and not _path_exists(path):
                out.append(f"path {token}")
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+", token):
            first = token.split(".")[0]
            dotted = token if first == "attnbench" else f"attnbench.{token}" if first in SUBPACKAGES else None
            if dotted and not _resolves(dotted):
                out.append(f"name {token}")
    for match in re.finditer(r"\]\(([^)\s]+)\)", text):
        link = match.group(1)
        if (
            not link.startswith(("http:", "https:", "#", "mailto:"))
            and not (doc.parent / link.split("#")[0]).exists()
        ):
            out.append(f"link {link}")
    return out


def test_every_path_and_name_the_docs_mention_exists() -> None:
    assert len(DOCS) > 5
    missing = {doc.relative_to(ROOT).as_posix(): m for doc in DOCS if (m := _missing(doc))}
    assert not missing, f"README.md and docs/ mention what does not exist: {missing}"
