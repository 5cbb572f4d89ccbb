"""The ``attnbench`` command line. Each subcommand lives in its own module of this package.

A subcommand module defines ``register(subparsers)``, which adds its parser (with
``cli.common.add_command``: the ``--help`` line, description and example come from the module's
docstring; shared options from the parent parsers there) and sets ``func=run`` with
``run(args) -> int``. Add new modules to ``COMMANDS``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from contextlib import nullcontext

from attnbench import __version__
from attnbench.cli.common import json_stdout, sigterm_as_interrupt

#: Subcommand modules, in the order ``--help`` lists them.
COMMANDS = ["backends", "bench", "decode", "e2e", "tune", "select", "estimate", "calibrate"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnbench",
        description=(
            "Pick the fastest correct attention backend for LLM decoding by measuring it: every "
            "candidate is checked against a float64 reference, then timed, and reported against the "
            "device's measured memory bandwidth."
        ),
    )
    parser.add_argument("--version", action="version", version=f"attnbench {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"attnbench.cli.{name}").register(sub)
    for command in sub.choices.values():  # for cli.common.command_line
        command.set_defaults(command_parser=command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2

    try:
        with sigterm_as_interrupt(), json_stdout() if getattr(args, "json", False) else nullcontext():
            return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, LookupError) as err:  # bad input: one clear line, no traceback
        print(f"attnbench {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
