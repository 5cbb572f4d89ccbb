"""The CLI's tables read in full at 80 columns: every command's table, built the way the command builds
it from planted data (no tuning or benchmark runs), rendered 80 columns wide has no cell cut short
(no "…", no word split across lines); ``--wide`` adds the columns the default leaves out."""

from __future__ import annotations

from typing import Any

import pytest
from helpers.tuning_helpers import stated_profile
from rich.table import Table
from rich.text import Text

from attnbench.cli import build_parser, main
from attnbench.cli.common import cli_table, config_text, ms_text, render_text, truncated_cells

WIDTH = 80
DEVICE = "Intel(R) Xeon(R) Platinum 8480+"


def _headers(table: Table) -> list[str]:
    return [str(c.header) for c in table.columns]


def _cells(table: Table) -> set[str]:
    """Every cell's text (markup rendered), to say what a table holds whatever its lines."""
    return {
        Text.from_markup(c).plain if isinstance(c, str) else str(c)
        for col in table.columns
        for c in col.cells
    }


def _assert_readable(table: Table, width: int = WIDTH) -> str:
    """The table's text at ``width`` columns, after checking that no cell lost any of its text."""
    text = render_text(table, width)
    assert truncated_cells(table, width) == [], f"cut cells at {width} columns:\n{text}"
    assert all(len(line) <= width for line in text.splitlines()[1:] if line.startswith(("┃", "│")))
    return text


# -- the helper ----------------------------------------------------------------------------------------


def test_the_checker_finds_a_cut_cell_and_a_split_word() -> None:
    plain = Table(title="rich's default: ellipsis")  # what the CLI printed before
    for header in ("model", "winner", "config"):
        plain.add_column(header)
    plain.add_row("llama-3.1-8b", "cpu_decode", "page_size=128,kv_splits=auto,prefetch=2" * 3)
    found = truncated_cells(plain, 40)
    assert any("column 'config'" in f and "…" in f for f in found), found
    folded = cli_table("folds, never cuts", ["winner", "config"])
    folded.add_row("cpu_decode", "page_size=128,kv_splits=auto,prefetch=2,isa=vec16,block_size=128")
    (split,) = truncated_cells(folded, 40)  # one word longer than the column: folded, and reported
    assert "…" not in render_text(folded, 40) and split.startswith("row 1, column 'config': 'page_size=128,")
    spaced = cli_table("words wrap whole", ["winner", "config"])
    spaced.add_row("cpu_decode", config_text({"page_size": 128, "kv_splits": "auto", "prefetch": 2}))
    assert truncated_cells(spaced, 32) == []  # "page_size=128" / "kv_splits=auto" / "prefetch=2"
    assert truncated_cells(spaced, 12) != []  # too narrow for the words: reported, never silently


def test_columns_share_the_width_word_by_word() -> None:
    # rich alone narrows the widest columns first and splits a backend's name although a long text
    # column could give way; the CLI's tables give every column its longest word first
    table = cli_table("t", ["backend", "gate", "note"])
    table.add_row(
        "vllm_cpu_fp8", "pass, lossy", "interpreted kernels: checked for correctness, never timed " * 2
    )
    assert truncated_cells(table, 40) == []
    assert config_text({}) == "-" and ms_text(None) == "—"
    assert [ms_text(x) for x in (0.04873, 692.3, 13290.4, 152884.6)] == [
        "0.04873",
        "692.3",
        "13290",
        "152885",
    ]


# -- tune ------------------------------------------------------------------------------------------------


