"""The base install (``pip install -e .``: no transformers, no matplotlib, no flash-attn) runs every
command but the ones that need an extra, and those refuse in one line naming the extra. The README's
first quickstart command runs on exactly that install."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

#: a child that makes the optional packages unimportable, then runs the CLI with its arguments
CHILD = textwrap.dedent(
    """
    import sys
    BLOCKED = ("transformers", "matplotlib", "flash_attn", "safetensors")
    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"No module named {name!r} (blocked by the test)")
    sys.meta_path.insert(0, Block())
    for name in list(sys.modules):
        if name.split(".")[0] in BLOCKED:
            del sys.modules[name]
    from attnbench.cli import main
    try:
        code = main(sys.argv[1:])
    except SystemExit as done:  # --help
        code = done.code
    loaded = sorted({n.split(".")[0] for n in sys.modules} & set(BLOCKED))
    print("LOADED", loaded)
    sys.exit(code)
    """
)


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", CHILD, *argv], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    "argv",
    [
        ["backends"],
        ["select", "--help"],
        ["tune", "--help"],
        ["bench", "--model", "tiny-gqa", "--context", "32", "--dtype", "fp32", "--backends", "naive"],
    ],
)
def test_commands_run_without_the_extras(argv: list[str]) -> None:
    proc = _cli(*argv)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "LOADED []" in proc.stdout


def test_e2e_without_transformers_says_which_extra() -> None:
    proc = _cli("e2e", "--model", "some-model-dir")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert "attnbench[transformers]" in proc.stderr
