"""attnbench e2e: a real (tiny) Hugging Face decoder through stock paths and backends — the rows, the
token comparison, the timers around attention, the saved report and the table at 80 columns."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from attnbench.cli import main
from attnbench.cli.common import truncated_cells
from attnbench.cli.e2e import e2e_table
from attnbench.measure.e2e import (
    GenerationPath,
    PathRun,
    compare_tokens,
    load_hf_model,
    parse_path,
    run_path,
    run_paths,
    timed_attention,
)


def test_parse_path() -> None:
    assert parse_path("sdpa", backends=["naive"]) == GenerationPath("sdpa")
    p = parse_path("cpu_decode[page_size=64,kv_splits=auto]", backends=["cpu_decode"])
    assert p.backend == "cpu_decode" and p.config_dict == {"page_size": 64, "kv_splits": "auto"}
    with pytest.raises(ValueError, match=r"unknown path or backend 'flsh'; accepted: sdpa, sdpa-static"):
        parse_path("flsh", backends=["naive", "flash"])
    with pytest.raises(ValueError, match="is not key=value"):
        parse_path("naive[oops]", backends=["naive"])


def test_paths_give_transformers_tokens_and_time_attention() -> None:
    """fp32: every path's greedy tokens equal transformers' sdpa path; attention is timed inside the
    steps (a share in (0, 1)); the registered attention functions are restored afterwards."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model, _ = load_hf_model("tiny-qwen2", dtype=torch.float32)
    before = ALL_ATTENTION_FUNCTIONS["sdpa"]
    prompt = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(3))
    runs = [
        run_path(model, parse_path(p, backends=["naive", "cpu_decode"]), prompt=prompt, new_tokens=5)
        for p in ("sdpa", "sdpa-static", "naive", "cpu_decode")
    ]
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is before
    assert model.config._attn_implementation == "sdpa"
    for r in runs[1:]:
        compare_tokens(r, runs[0])
        assert r.tokens_match, (r.path, r.first_mismatch)
    for r in runs:
        assert len(r.itl_s) == 4 and len(r.attention_s) == 4 and len(r.tokens[0]) == 5
        assert 0 < r.attention_share < 1, (r.path, r.attention_share)
        assert r.e2e_s == pytest.approx(r.ttft_s + sum(r.itl_s))
        assert PathRun.from_dict(r.to_dict()) == r


