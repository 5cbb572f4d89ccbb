"""Regenerate the figures in docs/latency-model.md by running the CLI (nothing there is typed by hand).

Every ``<!-- example: ARGS -->`` line in the page is followed by a fenced block that this script
replaces with the output of ``attnbench estimate ARGS`` (at 118 columns). The block after
``<!-- validation: PATH -->`` is replaced with the body of the committed validation table ``PATH``.

    python scripts/latency_model_docs.py [--check]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shlex
import sys
from pathlib import Path

from attnbench.cli import main as cli

DOC = Path("docs/latency-model.md")
FENCE = "```"


def run_cli(args: str) -> str:
    os.environ["COLUMNS"] = "118"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli(["estimate", *shlex.split(args)])
    if rc:
        raise SystemExit(f"attnbench estimate {args} exited {rc}")
    return f"$ attnbench estimate {args}\n{buf.getvalue().rstrip()}"


def render(text: str) -> str:
    out: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        out.append(line)
        i += 1
        m = re.fullmatch(r"<!-- (example|validation): (.+) -->", line.strip())
        if not m:
            continue
        # drop the old generated block (a fenced block, or the validation table up to the end marker)
        if m.group(1) == "example":
            if i < len(lines) and lines[i].startswith(FENCE):
                i += 1
                while i < len(lines) and not lines[i].startswith(FENCE):
                    i += 1
                i += 1
            out += [f"{FENCE}text", run_cli(m.group(2)), FENCE]
        else:
            while i < len(lines) and lines[i].strip() != "<!-- /validation -->":
                i += 1
            table = Path(m.group(2))
            if not table.exists():
                print(f"{table} not found: the validation block is left empty", file=sys.stderr)
                continue
            body = table.read_text().splitlines()
            out += [ln.replace("# ", "#### ", 1) if ln.startswith("# ") else ln for ln in body]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--check", action="store_true", help="fail if the page is out of date instead of writing it"
    )
    args = p.parse_args(argv)
    old = DOC.read_text()
    new = render(old)
    if args.check:
        if new != old:
            print(f"{DOC} is out of date: run python scripts/latency_model_docs.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
