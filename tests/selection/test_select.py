"""attnbench.select(): tuned tables (nearest bucket), the roofline heuristic, refusals, the CLI."""

from __future__ import annotations

import json

import pytest
from helpers.tuning_helpers import planted_entry, save_table, stated_profile

import attnbench
from attnbench.cli import main
from attnbench.core.device import DeviceProfile
from attnbench.core.workload import Workload
from attnbench.tables import DeviceMismatchError, ResultsTable


def _table(tmp_path, rows: list[tuple[str, dict]], profile: DeviceProfile | None = None):
    return save_table(tmp_path, dict(rows), profile=profile or stated_profile())


def _forbid_cached_work(monkeypatch, *more):  # type: ignore[no-untyped-def]
    """Make every call that select()'s first call caches (the registry, the shape, the fingerprint,
    the profile, each backend's resolve) — and ``more`` ``(owner, name)`` pairs — raise."""
    import importlib

    sel = importlib.import_module("attnbench.selection.select")

    def forbidden(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("select() did work its first call should have cached")

    for owner, name in (
        (sel, "load_registry"),
        (sel, "load_shape"),
        (sel, "fingerprint"),
        (sel, "load_profile"),
        (sel, "ask"),
        *more,
    ):
        monkeypatch.setattr(owner, name, forbidden)


def test_select_uses_the_nearest_tuned_bucket(tmp_path):
    p = stated_profile()
    _table(
        tmp_path,
        [
            planted_entry(
                Workload.uniform("tiny-gqa", batch=1, context=1024), flash=1e-3, naive=3e-3, profile=p
            ),
            planted_entry(
                Workload.uniform("tiny-gqa", batch=8, context=8192), flash=9e-3, naive=4e-3, profile=p
            ),
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
    p = stated_profile()
    _table(
        tmp_path,
        [planted_entry(Workload.uniform("tiny-gqa", batch=1, context=64), flash=None, naive=5e-3, profile=p)],
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
    other = stated_profile(name="Another Machine")
    path = _table(
        tmp_path,
        [
            planted_entry(
                Workload.uniform("tiny-gqa", batch=1, context=64), flash=1e-3, naive=2e-3, profile=other
            )
        ],
        other,
    )
    with pytest.raises(DeviceMismatchError, match="Refusing"):
        attnbench.select(model="tiny-gqa", batch=1, context=64, table=path)


def test_select_needs_a_workload_or_its_parts():
    with pytest.raises(ValueError, match="missing: batch, context"):
        attnbench.select(model="tiny-gqa")
    with pytest.raises(TypeError, match=r"workload = 'tiny-gqa' is a str.*select\(model='tiny-gqa'"):
        attnbench.select("tiny-gqa", batch=1, context=64)  # type: ignore[arg-type]


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
    tune = ["--backends", "naive,flash", "--repeats", "3", "--samples", "3", "--timeout", "60", "--json"]
    assert main(["tune", *args, *tune]) == 0
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
    from attnbench.core.registry import Source, load_registry
    from attnbench.hookspecs import hookimpl

    class Halved(NaiveBackend):  # pretends to quantise: fewer bytes per token, lossy K/V
        name = "halved"
        lossy = "int4 K/V"

        def reference_kv(self, k, v, *, config):
            return k, v

        def kv_bytes_per_token(self, workload, *, config):
            return super().kv_bytes_per_token(workload, config=config) // 2

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
    assert choice.registry is reg and choice.build().name == "naive"  # built from the registry chosen from
    assert choice.lossy == "" and "accuracy: exact" in choice.explain()


# --------------------------------------------------------------------------------------------------
# per batch: answers from memory; a rewritten table is picked up
# --------------------------------------------------------------------------------------------------
def test_later_calls_read_no_file_rebuild_nothing_and_allocate_no_cache(tmp_path, monkeypatch):
    import importlib

    from attnbench.core.backend import Backend
    from attnbench.selection.select import Selector

    files = importlib.import_module("attnbench.selection.tuned")  # reads the tuned files
    p = stated_profile()
    w = Workload.uniform("tiny-gqa", batch=1, context=1024)
    _table(tmp_path, [planted_entry(w, flash=1e-3, naive=3e-3, profile=p)])
    selector = Selector()
    first = selector.select(model="tiny-gqa", batch=1, context=1000, dtype="bf16", results_dir=tmp_path)
    assert first.source == "tuned" and first.backend == "flash"

    _forbid_cached_work(
        monkeypatch, (files, "load_maps"), (files.ResultsTable, "load"), (Backend, "create_cache")
    )
    # values not seen before, in the bucket seen (a new bucket asks each backend's resolve() once)
    for batch, context in ((1, 999), (1, 1100), (1, 800), (1, 1400)):
        again = selector.select(
            model="tiny-gqa", batch=batch, context=context, dtype="bf16", results_dir=tmp_path
        )
        assert again.source == "tuned" and again.backend == "flash"
        assert again.workload.batch == batch and again.workload.context == context
    selector.clear()
    with pytest.raises(AssertionError, match="should have cached"):
        selector.select(model="tiny-gqa", batch=1, context=1000, dtype="bf16", results_dir=tmp_path)


def test_a_table_rewritten_by_tune_is_picked_up(tmp_path):
    from attnbench.selection.select import Selector

    p = stated_profile()
    w = Workload.uniform("tiny-gqa", batch=1, context=64)
    selector = Selector()
    _table(tmp_path, [planted_entry(w, flash=1e-3, naive=3e-3, profile=p)])
    assert selector.select(model="tiny-gqa", batch=1, context=64, results_dir=tmp_path).backend == "flash"
    _table(tmp_path, [planted_entry(w, flash=9e-3, naive=3e-3, profile=p)])  # written atomically: a new file
    assert selector.select(model="tiny-gqa", batch=1, context=64, results_dir=tmp_path).backend == "naive"
    for f in tmp_path.glob("tuning-*.yaml"):
        f.unlink()
    assert selector.select(model="tiny-gqa", batch=1, context=64, results_dir=tmp_path).source == "heuristic"


# --------------------------------------------------------------------------------------------------
# one results location
# --------------------------------------------------------------------------------------------------
def test_serving_code_in_another_directory_finds_the_tuned_table(tmp_path, monkeypatch, capsys):
    """`tune` without --results writes the per-user location; select() from elsewhere reads it."""
    import os
    import subprocess
    import sys

    data = tmp_path / "data"
    monkeypatch.setenv("XDG_DATA_HOME", str(data))
    tiny = ["--model", "tiny-gqa", "--batch", "1", "--context", "64", "--dtype", "fp32", "--device", "cpu"]
    tune = ["--backends", "naive,flash", "--repeats", "3", "--samples", "3", "--timeout", "60"]
    assert main(["tune", *tiny, *tune]) == 0
    out = capsys.readouterr().out
    assert f"results: {data / 'attnbench'} (the per-user default" in out
    (table,) = (data / "attnbench").glob("tuning-*.yaml")
    winner = ResultsTable.load(table).typed()
    (entry,) = winner.values()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    script = (
        "import attnbench, json; from attnbench.cli import main; "
        "c = attnbench.select(model='tiny-gqa', batch=1, context=64, dtype='fp32', device='cpu'); "
        "print(json.dumps([c.source, c.backend, c.table])); "
        "main(['select', '--model', 'tiny-gqa', '--batch', '1', '--context', '64', '--dtype', 'fp32', '--json'])"
    )
    env = dict(os.environ, XDG_DATA_HOME=str(data), ATTNBENCH_DISABLE_PLUGIN_AUTOLOAD="1")
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    first, rest = proc.stdout.split("\n", 1)
    assert json.loads(first) == ["tuned", entry.winner.backend, table.name]
    (cli,) = json.loads(rest)
    assert cli["source"] == "tuned" and cli["backend"] == entry.winner.backend
    assert not (elsewhere / "results").exists()


@pytest.mark.parametrize(
    "argv, match",
    [
        (
            ["--results", "{tmp}/missing"],
            "--results '{tmp}/missing' does not exist; accepted: an existing folder",
        ),
        (
            ["--table", "{tmp}/missing.yaml"],
            "--table '{tmp}/missing.yaml' does not exist; accepted: a tuning-",
        ),
        (["--table", "{tmp}"], "--table '{tmp}' is a folder"),
    ],
)
def test_a_missing_results_folder_or_table_is_an_error(tmp_path, capsys, argv, match):
    argv = [a.format(tmp=tmp_path) for a in argv]
    code = main(["select", "--model", "tiny-gqa", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert match.format(tmp=tmp_path) in err


def test_the_results_variable_and_a_missing_folder_from_python(tmp_path, monkeypatch):
    from attnbench.core.locations import ResultsLocationError, default_results_dir, results_location

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert results_location().path == default_results_dir() == tmp_path / "xdg" / "attnbench"
    assert results_location().origin == "default"
    with pytest.raises(ResultsLocationError, match=r"--results .* does not exist"):
        attnbench.select(model="tiny-gqa", batch=1, context=64, results_dir=tmp_path / "nope")
    monkeypatch.setenv("ATTNBENCH_RESULTS_DIR", str(tmp_path / "nope"))
    assert results_location().origin == "env"
    with pytest.raises(ResultsLocationError, match=r"\$ATTNBENCH_RESULTS_DIR .* does not exist"):
        attnbench.select(model="tiny-gqa", batch=1, context=64)
    p = stated_profile()
    _table(
        tmp_path,
        [planted_entry(Workload.uniform("tiny-gqa", batch=1, context=64), flash=1e-3, naive=3e-3, profile=p)],
    )
    monkeypatch.setenv("ATTNBENCH_RESULTS_DIR", str(tmp_path))
    assert attnbench.select(model="tiny-gqa", batch=1, context=64, device="cpu").source == "tuned"


def test_tune_refuses_the_committed_reference_runs_unless_asked(tmp_path, capsys):
    from pathlib import Path

    from attnbench.core.locations import REFERENCE_MARKER

    repo_results = Path(__file__).resolve().parents[2] / "results"
    assert (repo_results / REFERENCE_MARKER).is_file()  # the repository's results/ is marked
    (tmp_path / REFERENCE_MARKER).write_text("reference runs\n")
    tiny = ["--model", "tiny-gqa", "--batch", "1", "--context", "64", "--dtype", "fp32"]
    code = main(["tune", *tiny, "--results", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "holds committed reference runs" in err and "--update-reference" in err
    assert not list(tmp_path.glob("tuning-*"))
    from attnbench.cli import build_parser
    from attnbench.core.locations import writable_results

    assert build_parser().parse_args(["tune", *tiny, "--update-reference"]).update_reference
    assert writable_results(tmp_path, update_reference=True).path == tmp_path  # asked: allowed


# --------------------------------------------------------------------------------------------------
# --device auto
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "-m", "tiny-gqa"],
        ["tune", "-m", "tiny-gqa"],
        ["select", "-m", "tiny-gqa"],
        ["backends", "-m", "tiny-gqa"],
        ["decode", "-m", "tiny-gqa", "-p", "4", "-n", "2"],
        ["calibrate"],
    ],
)
def test_device_defaults_to_auto_everywhere(argv):
    import torch

    from attnbench.cli import build_parser
    from attnbench.core.device import resolve_device

    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto") == expected and resolve_device("cpu") == "cpu"
    args = build_parser().parse_args(argv)
    assert args.device == expected
    assert build_parser().parse_args([*argv, "--device", "cpu"]).device == "cpu"


def test_the_latency_script_runs(tmp_path):
    from helpers.script_module import load_script

    module = load_script("select_latency")
    assert (
        module.main(
            ["--model", "tiny-gqa", "--calls", "50", "--device", "cpu", "--out", str(tmp_path / "sl")]
        )
        == 0
    )
    report = json.loads((tmp_path / "sl.json").read_text())
    assert report["command"].startswith("python scripts/select_latency.py") and report["load_avg_start"]
    rows = report["rows"]
    heuristic, mapped = (
        rows["heuristic (empty results folder)"],
        rows["dispatch map (planted 5×6 grid, 3 candidates)"],
    )
    # the shipped corpus's row only on a kind of machine it holds; the two above never read it
    assert set(rows) - {
        "heuristic (empty results folder)",
        "dispatch map (planted 5×6 grid, 3 candidates)",
    } <= {k for k in rows if k.startswith("shipped corpus (")}
    assert heuristic["sources"] == ["heuristic"] and mapped["sources"] == ["tuned"]
    assert heuristic["calls"] == mapped["calls"] == 50 and mapped["median_us"] > 0
    assert "| source | first call µs |" in (tmp_path / "sl.md").read_text()


# --------------------------------------------------------------------------------------------------
# a dispatch map: every time says what it is; per call, nothing is read and nothing is explained
# --------------------------------------------------------------------------------------------------
FLASH = "flash[num_splits=0]"


def _planted_map(folder, *, batches=(1, 4), contexts=(256, 1024)):
    """This machine's dispatch map for tiny-gqa bf16 (device cpu): flash, the default, takes
    ``1e-3 · batch · context`` ms at every grid point and naive twice that, so log-log interpolation
    gives exactly those times between the points."""
    from attnbench.core.device import fingerprint
    from attnbench.core.shapes import load_shape
    from attnbench.tables.dispatch import DispatchMap, GridPoint, MapCandidate, dispatch_path, save_maps
    from attnbench.tables.margin import Interval
    from attnbench.tables.table import hardware_id, table_path

    fp = fingerprint("cpu")
    candidates = {FLASH: MapCandidate("flash", {"num_splits": 0}), "naive": MapCandidate("naive", {})}
    points = {}
    for b in batches:
        for c in contexts:
            t = 1e-3 * b * c
            times = {
                FLASH: Interval(t, t * 0.98, t * 1.02, 9),
                "naive": Interval(2 * t, 1.96 * t, 2.04 * t, 9),
            }
            points[(b, c)] = GridPoint(b, c, times, winner=FLASH)
    shape = load_shape("tiny-gqa")
    m = DispatchMap(
        "tiny-gqa", shape.fingerprint(), "bf16", FLASH, [*batches], [*contexts], candidates, points
    )
    path = dispatch_path(table_path(folder, fp))
    save_maps(path, [m], device={"hardware_id": hardware_id(fp)})
    return path


def _from_map(folder, batch, context, selector=None):
    from attnbench.selection.select import Selector

    return (selector or Selector()).select(
        model="tiny-gqa", batch=batch, context=context, dtype="bf16", device="cpu", results_dir=folder
    )


def test_explain_says_whether_a_time_was_measured_interpolated_or_predicted(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ATTNBENCH_DISABLE_PLUGIN_AUTOLOAD", "1")  # built-ins: no plugin probe per bucket
    _planted_map(tmp_path)
    between = _from_map(tmp_path, 2, 512)  # between the grid points: interpolated
    assert between.source == "tuned" and between.backend == "flash" and between.step_basis == "interpolated"
    text = between.explain()
    assert "interpolated step: 1.024 ms (between the tuned points of batch 1..4 × context 256..1024" in text
    assert "measured step" not in text and "not measured at this batch and context" in text
    assert "naive: interpolated 2.048 ms (+100.0% vs the chosen 1.024 ms)" in text
    assert f"{FLASH}: 1.024 ms [" in text and "] interpolated" in text  # the map's account

    at = _from_map(tmp_path, 4, 1024)  # a tuned grid point: measured there
    assert at.step_basis == "measured" and at.step_ms == pytest.approx(4.096)
    text = at.explain()
    assert "measured step: 4.096 ms (at the tuned point batch 4, context 1024)" in text
    assert (
        "interpolated" not in text and "naive: measured 8.192 ms" in text and "measured at this point" in text
    )

    beyond = _from_map(tmp_path, 16, 1024)  # outside the grid: the trend extended, a prediction
    assert beyond.step_basis == "extrapolated" and beyond.extrapolated
    text = beyond.explain()
    assert "predicted step: 16.38 ms (extrapolated beyond the tuned grid" in text
    assert "measured step" not in text and "naive: predicted (extrapolated) 32.77 ms" in text

    nothing = attnbench.select(model="mistral-7b", batch=1, context=64, results_dir=tmp_path, bandwidth=1e10)
    assert nothing.source == "heuristic" and "predicted by the roofline floor: ≥ " in nothing.explain()

    # the CLI says the same: --explain, the table's step column and --json
    args = [
        "--model",
        "tiny-gqa",
        "--batch",
        "2",
        "--context",
        "512",
        "--device",
        "cpu",
        "--results",
        str(tmp_path),
    ]
    assert main(["select", *args, "--explain"]) == 0
    out = capsys.readouterr().out
    assert "interpolated step: 1.024 ms" in out and "measured step" not in out
    assert main(["select", *args, "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["step_basis"] == "interpolated" and row["step_ms"] == pytest.approx(1.024)
    from attnbench.cli.select import step_cell

    assert step_cell(between) == "1.024 (interpolated)" and step_cell(at) == "4.096 (measured)"
    assert step_cell(beyond) == "16.38 (predicted, extrapolated)"
    assert step_cell(nothing).endswith("(predicted, roofline floor)")


def test_later_calls_from_a_map_read_nothing_and_explain_only_when_asked(tmp_path, monkeypatch):
    """After the first call: no file read, no registry or map rebuilt, one ``os.stat`` (the folder's)
    per call once the folder has settled, and the slower candidates written out only when read."""
    import importlib
    import os
    import time

    from attnbench.cost.fit import Calibration
    from attnbench.selection.select import Selector
    from attnbench.tables.dispatch import DispatchMap

    monkeypatch.setenv("ATTNBENCH_DISABLE_PLUGIN_AUTOLOAD", "1")  # built-ins: no plugin probe per bucket
    sel = importlib.import_module("attnbench.selection.select")
    tuned = importlib.import_module("attnbench.selection.tuned")
    _planted_map(tmp_path)
    old = time.time() - 60
    os.utime(tmp_path, (old, old))  # written a minute ago: the folder has settled
    selector = Selector()
    assert _from_map(tmp_path, 2, 512, selector).backend == "flash"
    for b, c in ((4, 256), (1, 1024), (8, 1024)):  # the other batch × context buckets used below
        _from_map(tmp_path, b, c, selector)

    _forbid_cached_work(
        monkeypatch,
        (tuned, "load_maps"),
        (sel, "calibration_path"),
        (tuned.ResultsTable, "load"),
        (Calibration, "load"),
        (DispatchMap, "from_dict"),
    )
    explained = []
    slower = tuned.slower_in_map
    monkeypatch.setattr(tuned, "slower_in_map", lambda m, look: explained.append(1) or slower(m, look))
    stats = []
    real_stat = os.stat
    monkeypatch.setattr(
        sel.os, "stat", lambda path, *a, **k: stats.append(str(path)) or real_stat(path, *a, **k)
    )
    choices = [
        _from_map(tmp_path, b, c, selector) for b, c in ((2, 700), (3, 333), (1, 999), (4, 257), (8, 900))
    ]
    assert [c.backend for c in choices] == ["flash"] * 5 and choices[-1].extrapolated
    assert stats == [str(tmp_path)] * 5  # one stat per call: the folder
    assert explained == []  # nothing explained yet
    assert any(r.backend == "naive" and r.reason.startswith("interpolated") for r in choices[0].rejected)
    assert explained == [1]  # written when read, once
    choices[0].rejected  # noqa: B018  (read again: not written again)
    assert explained == [1]


def test_a_rewrite_in_a_settled_folder_is_seen_by_the_next_call(tmp_path, monkeypatch):
    import os
    import time

    from attnbench.selection.select import Selector

    monkeypatch.setenv("ATTNBENCH_DISABLE_PLUGIN_AUTOLOAD", "1")
    p = stated_profile()
    w = Workload.uniform("tiny-gqa", batch=1, context=64)
    _table(tmp_path, [planted_entry(w, flash=1e-3, naive=3e-3, profile=p)])
    old = time.time() - 60
    os.utime(tmp_path, (old, old))
    selector = Selector()
    assert selector.select(model="tiny-gqa", batch=1, context=64, results_dir=tmp_path).backend == "flash"
    assert selector.select(model="tiny-gqa", batch=1, context=64, results_dir=tmp_path).backend == "flash"
    _table(tmp_path, [planted_entry(w, flash=9e-3, naive=3e-3, profile=p)])  # atomic: renamed into the folder
    assert selector.select(model="tiny-gqa", batch=1, context=64, results_dir=tmp_path).backend == "naive"


def test_the_latency_script_runs_from_another_directory_on_a_results_folder(tmp_path):
    """``--results DIR`` (e.g. what ``tune`` wrote) is measured and its map named in the report, with
    the script run by its path from a directory that is not the repository."""
    import subprocess
    import sys
    from pathlib import Path

    folder, elsewhere = tmp_path / "tuned", tmp_path / "elsewhere"
    folder.mkdir()
    elsewhere.mkdir()
    _planted_map(folder)
    script = Path(__file__).resolve().parents[2] / "scripts" / "select_latency.py"
    argv = [
        "--model",
        "tiny-gqa",
        "--device",
        "cpu",
        "--calls",
        "30",
        "--results",
        str(folder),
        "--out",
        "sl",
    ]
    proc = subprocess.run(
        [sys.executable, str(script), *argv], cwd=elsewhere, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((elsewhere / "sl.json").read_text())
    held = report["results_folder"]["map"]
    assert held["batches"] == [1, 4] and held["contexts"] == [256, 1024] and held["points"] == 4
    assert held["candidates"] == 2 and held["candidates_per_point"] == [2, 2, 2]
    rows = report["rows"]
    assert rows["results folder (--results)"]["tuned_from"] == {"dispatch map": 30, "table entry": 0}
    inside = rows["results folder (--results), inside its tuned grid"]
    assert inside["calls"] == 30 and inside["sources"] == ["tuned"]
    md = (elsewhere / "sl.md").read_text()
    assert "dispatch map 2 × 2 grid (batches [1, 4], contexts [256, 1024]), 4 points, 2 candidates" in md
    assert str(folder) not in md and not (elsewhere / "results").exists()