def _tune_entries(*, dtypes: tuple[str, ...] = ("bf16",)) -> dict[str, dict[str, Any]]:
    """Results-table entries as ``tune`` writes them (:func:`summarize` over planted trials, re-timed
    interleaved), with real backends' names and configs: a switch to cpu_decode, a tie, the default
    winning, a long plugin config, and a bucket where nothing passed."""
    from attnbench.core.workload import Workload
    from attnbench.tables import CandidateResult
    from attnbench.tables.margin import Interval
    from attnbench.tuning import KeyResult, TuneOptions, backend_refs, plan_studies, summarize
    from attnbench.tuning.refine import PointMeasurement

    profile = stated_profile()
    cpu = {"page_size": 128, "kv_splits": "auto", "prefetch": 2}
    vllm = {"isa": "vec16", "block_size": 128, "kv_split": True}
    flash = ("flash", {"num_splits": 0})
    cpu = ("cpu_decode", {"page_size": 128, "kv_splits": "auto", "prefetch": 2})
    vllm = ("vllm_cpu_fp8", {"isa": "vec16", "block_size": 128, "kv_split": True})
    naive = ("naive", {})
    buckets = [  # batch, context, (candidate, measured ms or None: failed the gate)
        (1, 1024, [(flash, 692.3), (cpu, 701.2), (naive, 2335.9)]),
        (1, 4096, [(flash, 2127.6), (cpu, 1624.1), (naive, None)]),
        (8, 32768, [(flash, 54340.0), (cpu, 53100.5)]),
        (16, 65536, [(flash, 152884.6), (vllm, 98012.3)]),
        (64, 131072, [(flash, None), (naive, None)]),
    ]
    entries = {}
    for dtype in dtypes:
        for batch, context, steps in buckets:
            workload = Workload.uniform("llama-3.1-8b", batch=batch, context=context, dtype=dtype)
            (plan,) = plan_studies(
                [workload], backend_refs(only=["flash", "naive"]), profile=profile, options=TuneOptions()
            )
            records, times = [], {}
            for (backend, config), ms in steps:
                if ms is None:
                    why = "rel_l2 0.2 > bound 0.0098"
                    record = CandidateResult(
                        backend, config, failed="gate", reason=why, error={"rel_l2": 0.2}
                    )
                else:
                    record = CandidateResult(backend, config, step_ms=ms, gbps=6.42, pct_of_bandwidth=23.6)
                    times[record.candidate.label()] = Interval(ms, ms * 0.985, ms * 1.02, 45)
                records.append(record)
            result = KeyResult(plan, records)
            entry = summarize(result, profile=profile, retimed=PointMeasurement(times) if times else None)
            entries[result.key.row] = entry
    return entries


def test_tune_winners_fit_80_columns_with_the_model_and_dtype_in_the_title() -> None:
    from attnbench.cli.tune import summary_table

    entries = _tune_entries()
    table = summary_table(entries)
    text = _assert_readable(table)
    assert _headers(table) == ["batch", "context", "winner", "config", "step ms", "vs default"]
    assert str(table.title).startswith("tuned winners for llama-3.1-8b bf16: decode step, all layers")
    cells = _cells(table)
    assert (
        "page_size=128 kv_splits=auto prefetch=2" in cells
        and "isa=vec16 block_size=128 kv_split=True" in cells
    )
    assert {"1.31× faster", "1.56× faster", "default kept (tie)", "is the default", "none passed"} <= cells
    assert "98012" in cells and "152885" not in cells  # the winner's time; the default's is in --wide
    assert text.index(" 1024 ") < text.index(" 4096 ") < text.index(" 32768 ") < text.index(" 131072 ")
    # two dtypes: the dtype becomes a column, and it still fits
    mixed = summary_table(_tune_entries(dtypes=("bf16", "fp32")))
    assert _headers(mixed)[0] == "dtype" and "llama-3.1-8b" in str(mixed.title)
    _assert_readable(mixed)


