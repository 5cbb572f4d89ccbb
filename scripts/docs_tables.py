"""Copy generated results tables into the docs, between ``<!-- name -->`` and ``<!-- /name -->`` markers.

Every figure in those blocks comes from a results file (its first lines name the command, machine,
date and load average); nothing in them is typed by hand. Run after the scripts that write them:

    python scripts/docs_tables.py
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: marker name -> (doc, results files whose Markdown (less its title) goes between the markers)
BLOCKS: dict[str, tuple[str, tuple[str, ...]]] = {
    "gate-matrix": (
        "docs/correctness.md",
        (
            "results/gate-matrix-cpu-bf16.md",
            "results/gate-matrix-cpu-fp16.md",
            "results/gate-matrix-cpu-fp32.md",
        ),
    ),
    "fp8-long-context": ("docs/fp8.md", ("results/fp8-long-context-cpu.md",)),
    "vllm-targets": ("docs/engines.md", ("results/vllm-targets.md",)),
    "cpu-kernel-bandwidth": (
        "docs/benchmarks.md",
        (
            "results/cpu-kernel-bandwidth-t1-b1.md",
            "results/cpu-kernel-bandwidth-t1-b8.md",
            "results/cpu-kernel-bandwidth-t1-prefetch.md",
        ),
    ),
}


def _body(path: Path) -> str:
    lines = path.read_text().splitlines()
    if lines and lines[0].startswith("# "):
        lines = lines[1:]
    return "\n".join(lines).strip()


def main() -> int:
    missing = []
    for name, (doc, sources) in BLOCKS.items():
        present = [ROOT / s for s in sources if (ROOT / s).exists()]
        missing += [s for s in sources if not (ROOT / s).exists()]
        if not present:
            continue
        text = "\n\n".join(f"From `{p.relative_to(ROOT)}`:\n\n{_body(p)}" for p in present)
        path = ROOT / doc
        content = path.read_text()
        pattern = re.compile(rf"(<!-- {re.escape(name)} -->\n).*?(<!-- /{re.escape(name)} -->)", re.S)
        if not pattern.search(content):
            print(f"{doc}: no <!-- {name} --> block", file=sys.stderr)
            return 2
        path.write_text(pattern.sub(lambda m, body=text: m.group(1) + body + "\n" + m.group(2), content))
        print(f"{doc}: {name} from {', '.join(str(p.relative_to(ROOT)) for p in present)}")
    for s in missing:
        print(f"not there yet: {s}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
