"""scripts/cpu_kernel_bandwidth.py: bad input is refused in one line, before anything is measured."""

from __future__ import annotations

import pytest
from helpers.script_module import refusal


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prefetch", "3"], "--prefetch '3': a comma-separated list of 0, 2, 4, 8"),
        (["--threads", "0"], "argument --threads: 0: must be a whole number ≥ 1"),
        (["--layers", "two"], "argument --layers: 'two': must be a whole number ≥ 1"),
        (["--page-sizes", "100"], "--page-sizes '100': a comma-separated list of 16, 32, 64, 128, 256, 512"),
        (["--batch", "1,a"], "--batch 'a' is not a token count"),
        (["--context", "8q"], "--context '8q' is not a token count"),
    ],
)
def test_bad_input_names_the_option_and_what_is_accepted(argv: list[str], message: str) -> None:
    assert message in refusal("cpu_kernel_bandwidth", argv)