def test_tune_wide_adds_the_runner_up_the_default_and_the_rest() -> None:
    from attnbench.cli.tune import summary_table

    table = summary_table(_tune_entries(), wide=True)
    extra = [
        "95% interval ms",
        "GB/s",
        "% BW",
        "runner-up",
        "default ms",
        "decision",
        "load",
        "failed",
        "trials",
    ]
    assert _headers(table) == [
        "model",
        "dtype",
        "batch",
        "context",
        "winner",
        "config",
        "step ms",
        "vs default",
        *extra,
    ]
    _assert_readable(table, 200)
    cells = _cells(table)
    assert "flash num_splits=0 (+31.0%)" in cells and "152885 [150591, 155942] n=45" in cells
    assert {"naive:gate", "flash:gate, naive:gate", "tie: default kept", "switched"} <= cells
    assert build_parser().parse_args(["tune", "-m", "llama-3.1-8b", "--wide"]).wide


# -- bench -----------------------------------------------------------------------------------------------


def _bench_report(*, dtypes: tuple[str, ...] = ("bf16",)) -> dict[str, Any]:
    """A report as ``bench`` builds it: one row per workload and backend (timed, lossy, unsupported,
    failed, checked only), speedups added by the command's own function."""
    from attnbench.cli.bench import _add_speedups

    def timed(backend: str, ms: float, *, lossy: str = "", predicted: float | None = None) -> dict[str, Any]:
        error = {"rel_l2": 4.5e-3, "max_abs": 1.7e-4, "cosine": 0.99999}
        gbps = kv_bytes / (ms / 1e3) / 1e9
        return {
            "status": "timed",
            "timed": True,
            "note": "",
            "check": {"passed": True, "error": error, "lossy": lossy},
            "step": {"median_s": ms / 1e3, "p90_s": ms * 1.07 / 1e3, "p10_s": ms * 0.97 / 1e3},
            "kv_bytes": kv_bytes,
            "gbps": gbps,
            "pct_of_bandwidth": 100 * gbps / 27.2,
            "pct_of_read": 100 * gbps / 25.1,
            "roofline": {"bound": "memory", "x_floor": 27.2 / gbps},
            "model": {"step_s": predicted / 1e3, "fit": "f", "measured_over_model": ms / predicted}
            if predicted
            else None,
            "layers_materialised": 4,
            "num_layers": 4,
        }

    rows = []
    for dtype in dtypes:
        for batch, context in ((1, 1024), (8, 32768), (64, 131072)):
            scale = batch * context / 1024  # step times grow with the KV bytes a step reads
            kv_bytes = 16.9e6 * scale  # llama-3.1-8b, 4 layers (--layers 4)
            base = {"dtype": dtype, "batch": batch, "context": context}
            base["workload"] = f"llama-3.1-8b b={batch} ctx={context} {dtype} cpu"
            planted = [
                base | {"backend": "naive", "implementation": "torch.matmul"} | timed("naive", 6.18 * scale),
                base | {"backend": "flash"} | timed("flash", 29.48 * scale, predicted=28.1 * scale),
                base
                | {"backend": "fp8"}
                | timed("fp8", 19.47 * scale, lossy="fp8 e4m3 K/V, per-token scales"),
                base | {"backend": "cpu_decode"} | timed("cpu_decode", 2.61 * scale),
                base | {"backend": "vllm_cpu_fp8"} | timed("vllm_cpu_fp8", 2.285 * scale, lossy="fp8_e4m3"),
                base | {"backend": "matmul_probe"} | timed("matmul_probe", 3.72 * scale),
                base
                | {
                    "backend": "mla",
                    "status": "unsupported",
                    "reasons": [
                        "model 'llama-3.1-8b' is not MLA (no kv_lora_rank); mla needs the latent form"
                    ],
                },
                base
                | {
                    "backend": "triton_paged",
                    "status": "checked-only",
                    "timed": False,
                    "note": "interpreted kernels: checked for correctness, never timed",
                    "check": {"passed": True, "error": {"rel_l2": 3.1e-3, "max_abs": 2.2e-4}},
                },
                base
                | {
                    "backend": "vllm_cpu",
                    "status": "failed-check",
                    "check": {"passed": False, "error": {"rel_l2": 0.21, "max_abs": 1.3}},
                    "reasons": ["rel_l2 0.21 > 0.0098 (2 × calibration)"],
                },
            ]
            rows += planted
    _add_speedups(rows)
    device = {"fingerprint": {"name": DEVICE, "threads": 16}, "copy_bandwidth": 27.2e9, "id": "7b1cff807d1d"}
    return {"device": device, "results": rows}


