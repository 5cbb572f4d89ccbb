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


def _each(template: str, *parts: str) -> tuple[str, ...]:
    """``template`` with its ``{}`` filled by each of ``parts`` in turn."""
    return tuple(template.format(part) for part in parts)


#: marker name -> (doc, results files whose Markdown (less its title) goes between the markers)
BLOCKS: dict[str, tuple[str, tuple[str, ...]]] = {
    "gate-matrix": (
        "docs/correctness.md",
        _each("results/gate/gate-matrix-cpu-{}.md", "bf16", "fp16", "fp32"),
    ),
    "fp8-long-context": ("docs/fp8.md", ("results/cpu/accuracy/fp8-long-context-cpu.md",)),
    "vllm-targets": ("docs/engines.md", ("results/engines/vllm-targets.md",)),
    "aot-paged": (
        "docs/triton-paged.md",
        _each("results/aot/aot-before-after.md#{}", "paged", "merge", "summary"),
    ),
    "aot-fp8": ("docs/fp8.md", ("results/aot/aot-before-after.md#fp8",)),
    "aot-mla": ("docs/mla.md", ("results/aot/aot-before-after.md#mla",)),
    "cpu-kernel-bandwidth": (
        "docs/benchmarks.md",
        _each("results/cpu/kernels/cpu-kernel-bandwidth-t1-{}.md", "b1", "b8", "prefetch"),
    ),
}


def _body(path: Path, section: str = "") -> str:
    """The file's Markdown less its title; with ``section``, only what its ``#### section`` heading
    holds (up to the next ``####``)."""
    lines = path.read_text().splitlines()
    if lines and lines[0].startswith("# "):
        lines = lines[1:]
    if section:
        if f"#### {section}" not in lines:
            raise ValueError(f"{path.name}: no '#### {section}' section (it has: {_sections(lines)})")
        start = lines.index(f"#### {section}") + 1
        ends = [i for i in range(start, len(lines)) if lines[i].startswith("#### ")]
        lines = lines[start : ends[0] if ends else len(lines)]
    return "\n".join(lines).strip()


def _sections(lines: list[str]) -> str:
    return ", ".join(line[5:] for line in lines if line.startswith("#### ")) or "none"


def _source(source: str) -> tuple[Path, str]:
    file, _, section = source.partition("#")
    return ROOT / file, section


def main() -> int:
    missing = []
    for name, (doc, sources) in BLOCKS.items():
        present = [s for s in sources if _source(s)[0].exists()]
        missing += [s for s in sources if not _source(s)[0].exists()]
        if not present:
            continue
        try:
            text = "\n\n".join(f"From `{s}`:\n\n{_body(*_source(s))}" for s in present)
        except ValueError as err:
            print(f"{doc}: {name}: {err}", file=sys.stderr)
            return 2
        path = ROOT / doc
        content = path.read_text()
        pattern = re.compile(rf"(<!-- {re.escape(name)} -->\n).*?(<!-- /{re.escape(name)} -->)", re.S)
        if not pattern.search(content):
            print(f"{doc}: no <!-- {name} --> block", file=sys.stderr)
            return 2
        path.write_text(pattern.sub(lambda m, body=text: m.group(1) + body + "\n" + m.group(2), content))
        print(f"{doc}: {name} from {', '.join(present)}")
    for s in missing:
        print(f"not there yet: {s}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
