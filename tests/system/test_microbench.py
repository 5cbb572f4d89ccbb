"""scripts/microbench.py, what the one-thread CPU microbenchmark scripts share: a C probe is built with
the kernel's compiler (or None without one), a call is timed, a run is printed and saved."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from helpers.script_module import load_script

from attnbench.backends.cpu_kernel import find_compiler

microbench = load_script("microbench")


def test_a_c_probe_is_built_and_runs(tmp_path: Path) -> None:
    if find_compiler() is None:
        pytest.skip("no C compiler")
    source = '#include <stdio.h>\nint main(void) { printf("%d\\n", 6 * 7); return 0; }\n'
    exe = microbench.compile_c(source, tmp_path / "probe", ["-O2"])
    assert exe == tmp_path / "probe" and (tmp_path / "probe.c").read_text() == source
    assert subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout == "42\n"


def test_without_a_compiler_nothing_is_built(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert microbench.compile_c("int main(void) { return 0; }\n", tmp_path / "probe", []) is None


def test_a_call_is_timed_after_two_dropped_calls() -> None:
    seen = []
    assert microbench.median_call_s(lambda: seen.append(1), 5) >= 0
    assert len(seen) == 7


def test_a_run_is_printed_and_saved(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sub" / "report"
    assert microbench.print_and_save_report(str(out), {"rows": [1]}, ["# title", "", "a line"]) == 0
    assert capsys.readouterr().out == "# title\n\na line\n"
    assert out.with_suffix(".md").read_text() == "# title\n\na line\n"
    assert json.loads(out.with_suffix(".json").read_text()) == {"rows": [1]}