@pytest.mark.parametrize("dtypes", [("bf16",), ("bf16", "fp32")], ids=["one dtype", "two dtypes"])
def test_bench_table_fits_80_columns(dtypes: tuple[str, ...]) -> None:
    from attnbench.cli.bench import _table, _untimed_notes

    report = _bench_report(dtypes=dtypes)
    table = _table(report, wide=False)
    text = _assert_readable(table)
    lead = ["dtype"] if len(dtypes) > 1 else []
    assert _headers(table) == [
        *lead,
        "batch",
        "context",
        "backend",
        "gate",
        "p50 ms",
        "GB/s",
        "% BW",
        "× naive",
    ]
    assert "measured decode step" in str(table.title) and DEVICE in str(table.title)
    assert ("llama-3.1-8b bf16:" in str(table.title)) == (len(dtypes) == 1)
    assert {"vllm_cpu_fp8", "matmul_probe", "cannot run", "not timed", "FAIL", "pass, lossy"} <= _cells(table)
    assert "vllm_cpu_fp8" in text and "matmul_probe" in text  # whole, on one line
    notes = _untimed_notes(report)
    assert notes[0].startswith("mla: cannot run: model 'llama-3.1-8b' is not MLA") and len(notes) == 3


def test_bench_wide_adds_the_error_numbers_the_roofline_and_the_prediction() -> None:
    from attnbench.cli.bench import _table

    report = _bench_report()
    wide = _table(report, wide=True)
    for column in ("rel_l2", "max_abs", "p90 ms", "KV MB/step", "% read", "bound", "× floor", "predicted ms"):
        assert column in _headers(wide)
    _assert_readable(wide, 200)
    assert {"pass, lossy (fp8 e4m3 K/V, per-token scales)", "4/4", "memory", "1.05"} <= _cells(wide)
    assert build_parser().parse_args(["bench", "-m", "llama-3.1-8b", "--wide"]).wide


# -- backends --------------------------------------------------------------------------------------------

VLLM = "plugin 'vllm' (attnbench-vllm 0.1.0)"
BACKENDS = [  # as `attnbench backends --model llama-3.1-8b --json` lists them on a CPU with the vLLM plugin
    ("naive", "built-in", "torch.matmul", []),
    ("flash", "built-in", "torch.sdpa[flash]", []),
    ("mla", "built-in", "unavailable", ["model 'llama-3.1-8b' is not MLA (no kv_lora_rank); mla needs the latent form"]),
    ("triton_paged", "built-in", "triton", ["Triton kernels run on the CPU only in the interpreter: set TRITON_INTERPRET=1 before importing triton"]),
    ("cpu_decode", "built-in", "cpu_decode.c[avx512-bf16]", []),
    ("vllm_cpu", VLLM, "vllm 0.32.0 cpu_attention_with_kv_cache[auto: vec (AVX-512 + BF16, vllm._C)]", []),
    ("vllm_cpu_fp8", VLLM, "vllm 0.32.0 cpu_attention_with_kv_cache[auto: vec (AVX-512 + BF16, vllm._C), fp8_e4m3 cache]", []),
]  # fmt: skip


