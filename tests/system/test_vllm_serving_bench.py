"""scripts/vllm_serving_bench.py without vLLM: its points are checked before anything runs, and its
report marks an ITL that the runs' spread does not resolve."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from helpers.script_module import load_script, refusal

ROOT = Path(__file__).resolve().parents[2]


def test_points_are_checked_and_named() -> None:
    bench = load_script("vllm_serving_bench")
    assert bench._points("1x1024, 4x8192") == [(1, 1024), (4, 8192)]
    for bad in ("1024", "0x1024", "ax8"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"point {bad!r}"):
            bench._point(bad)


def test_an_itl_the_runs_spread_swamps_is_marked_unresolved() -> None:
    bench = load_script("vllm_serving_bench")

    def runs(one: list[float], many: list[float]) -> dict:
        return {"itl1": {"latencies_s": one, "median_s": sorted(one)[1]}, "itlN": {"latencies_s": many, "median_s": sorted(many)[1], "attnbench": "x"}}  # fmt: skip

    row = {
        "batch": 1, "input_len": 8192, "steps": 32, "vllm_ttft_s": 10.0, "attnbench_ttft_s": 10.0, "ttft_ratio": 1.0,
        "runs": {"vllm": runs([0.5, 0.51, 0.52], [3.7, 3.7, 3.71]), "attnbench": runs([0.0, 0.5, 1.0], [2.6, 3.6, 4.6])},
    }  # fmt: skip
    row["vllm_itl_ms"], row["attnbench_itl_ms"], row["itl_ratio"] = 99.7, 96.9, 0.972
    report = {"command": "c", "machine": "m", "cpus": 2, "date": "d", "load_before": [0, 0, 0], "load_after": [0, 0, 0], "model": "q", "rows": [row]}  # fmt: skip
    text = bench.render(report)
    assert "unresolved (0.97 of medians)" in text
    row["runs"]["attnbench"] = runs([0.5, 0.51, 0.52], [3.6, 3.6, 3.61])
    assert "| 0.972 |" in bench.render(report)
    del row["ttft_ratio"]  # an ITL-only point (--no-ttft)
    assert "| — | — | not measured |" in bench.render(report)


def test_the_committed_report_is_what_its_json_renders() -> None:
    bench = load_script("vllm_serving_bench")
    path = ROOT / "results" / "engines" / "vllm-serving-bench-epyc-avx512.json"
    assert path.with_suffix(".md").read_text() == bench.render(json.loads(path.read_text()))


def test_the_attention_share_report_predicts_from_the_side_by_side(tmp_path: Path) -> None:
    share = load_script("vllm_attention_share")
    bench = {"results": [
        {"batch": 1, "context": 8192, "backend": "cpu_decode", "step": {"median_s": 0.004}},
        {"batch": 1, "context": 8192, "backend": "vllm_cpu", "step": {"median_s": 0.010}},
        {"batch": 4, "context": 8192, "backend": "cpu_decode", "step": None},
    ]}  # fmt: skip
    path = tmp_path / "sbs.json"
    path.write_text(json.dumps(bench))
    assert share._side_by_side(str(path)) == {(1, 8192): 2.5}
    runs = {
        "vllm": {"step_ms": 100.0, "attention_ms": 20.0, "share": 0.2, "threads": 1, "affinity": [1]},
        "attnbench": {"step_ms": 88.0, "attention_ms": 8.0, "share": 8 / 88, "threads": 1, "affinity": [1]},
    }
    row = {"batch": 1, "input_len": 8192, "runs": runs, "side_by_side_ratio": 2.5}
    row["predicted_step_ms"] = 100.0 * (1 - 0.2 + 0.2 / 2.5)
    row["measured_over_predicted"] = 88.0 / row["predicted_step_ms"]
    report = {"command": "c", "machine": "m", "cpus": 2, "date": "d", "load_before": [0, 0, 0],
              "load_after": [0, 0, 0], "model": "q", "steps": 32, "rows": [row]}  # fmt: skip
    text = share.render(report)
    assert (
        "| 1 | 8192 | 100.0 | 20.0 (20 %) | 88.0 | 8.0 (9 %) | 0.880 | 0.400 | 2.50 | 88.0 | 1.000 |" in text
    )
    assert "the model's worker process: 1 torch thread(s), CPUs [1]" in text


def test_the_serve_benchmarks_stand_in_tokenizer_round_trips_every_id(tmp_path: Path) -> None:
    """vLLM's benchmark samples token ids, decodes them to text and the server encodes it again: every id
    must come back as itself, in few characters (vLLM refuses > ~7 characters a token unread)."""
    serve = load_script("vllm_serve_bench")
    words = [serve.word(i) for i in range(151936)]
    assert len(set(words)) == len(words) and max(map(len, words)) == 3
    pytest.importorskip("transformers", reason="the test extra installs transformers")
    from transformers import AutoTokenizer

    serve.write_tokenizer(tmp_path / "tok", 151936, 151643)
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    ids = [*range(1, 300), *range(151000, 151643), *range(151644, 151936), 61, 62, 3843, 3844]
    text = tok.decode(ids)
    assert tok(text, add_special_tokens=False).input_ids == ids
    assert len(text) < 5 * len(ids)
    assert tok.eos_token_id == 151643


def test_the_serve_report_states_the_ratio_and_the_prediction() -> None:
    serve = load_script("vllm_serve_bench")

    def run(tok_s: float, share: float) -> dict:
        fill = {"duration": 900.0, "output_throughput": 0.018, "mean_ttft_ms": 5e5, "failed": 0}
        decode = {"duration": 1024 / tok_s, "output_throughput": tok_s, "median_tpot_ms": 16000 / tok_s, "median_itl_ms": 16000 / tok_s, "mean_ttft_ms": 900.0, "failed": 0, "attention_share": share}  # fmt: skip
        return {
            "fill": fill,
            "decode": [decode, decode],
            "attnbench": "24 of 24 attention layers on cpu_decode",
        }

    row = {"prompts": 16, "input_len": 8193, "output_len": 64, "paths": {"vllm": run(40.0, 0.8), "attnbench": run(80.0, 0.6)}}  # fmt: skip
    row |= {"ratio": 2.0, "fill_ratio": 1.0, "vllm_share": 0.8, "side_by_side_ratio": 2.66, "predicted_ratio": 1.98, "measured_over_predicted": 1.01}  # fmt: skip
    report = {"command": "c", "machine": "m", "cpus": 2, "date": "d", "load_before": [0, 0, 0], "load_after": [0, 0, 0], "model": "q", "rows": [row]}  # fmt: skip
    text = serve.render(report)
    assert "**2.000**" in text and "measured / predicted 1.010" in text
    assert "| vllm | decode 2 | 25.6 | 40.00 |" in text


def test_the_itl_plot_reads_both_scripts_reports(tmp_path: Path) -> None:
    plot = load_script("plot_vllm_itl")
    latency = {"command": "python scripts/vllm_serving_bench.py --points 1x1024", "rows": [{"batch": 1, "input_len": 1024, "steps": 32, "runs": {
        "vllm": {"itl1": {"median_s": 0.5}, "itlN": {"median_s": 2.74}},
        "attnbench": {"itl1": {"median_s": 0.5}, "itlN": {"median_s": 2.58}},
    }}]}  # fmt: skip
    share = {"command": "python scripts/vllm_attention_share.py --points 1x32640,4x8192", "rows": [
        {"batch": 1, "input_len": 32640, "runs": {"vllm": {"step_ms": 139.6}, "attnbench": {"step_ms": 110.0}}},
        {"batch": 4, "input_len": 8192, "runs": {"vllm": {"step_ms": 123.0}, "attnbench": {"step_ms": 84.4}}},
    ]}  # fmt: skip
    files = []
    for name, report in (("latency", latency), ("share", share)):
        files.append(tmp_path / f"{name}.json")
        files[-1].write_text(json.dumps(report))
    found = sorted(pt for f in files for pt in plot.points(f, 1))
    assert found == [
        ("latency", 1024, "attnbench", pytest.approx(65.0)),
        ("latency", 1024, "vllm", pytest.approx(70.0)),
        ("share", 32640, "attnbench", 110.0),
        ("share", 32640, "vllm", 139.6),
    ]
    assert "no row at batch 8" in refusal(
        "plot_vllm_itl", [*map(str, files), "--batch", "8", "--out", "x.png"]
    )
    assert "no such report" in refusal("plot_vllm_itl", [str(tmp_path / "none.json"), "--out", "x.png"])
    (tmp_path / "other.json").write_text(json.dumps({"results": []}))
    assert "not a report of" in refusal("plot_vllm_itl", [str(tmp_path / "other.json"), "--out", "x.png"])


def test_the_itl_plot_is_drawn(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plot extra (pip install -e '.[plot]')")
    plot = load_script("plot_vllm_itl")
    share = {"command": "python scripts/vllm_attention_share.py", "rows": [
        {"batch": 1, "input_len": c, "runs": {"vllm": {"step_ms": 80.0 + c / 500}, "attnbench": {"step_ms": 70.0 + c / 1000}}}
        for c in (1024, 8192, 32640)
    ]}  # fmt: skip
    (tmp_path / "share.json").write_text(json.dumps(share))
    assert plot.main([str(tmp_path / "share.json"), "--out", str(tmp_path / "itl.png")]) == 0
    assert (tmp_path / "itl.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _mix_report(runs: dict) -> dict:
    """A saved ``attention_gemv_mix`` report of one point (1 × 32640) with these runs."""
    return {"command": "c", "machine": "m", "cpus": 2, "date": "d", "load_before": [0, 0, 0], "load_after": [0, 0, 0], "model": "q", "steps": 8,
            "rows": [{"batch": 1, "context": 32640, "runs": runs}]}  # fmt: skip


def test_the_gemv_mix_report_shows_what_the_kernel_adds_to_the_gemvs() -> None:
    mix = load_script("attention_gemv_mix")
    runs = {
        "gemv only": {"gemv_ms": 100.0, "attention_ms": 0.0},
        "plain:seq:2": {"gemv_ms": 103.5, "attention_ms": 31.0},
    }
    text = mix.render(_mix_report(runs))
    assert "| 1 × 32640 | plain:seq:2 | 103.5 | +3.5 | 31.0 |" in text
    assert "| 1 × 32640 | gemv only | 100.0 | — | — |" in text


def test_the_gemv_mix_report_gives_the_kernels_ratio_in_a_steps_conditions() -> None:
    mix = load_script("attention_gemv_mix")
    runs = {
        "gemv only": {"gemv_ms": 100.0, "attention_ms": 0.0},
        "huge:rand:2": {"gemv_ms": 101.0, "attention_ms": 31.0},
        "vllm": {"gemv_ms": 101.5, "attention_ms": 72.2},
    }
    text = mix.render(_mix_report(runs))
    assert "| 1 × 32640 | vllm | 101.5 | +1.5 | 72.2 |" in text
    assert "vLLM's kernel / cpu_decode (huge:rand:2) in these conditions: 1 × 32640: 2.33" in text
    del runs["vllm"]
    assert "in these conditions" not in mix.render(_mix_report(runs))
