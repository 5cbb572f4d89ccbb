"""The CLI's shared pieces on their own: the gate options, table cells and the 80-column check,
``select``'s step cell, and ``e2e``'s default paths and summary (planted rows, nothing measured)."""

from __future__ import annotations

import argparse

import pytest
import torch
from rich.table import Table

from attnbench.cli.common import command_line, positive_int_list
from attnbench.cli.e2e import default_paths, summarise, summary_lines
from attnbench.cli.gate_options import add_gate_options, gate_options
from attnbench.cli.select import step_cell
from attnbench.cli.tables import cli_table, config_text, ms_text, render_text, truncated_cells
from attnbench.core.workload import Workload
from attnbench.measure.e2e import PathRun
from attnbench.selection.choice import Choice

W = Workload.uniform("tiny-gqa", batch=1, context=64, dtype="fp32")


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_gate_options(p)
    return p.parse_args(list(argv))


def test_gate_options_are_validated_and_a_budget_allows_lossy() -> None:
    plain = gate_options(_parse())
    assert not plain.allow_lossy and plain.accuracy_budget is None and plain.error_multiple is None
    budget = gate_options(_parse("--accuracy-budget", "0.05", "--tolerance-multiple", "2"))
    assert budget.allow_lossy and budget.accuracy_budget == 0.05 and budget.error_multiple == 2.0
    with pytest.raises(ValueError, match="--tolerance-multiple '-1' is not a positive number"):
        gate_options(_parse("--tolerance-multiple", "-1"))
    with pytest.raises(ValueError, match="--accuracy-budget 'nan'"):
        gate_options(_parse("--accuracy-budget", "nan"))


def test_table_cells() -> None:
    assert config_text({"page_size": 128, "kv_splits": "auto"}) == "page_size=128 kv_splits=auto"
    assert config_text(None) == config_text({}) == "-"
    assert [ms_text(x) for x in (0.048731, 692.34, 13290.4, None)] == ["0.04873", "692.3", "13290", "—"]


def test_truncated_cells_finds_a_cell_cut_short_at_the_width() -> None:
    table = cli_table("t", ["backend", "ms"], right={"ms"})
    table.add_row("triton_paged", "1.5")
    assert truncated_cells(table) == []
    assert "triton_paged" in render_text(table)
    cut = Table()
    cut.add_column("backend", no_wrap=True, overflow="ellipsis")
    cut.add_row("a_backend_name_far_too_long_for_its_column")
    assert truncated_cells(cut, width=20)


def test_select_step_cell_says_what_the_time_is() -> None:
    assert step_cell(Choice("naive", {}, "tuned", W, "r", step_ms=1.25)) == "1.25 (measured)"
    assert (
        step_cell(Choice("naive", {}, "calibrated", W, "r", estimate_ms=2.0))
        == "2 (predicted, calibrated model)"
    )
    assert (
        step_cell(Choice("naive", {}, "heuristic", W, "r", estimate_ms=0.5))
        == "≥0.5 (predicted, roofline floor)"
    )
    assert step_cell(Choice("naive", {}, "heuristic", W, "r")) == "-"


def _run(path: str, *, stock: bool, itl: float, ttft: float = 1.0) -> PathRun:
    return PathRun(
        path=path, stock=stock, backend=None if stock else path, config={}, implementation="",
        batch=1, prompt_len=8, new_tokens=3, dtype="fp32", ttft_s=ttft, itl_s=[itl, itl],
        attention_s=[0.0, 0.0], prefill_attention_s=0.0, tokens=[[1, 2, 3]], tokens_match=True,
    )  # fmt: skip


def test_e2e_summary_compares_the_best_backend_with_the_best_stock_path() -> None:
    rows = [
        _run("sdpa", stock=True, itl=0.02),
        _run("sdpa-static", stock=True, itl=0.01),
        _run("naive", stock=False, itl=0.03),
        _run("flash", stock=False, itl=0.015, ttft=0.5),
    ]
    (s,) = summarise(rows)
    assert (s["best_stock"], s["best_backend"]) == ("sdpa-static", "flash")
    assert s["itl_ratio"] == pytest.approx(1.5) and s["ttft_ratio_vs_sdpa"] == pytest.approx(0.5)
    assert summary_lines([s])[0].startswith("b=1 prompt=8: flash ITL ×1.50 of sdpa-static")


def test_e2e_default_paths_are_the_stock_paths_then_native_exact_backends() -> None:
    paths = default_paths(device="cpu", dtype=torch.float32)
    assert paths[:2] == ["sdpa", "sdpa-static"] and "naive" in paths
    assert "fp8" not in paths and "mla" not in paths  # lossy, latent


def test_a_list_option_is_parsed_checked_and_written_back_as_typed() -> None:
    p = argparse.ArgumentParser(prog="x")
    p.add_argument("--context", type=positive_int_list, default="1k")
    args = p.parse_args(["--context", "1k,4k"])
    assert args.context == [1024, 4096]
    assert command_line(args, parser=p) == "x --context 1024,4096"
    assert command_line(p.parse_args([]), parser=p) == "x"  # the default, converted, is left out
    for bad in ("0", "1,-2", "", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match="whole numbers ≥ 1"):
            positive_int_list(bad)
