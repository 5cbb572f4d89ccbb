"""A standing rule of the code base: no module in attnbench/, backends/ or tuning/ over 500 lines.

A module that grows past it is split into small modules (docs/architecture.md says how they are laid
out); the limit keeps every module readable in one sitting.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 500


def test_no_module_over_500_lines() -> None:
    files = [p for d in ("attnbench", "backends", "tuning") for p in sorted((ROOT / d).rglob("*.py"))]
    assert len(files) > 20, f"found only {len(files)} modules under {ROOT}"
    too_long = {
        str(p.relative_to(ROOT)): n
        for p in files
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > LIMIT
    }
    assert not too_long, f"modules over {LIMIT} lines (split them): {too_long}"
