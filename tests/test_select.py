"""attnbench.select(): tuned tables (nearest bucket), the roofline heuristic, refusals, the CLI."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest

import attnbench
from attnbench.cli import main
from attnbench.device import DeviceProfile, fingerprint
from attnbench.tuning import (
    Candidate,
    DeviceMismatchError,
    KeyResult,
    ResultsTable,
    TrialRecord,
    TuneOptions,
    backend_refs,
    plan_studies,
    summarize,
    table_path,
)
from attnbench.workload import Workload


def _profile(**changes) -> DeviceProfile:
    return DeviceProfile(fingerprint("cpu") | changes, 2e10, 2e10, 1, datetime.now(timezone.utc).isoformat())


def _entry(
    workload: Workload, *, flash: float | None, naive: float | None, profile: DeviceProfile
) -> tuple[str, dict]:
    (plan,) = plan_studies(
        [workload], backend_refs(only=["naive", "flash"]), profile=profile, options=TuneOptions()
    )
    recs = []
    for n, (name, value) in enumerate((("flash", flash), ("naive", naive))):
        cfg = plan.space.backends[name].cls.default_config()
        kind = "" if value is not None else "gate"
        recs.append(
            TrialRecord(n, Candidate(name, cfg), value is not None, value, kind, "planted gate failure", {})
        )
    return plan.key.row, summarize(KeyResult(plan, recs), profile=profile)


def _table(tmp_path, rows: list[tuple[str, dict]], profile: DeviceProfile | None = None):
    profile = profile or _profile()
    path = table_path(tmp_path, profile.fingerprint)
    ResultsTable(path, {}).save(dict(rows), profile=profile)
    return path


def test_select_uses_the_nearest_tuned_bucket(tmp_path):
    p = _profile()
    _table(
        tmp_path,
        [
            _entry(Workload.uniform("tiny-gqa", batch=1, context=1024), flash=1e-3, naive=3e-3, profile=p),
            _entry(Workload.uniform("tiny-gqa", batch=8, context=8192), flash=9e-3, naive=4e-3, profile=p),
        ],
    )
    choice = attnbench.select(model="tiny-gqa", batch=6, context=7000, dtype="bf16", results_dir=tmp_path)
    assert choice.source == "tuned" and choice.backend == "naive" and choice.config == {}
    assert choice.tuned_key.endswith("/bf16/b8/ctx8192") and choice.step_ms == pytest.approx(4.0)
    near = attnbench.select(model="tiny-gqa", batch=1, context=900, results_dir=tmp_path)
    assert near.backend == "flash" and near.distance_octaves == pytest.approx(
        abs(__import__("math").log2(1024 / 900))
    )
    text = choice.explain()
    assert "chosen: naive" in text and "measured:" in text and "flash" in text and "slower" in text
    assert choice.build().name == "naive"


def test_a_gate_failed_candidate_is_never_chosen(tmp_path):
    p = _profile()
    _table(
        tmp_path,
        [_entry(Workload.uniform("tiny-gqa", batch=1, context=64), flash=None, naive=5e-3, profile=p)],
    )
    tuned = attnbench.select(model="tiny-gqa", batch=1, context=64, results_dir=tmp_path)
    assert tuned.backend == "naive"
    assert any(r.backend == "flash" and "failed when tuned (gate)" in r.reason for r in tuned.rejected)
    # the heuristic for an untuned model on the same device and dtype also avoids it
    other = attnbench.select(model="mistral-7b", batch=1, context=64, results_dir=tmp_path, bandwidth=1e10)
    assert other.source == "heuristic" and other.backend == "naive"
    assert any(r.backend == "flash" and "correctness gate" in r.reason for r in other.rejected)


def test_the_heuristic_answers_when_nothing_is_tuned(tmp_path):
    choice = attnbench.select(
        model="llama-3.1-8b", batch=8, context="8k", dtype="bf16", results_dir=tmp_path, bandwidth=1e10
    )
    assert choice.source == "heuristic" and choice.backend == "flash"  # equal KV bytes: the default order
    kv = Workload.uniform("llama-3.1-8b", batch=8, context=8192).kv_bytes_per_step()
    assert choice.estimate_ms == pytest.approx(kv / 1e10 * 1e3)
    assert "roofline" in choice.explain() and "naive: same KV bytes" in choice.explain()


def test_another_devices_table_is_refused(tmp_path):
    other = _profile(name="Another Machine")
    path = _table(
        tmp_path,
        [_entry(Workload.uniform("tiny-gqa", batch=1, context=64), flash=1e-3, naive=2e-3, profile=other)],
        other,
    )
    with pytest.raises(DeviceMismatchError, match="Refusing"):
        attnbench.select(model="tiny-gqa", batch=1, context=64, table=path)


def test_select_needs_a_workload_or_its_parts():
    with pytest.raises(ValueError, match="missing: batch, context"):
        attnbench.select(model="tiny-gqa")


def test_cli_tune_then_select(tmp_path, capsys):
    args = [
        "--model",
        "tiny-gqa",
        "--batch",
        "1",
        "--context",
        "64",
        "--dtype",
        "fp32",
        "--results",
        str(tmp_path),
    ]
    assert main(["tune", *args, "--repeats", "3", "--timeout", "60", "--json"]) == 0
    tuned = json.loads(capsys.readouterr().out)
    (entry,) = tuned["entries"].values()
    assert entry["winner"]["backend"] in attnbench.load_registry().names() and entry["complete"]
    assert main(["select", *args, "--json"]) == 0
    (choice,) = json.loads(capsys.readouterr().out)
    assert choice["source"] == "tuned" and choice["backend"] == entry["winner"]["backend"]
    assert main(["select", *args, "--explain"]) == 0
    assert "chosen:" in capsys.readouterr().out


def test_cli_names_bad_input(capsys):
    assert main(["tune", "--model", "tiny-gqa", "--trials", "0"]) == 2
    assert "--trials 0 must be ≥ 1" in capsys.readouterr().err


def test_the_heuristic_never_picks_a_lossy_cache_untuned(tmp_path):
    from attnbench.backends.naive import NaiveBackend
    from attnbench.hookspecs import hookimpl
    from attnbench.registry import Source, load_registry

    class Halved(NaiveBackend):  # pretends to quantise: fewer bytes per token, lossy K/V
        name = "halved"
        lossy = "int4 K/V"

        def reference_kv(self, k, v, *, config):
            return k, v

    class Plugin:
        @hookimpl
        def attnbench_backends(self):
            return [Halved, NaiveBackend]

    reg = load_registry(builtins=False, env={"ATTNBENCH_DISABLE_PLUGIN_AUTOLOAD": "1"})
    reg.manager.register(Plugin(), name="p")
    reg._add_from(reg.manager.get_plugin("p"), Source("plugin", "p"))
    choice = attnbench.select(
        model="tiny-gqa", batch=1, context=64, results_dir=tmp_path, registry=reg, bandwidth=1e10
    )
    assert choice.backend == "naive"
    assert any(r.backend == "halved" and "lossy (int4 K/V)" in r.reason for r in choice.rejected)
    assert choice.lossy == "" and "accuracy: exact" in choice.explain()
