"""What the one-thread CPU microbenchmark scripts share (``cpu_writer_cost``, ``fp8_arithmetic_ceiling``,
``int8_choice``, ``paged_read_ceiling``): the cpu_decode kernel or a refusal, timing a call, building a C
probe with the kernel's compiler, and the record, printout and files of a run.

Not a script itself. A script imports it after putting its own folder on ``sys.path``, as the vLLM
scripts import ``vllm_serving_bench`` (a script loaded by its path, as the tests load them, does not
have its folder there)."""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from attnbench.backends.cpu_kernel import Kernel, find_compiler, load_kernel
from attnbench.cli.common import command_line, run_record, write_report


def kernel_or_refuse(parser: argparse.ArgumentParser) -> Kernel:
    """The cpu_decode kernel (built at its first use); where it cannot be had, ``parser``'s error (exit
    status 2) saying why."""
    kernel = load_kernel()
    if isinstance(kernel, str):
        parser.error(f"the cpu_decode kernel is unavailable here: {kernel}")
    return kernel


def median_call_s(call: Callable[[], object], calls: int) -> float:
    """The median seconds of ``calls`` calls of ``call``, after two more whose times are dropped (they warm
    the caches)."""
    times = []
    for _ in range(calls + 2):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return statistics.median(times[2:])


def compile_c(source: str, exe: Path, flags: Sequence[str]) -> Path | None:
    """``exe`` built from the C ``source`` (written beside it as ``<exe>.c``) with ``flags``, by the
    compiler the kernel is built with (:func:`attnbench.backends.cpu_kernel.find_compiler`); None when
    there is none."""
    cc = find_compiler()
    if cc is None:
        return None
    src = exe.with_suffix(".c")
    src.write_text(source)
    subprocess.run([cc, *flags, "-o", str(exe), str(src)], check=True, capture_output=True, timeout=120)
    return exe


def script_run_record(
    args: argparse.Namespace,
    *,
    parser: argparse.ArgumentParser,
    prog: str,
    load_start: Sequence[float],
    started: float,
) -> dict[str, Any]:
    """:func:`attnbench.cli.common.run_record` of a script's run, its command rebuilt from ``args``
    against ``parser``'s defaults as ``prog`` (``"python scripts/int8_choice.py"``) takes it."""
    command = command_line(args, parser=parser, prog=prog)
    return run_record(command=command, load_start=load_start, started=started)


def print_and_save_report(out: str, report: Mapping[str, Any], lines: list[str]) -> int:
    """Print the Markdown ``lines`` and save the run: ``report`` to ``<out>.json``, the lines to
    ``<out>.md``; 0, the script's exit status."""
    text = "\n".join(lines)
    print(text)
    write_report(out, report, text + "\n")
    return 0