def _backend_rows() -> list[dict[str, Any]]:
    from attnbench.core.registry import load_registry

    reg = load_registry(env={"ATTNBENCH_DISABLE_PLUGIN_AUTOLOAD": "1"})  # built-ins' real descriptions
    rows = []
    for name, source, implementation, reasons in BACKENDS:
        cls = reg.get(name).__class__ if name in reg.names() else None
        rows.append(
            {
                "name": name,
                "source": source,
                "description": cls.description if cls else "vLLM's CPU attention kernels (cpu_attention_with_kv_cache) on vLLM's paged cache",
                "tunables": {t.name: list(t.choices) for t in cls.tunables} if cls else {"isa": ["auto", "amx", "vec", "vec16"], "block_size": [32, 64, 128]},
                "implementation": implementation,
                "runnable": not reasons,
                "reasons": reasons,
                "interpreted": False,
            }
        )  # fmt: skip
    return rows


def test_backends_tables_fit_80_columns() -> None:
    from attnbench.cli.backends import backends_table

    rows = _backend_rows()
    listing = backends_table(rows)
    _assert_readable(listing)
    assert _headers(listing) == ["name", "source", "description"]
    for_workload = backends_table(rows, workload="llama-3.1-8b b=1 ctx=4096 bf16 cpu")
    text = _assert_readable(for_workload)
    assert _headers(for_workload) == ["name", "source", "status"]
    cells = _cells(for_workload)
    assert "runnable: torch.sdpa[flash]" in cells and "built-in" in cells and VLLM in cells
    assert (
        "cannot run: Triton kernels run on the CPU only in the interpreter: set TRITON_INTERPRET=1 before importing triton"
        in cells
    )
    assert "cpu_attention_with_kv_cache[auto:" in text  # the longest word, whole on one line


def test_backends_wide_adds_the_tunables_and_the_implementation() -> None:
    from attnbench.cli.backends import backends_table

    rows = _backend_rows()
    assert _headers(backends_table(rows, wide=True)) == ["name", "source", "description", "tunables"]
    _assert_readable(backends_table(rows, wide=True), 200)
    assert any("page_size∈[16, 32, 64, 128]" in c for c in _cells(backends_table(rows, wide=True)))
    wide = backends_table(rows, workload="llama-3.1-8b b=1 ctx=4096 bf16 cpu", wide=True)
    assert _headers(wide) == ["name", "source", "implementation", "status"]
    _assert_readable(wide, 200)
    assert build_parser().parse_args(["backends", "--wide"]).wide


# -- calibrate, decode, estimate -------------------------------------------------------------------------


def test_calibrate_table_fits_80_columns_and_wide_adds_the_points() -> None:
    from attnbench.cli.calibrate import calibration_table
    from attnbench.cost.fit import Calibration, Fit

    def fit(backend: str, dtype: str, geometry: str | None, t0: float, bw: float) -> Fit:
        return Fit(backend, dtype, geometry, t0, 1.16e-4, 1 / bw, 6, 63.5, 0.0351, 0.0565)

    cal = Calibration(
        device={},
        fits=[
            fit("flash", "bf16", None, 3.85e-4, 1.01e9),
            fit("triton_paged", "bf16", "expanded:q64/kv8/d128+128", 9.2e-6, 3.1e12),
            fit("mla", "bf16", "latent:q128/kv1/d576+512", 4.35e-4, 1.03e9),
            fit("vllm_cpu_fp8", "fp32", "expanded:q32/kv8/d128+128", 1.39e-4, float("inf")),
            Fit("flash", "fp32", None, 1.7e-4, 0.0, 1 / 8.6e9, 16, 256.0, 0.154, 0.3, 28.4e-12, 6e6),
        ],
        points=[],
    )
    table = calibration_table(cal, device=DEVICE)
    _assert_readable(table)
    assert _headers(table)[-1] == "rms error" and "points" not in _headers(table)
    assert {"expanded q64/kv8 d128+128", "all", "3100", "inf", "116", "3.5%"} <= _cells(table)
    wide = calibration_table(cal, device=DEVICE, wide=True)
    assert _headers(wide)[-4:] == ["points", "span", "rms error", "max error"]
    _assert_readable(wide, 140)
    assert {"expanded:q64/kv8/d128+128", "64×", "5.7%", "5.72", "28.4", "-"} <= _cells(wide)


