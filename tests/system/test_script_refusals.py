"""The measuring scripts refuse bad input in one line that names the option and what is accepted,
before anything is measured (argparse's exit status 2)."""

from __future__ import annotations

import pytest
from helpers.script_module import refusal

REFUSED = {
    "timed_layers_check": [
        (
            ["--points", "1x8q", "--out", "x"],
            "--points: '1x8q': expected BATCHxCONTEXT, a batch ≥ 1 and a token count",
        ),
        (["--points", "0x1k", "--out", "x"], "--points: '0x1k': expected BATCHxCONTEXT"),
        (["--backend", "nope", "--out", "x"], "--backend 'nope' is not a built-in backend; one of naive,"),
    ],
    "attention_gemv_mix": [
        (
            ["--layouts", "huge,vllm", "--out", "x"],
            "--layouts: 'huge,vllm': huge is not a layout; a comma-separated list of huge:rand:2,",
        ),
    ],
    "cpu_kernel_bandwidth": [
        (["--prefetch", "3"], "--prefetch '3': a comma-separated list of 0, 2, 4, 8"),
        (["--threads", "0"], "argument --threads: 0: must be a whole number ≥ 1"),
        (["--layers", "two"], "argument --layers: 'two': must be a whole number ≥ 1"),
        (["--page-sizes", "100"], "--page-sizes '100': a comma-separated list of 16, 32, 64, 128, 256, 512"),
        (["--batch", "1,a"], "--batch 'a' is not a token count"),
        (["--context", "8q"], "--context '8q' is not a token count"),
    ],
    "gate_seeds": [
        (["--backend", "nope"], "--backend 'nope' is not registered; one of "),
        (["--backend", "naive", "--cases", "mha,big"], "--cases 'mha,big': big not one of mha, gqa,"),
        (
            ["--backend", "naive", "--dtypes", "fp9"],
            "--dtypes 'fp9': dtype 'fp9' is not a known dtype; accepted:",
        ),
        (["--backend", "naive", "--dtypes", ","], "--dtypes ',': a comma-separated list of fp32, bf16, fp16"),
        (["--backend", "naive", "--seeds", "0"], "argument --seeds: 0: must be a whole number ≥ 1"),
        (["--backend", "naive", "--long-seeds", "-1"], "--long-seeds -1: a whole number ≥ 0"),
    ],
    "cpu_writer_cost": [
        (["--batch", "8"], "--batch '8': at least two different batches"),
        (["--batch", "8,8"], "--batch '8,8': at least two different batches"),
        (["--batch", "0,8"], "--batch '0' must be > 0"),
        (["--batch", "1,x"], "--batch 'x' is not a token count"),
        (["--rounds", "0"], "argument --rounds: 0: must be a whole number ≥ 1"),
        (["--calls", "1.5"], "argument --calls: '1.5': must be a whole number ≥ 1"),
    ],
}


@pytest.mark.parametrize(
    ("script", "argv", "message"),
    [(script, argv, message) for script, cases in REFUSED.items() for argv, message in cases],
)
def test_bad_input_names_the_option_and_what_is_accepted(script: str, argv: list[str], message: str) -> None:
    assert message in refusal(script, argv)