def test_decode_steps_interleave_and_match_the_paths_run_alone(monkeypatch) -> None:
    """run_paths: every path prefilled, then step i of every path (rotated order) before step i+1 of
    any; two backends alternate on one model; the tokens and attention timers equal each path alone."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import attnbench.measure.e2e as e2e

    model, _ = load_hf_model("tiny-qwen2", dtype=torch.float32)
    before = ALL_ATTENTION_FUNCTIONS["sdpa"]
    prompt = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(5))
    paths = [parse_path(p, backends=["naive", "cpu_decode"]) for p in ("sdpa", "naive", "cpu_decode")]
    order: list[tuple[str, int]] = []
    step = e2e._decode_step

    def logged(model, run, sink):  # type: ignore[no-untyped-def]
        if run.new_tokens > 2:  # not the warm-up
            order.append((run.session.path.name, len(run.itl) + 1))
        step(model, run, sink)

    monkeypatch.setattr(e2e, "_decode_step", logged)
    runs, failed = run_paths(model, paths, prompt=prompt, new_tokens=5)
    assert failed == [] and [r.path for r in runs] == ["sdpa", "naive", "cpu_decode"]
    assert order == [
        ("sdpa", 1), ("naive", 1), ("cpu_decode", 1),
        ("naive", 2), ("cpu_decode", 2), ("sdpa", 2),
        ("cpu_decode", 3), ("sdpa", 3), ("naive", 3),
        ("sdpa", 4), ("naive", 4), ("cpu_decode", 4),
    ]  # fmt: skip
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is before and model.config._attn_implementation == "sdpa"
    monkeypatch.setattr(e2e, "_decode_step", step)
    for r in runs:
        alone = run_path(
            model, parse_path(r.path, backends=["naive", "cpu_decode"]), prompt=prompt, new_tokens=5
        )
        assert r.tokens == alone.tokens, r.path
        assert len(r.attention_s) == 4 and all(a > 0 for a in r.attention_s), r.path
        assert 0 < r.attention_share < 1


def test_a_gate_failure_is_returned_and_the_others_run() -> None:
    model, _ = load_hf_model("tiny-qwen2", dtype=torch.float32)
    prompt = torch.randint(0, 512, (1, 8))

    def gate(backend, config):  # type: ignore[no-untyped-def]
        if backend.name == "naive":
            raise RuntimeError("naive failed the gate")
        return "pass"

    paths = [parse_path(p, backends=["naive", "cpu_decode"]) for p in ("sdpa", "naive", "cpu_decode")]
    runs, failed = run_paths(model, paths, prompt=prompt, new_tokens=3, gate=gate)
    assert [r.path for r in runs] == ["sdpa", "cpu_decode"] and runs[1].gate == "pass"
    assert [(p.name, str(e)) for p, e in failed] == [("naive", "naive failed the gate")]


def test_a_gate_failure_stops_the_path() -> None:
    model, _ = load_hf_model("tiny-qwen2", dtype=torch.float32)
    prompt = torch.randint(0, 512, (1, 8))

    def failing_gate(backend, config):
        raise RuntimeError(f"{backend.name} failed the gate")

    with pytest.raises(RuntimeError, match="naive failed the gate"):
        run_path(
            model, parse_path("naive", backends=["naive"]), prompt=prompt, new_tokens=2, gate=failing_gate
        )
    assert model.config._attn_implementation == "sdpa"


def test_timed_attention_accumulates() -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sink = [0.0]
    with timed_attention("sdpa", sink):
        fn = ALL_ATTENTION_FUNCTIONS["sdpa"]
        q = torch.randn(1, 2, 4, 8)
        module = torch.nn.Module()
        module.is_causal = True
        fn(module, q, q, q, None)
    assert sink[0] > 0


def test_cli_json_save_and_table(tmp_path, capsys, monkeypatch) -> None:
    """The command end to end on a tiny model: gated backends, JSON rows saved, a table at 80 columns."""
    monkeypatch.setenv("COLUMNS", "80")
    save = tmp_path / "run"
    argv = [
        "e2e", "--model", "tiny-qwen2", "--batch", "1,2", "--prompt", "24", "--new-tokens", "4",
        "--dtype", "fp32", "--threads", "1", "--paths", "sdpa,sdpa-static,naive,cpu_decode", "--no-predict",
        "--save", str(save),
    ]  # fmt: skip
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["rows"]) == 8 and report["new_tokens"] == 4
    backends = [r for r in report["rows"] if not r["stock"]]
    assert all(r["gate"] and "pass" in r["gate"] for r in backends)
    assert all(r["tokens_match"] for r in backends)
    assert {s["best_backend"] for s in report["summary"]} <= {"naive", "cpu_decode"}
    saved = json.loads(save.with_suffix(".json").read_text())
    assert (
        saved["rows"] == report["rows"] and "| batch | prompt | path" in save.with_suffix(".md").read_text()
    )
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "cpu_decode" in text and "sdpa-static" in text
    assert max(len(line) for line in text.splitlines()) <= 80
    for wide in (False, True):
        assert truncated_cells(e2e_table(report, wide=wide), width=80 if not wide else 140) == []


def test_cli_refuses_bad_input(capsys) -> None:
    assert main(["e2e", "--model", "tiny-qwen2", "--new-tokens", "1"]) == 2
    assert "--new-tokens '1' must be ≥ 2" in capsys.readouterr().err
    assert main(["e2e", "--model", "tiny-qwen2", "--paths", "naive"]) == 2
    assert "name at least one stock path" in capsys.readouterr().err
    assert main(["e2e", "--model", "no-such-model"]) == 2
    assert "not a checkpoint directory, a config.json or an architecture preset" in capsys.readouterr().err


def test_cli_a_backend_failing_the_gate_is_reported_not_timed(capsys, monkeypatch) -> None:
    """A candidate that fails the correctness gate is listed with the reason and never timed; the
    command goes on with the other paths (no traceback)."""
    import attnbench.cli.e2e
    from attnbench.correctness.gate import check as real_check

    def wrong(backend, workload, **kw):
        result = real_check(backend, workload, **kw)
        return (
            result
            if backend.name != "naive"
            else real_check(
                backend, workload, multiple=1e-30, **{k: v for k, v in kw.items() if k != "multiple"}
            )
        )

    monkeypatch.setattr(attnbench.cli.e2e, "check", wrong)  # where e2e's gate calls it
    argv = ["e2e", "--model", "tiny-qwen2", "--prompt", "16", "--new-tokens", "3", "--dtype", "fp32",
            "--threads", "1", "--paths", "sdpa,naive,cpu_decode", "--no-predict", "--json"]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["path"] for r in report["rows"]] == ["sdpa", "cpu_decode"]
    (failed,) = report["failed"]
    assert failed["path"] == "naive" and "failed the correctness gate" in failed["reason"]