def test_decode_table_fits_80_columns() -> None:
    from attnbench.cli.decode import decode_table

    report = {
        "model": "llama-3.1-8b",
        "model_kind": "synthetic attention-only",
        "num_layers": 32,
        "backend": "cpu_decode",
        "implementation": "cpu_decode.c[avx512-bf16]",
        "dtype": "bf16",
        "batch": 8,
        "prompt_len": 32768,
        "new_tokens": 64,
        "decode_steps": 63,
        "check": {"error": {"rel_l2": 3.1e-3, "max_abs": 2.2e-4, "cosine": 0.999995}},
        "ttft_s": 41.2,
        "itl_p50_s": 1.624,
        "itl_p90_s": 1.702,
        "itl_mean_s": 1.641,
        "e2e_s": 144.9,
        "e2e_check_s": 144.583,
        "e2e_ratio": 1.0022,
        "e2e_ratio_p50": 1.0102,
        "e2e_within_10pct": True,
        "kv_bytes_per_step": 34.36e9,
        "gbps": 21.16,
        "pct_of_bandwidth": 77.8,
        "device": {"copy_bandwidth": 27.2e9},
    }
    table = decode_table(report)
    _assert_readable(table)
    assert (
        str(table.title).startswith("measured: llama-3.1-8b")
        and "TTFT + 63·ITL mean" in table.columns[0].cells
    )


@pytest.mark.parametrize(
    "args",
    [
        dict(model="llama-3.3-70b", gpu="h100", tp=2, batch=1, context=8192, new_tokens=250),
        dict(
            model="deepseek-v3", gpu="h200", tp=8, batch=32, context=16384, new_tokens=250, weight_dtype="fp8"
        ),
    ],
    ids=["llama-70b", "deepseek-v3"],
)
def test_estimate_table_fits_80_columns(args: dict[str, Any]) -> None:
    from attnbench.cli.estimate import render
    from attnbench.cost.estimate import estimate

    args = dict(args)
    table = render(estimate(args.pop("model"), **args))
    _assert_readable(table)
    assert "KV overtakes weights" in _cells(table)


def test_the_commands_print_no_ellipsis_at_80_columns(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    argv = ["estimate", "--model", "llama-3.3-70b", "--gpu", "h100", "--tp", "2", "-c", "8k", "-n", "250"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith(("┃", "│", "┏", "└"))]
    assert table and all(len(line) <= 80 for line in table) and "…" not in out


def test_vs_default_says_where_the_defaults_time_comes_from() -> None:
    """A default far behind keeps its study time (not re-timed: ``(study)``); a pruned default its
    running median when the pruner stopped it (``(default pruned)``), never "default failed"."""
    from types import SimpleNamespace

    from attnbench.cli.tune import _versus_default
    from attnbench.tables.table_schema import CandidateResult

    winner = CandidateResult("cpu_decode", {"page_size": 128}, step_ms=5.0, retimed=True)
    studied = CandidateResult("flash", {"num_splits": 0}, step_ms=150.0)
    pruned = CandidateResult("flash", {"num_splits": 0}, failed="pruned", study_ms=100.0)
    gated = CandidateResult("flash", {"num_splits": 0}, failed="gate")
    retimed = CandidateResult("flash", {"num_splits": 0}, step_ms=6.0, retimed=True)

    def vs(default: CandidateResult) -> str:
        return _versus_default(SimpleNamespace(winner=winner, default=default, tie=False))  # type: ignore[arg-type]

    assert vs(studied) == "30.00× faster (study)"
    assert vs(pruned) == "20.00× faster (default pruned)"
    assert vs(gated) == "default failed"
    assert vs(retimed) == "1.20× faster"
