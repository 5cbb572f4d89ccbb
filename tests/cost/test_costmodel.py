"""The cost model (bytes, FLOPs, the roofline, the fixed cost) and its calibration by measurement."""

from __future__ import annotations

import json
import math
import random

import pytest
from helpers.tuning_helpers import planted_entry, planted_result, save_table, stated_profile

import attnbench
from attnbench.cli import main
from attnbench.core.device import fingerprint
from attnbench.core.registry import load_registry
from attnbench.core.shapes import load_shape
from attnbench.core.traffic import (
    StepCost,
    attention_flops,
    backend_kv_bytes_per_token,
    decode_cost,
    kv_bytes_per_step,
    roofline,
    shape_kv_bytes_per_token,
    step_fixed_s,
)
from attnbench.core.workload import Workload
from attnbench.cost.estimate import estimate, load_gpu
from attnbench.cost.fit import (
    Calibration,
    CalibrationError,
    CalibrationPoint,
    calibration_path,
    fit_points,
    geometry_key,
    points_from_bench,
)
from attnbench.selection.select import backend_for
from attnbench.selection.tuned import TunedIndex
from attnbench.tables import ResultsTable
from attnbench.tables.dispatch import map_key
from attnbench.tuning import summarize

# -- bytes and FLOPs by hand --------------------------------------------------------------------------


def test_kv_bytes_per_step_by_hand_and_the_workload_uses_it() -> None:
    # llama-3.1-8b: 32 layers · 2 (K, V) · 8 KV heads · 128 · 2 B = 131,072 B per token;
    # batch 2 at context 1023 attends 2 · 1024 tokens → 268,435,456 B
    shape = load_shape("llama-3.1-8b")
    assert shape_kv_bytes_per_token(shape, dtype="bf16") == 131_072
    assert kv_bytes_per_step(131_072, tokens=2 * 1024) == 268_435_456
    w = Workload.uniform("llama-3.1-8b", batch=2, context=1023)
    assert w.kv_bytes_per_step() == 268_435_456
    # tp 4 splits the 8 heads (2 per GPU); tp 16 replicates one head per GPU
    assert shape_kv_bytes_per_token(shape, tp=4) == 131_072 // 4
    assert shape_kv_bytes_per_token(shape, tp=16) == 131_072 // 8
    # MLA latent: one 576-wide row per layer, on every GPU
    mla = load_shape("deepseek-v3")
    assert shape_kv_bytes_per_token(mla, tp=8) == 61 * 576 * 2


def test_the_backends_own_bytes_per_token_count_fp8_scales_and_the_latent_form() -> None:
    reg = load_registry()
    w = Workload.uniform("tiny-gqa", batch=1, context=16, dtype="bf16")
    shape = w.shape
    assert backend_kv_bytes_per_token(reg.get("naive"), w) == shape.kv_bytes_per_token("bf16")
    fp8 = backend_kv_bytes_per_token(reg.get("fp8"), w)
    assert shape.kv_bytes_per_token("fp8") < fp8 < shape.kv_bytes_per_token("bf16")  # 1 B + its scales
    m = Workload.uniform("tiny-mla", batch=1, context=16, dtype="bf16")
    assert backend_kv_bytes_per_token(reg.get("mla"), m) == m.shape.kv_bytes_per_token("bf16", "latent")


def test_attention_flops_and_the_step_cost_by_hand() -> None:
    shape = load_shape("llama-3.1-8b")
    # 2 · 32 query heads · (128 + 128) per attended token per layer; 8 layers, 3 tokens
    assert attention_flops(shape, tokens=3, layers=8) == 2 * 32 * 256 * 3 * 8
    w = Workload.uniform("llama-3.1-8b", batch=2, context=1023, dtype="bf16")
    cost = decode_cost(w, num_layers=8)
    assert cost.kv_bytes == 268_435_456 // 4  # 8 of 32 layers
    assert cost.flops == 2 * 32 * 256 * 2048 * 8
    assert cost.io_bytes == 2 * 32 * 256 * 2 * 8  # the queries read, the outputs written
    fp8 = decode_cost(w, num_layers=8, kv_dtype="fp8")
    assert fp8.kv_bytes * 2 == cost.kv_bytes and fp8.flops == cost.flops


def test_the_roofline_and_the_fixed_cost() -> None:
    cost = StepCost(form="expanded", kv_bytes=1e9, io_bytes=0.0, weight_bytes=1e9, flops=1e12)
    r = roofline(cost, bandwidth=1e12, peak_flops=1e15, fixed_s=1e-3)
    assert r.memory_s == pytest.approx(2e-3) and r.compute_s == pytest.approx(1e-3)
    assert r.bound == "memory" and r.floor_s == pytest.approx(2e-3) and r.time_s == pytest.approx(3e-3)
    assert r.ridge == 1000 and r.intensity == pytest.approx(500)
    assert roofline(cost, bandwidth=1e12, peak_flops=1e14).bound == "compute"
    with pytest.raises(ValueError, match="must both be > 0"):
        roofline(cost, bandwidth=0, peak_flops=1.0)
    assert step_fixed_s(layers=32, launch_s=2e-6, step_overhead_s=2.7e-3) == pytest.approx(
        2.7e-3 + 32 * 12 * 2e-6
    )


# -- the fit ----------------------------------------------------------------------------------------------


def _points(*, t0: float, t_seq: float, bw: float, noise: float, grid, geometry: str = "g") -> list:
    rng = random.Random(7)
    out = []
    for b, c in grid:
        kv = 2 * b * (c + 1) * 4096.0
        t = 2 * (t0 + t_seq * b) + kv / bw
        out.append(
            CalibrationPoint("flash", "bf16", geometry, b, c, 2, kv, t * (1 + rng.uniform(-noise, noise)))
        )
    return out


FIT_GRID = [(b, c) for b in (1, 4) for c in (256, 1024, 4096)]


def test_the_fit_recovers_planted_terms_and_predicts_held_out_points() -> None:
    pts = _points(t0=50e-6, t_seq=20e-6, bw=5e9, noise=0.01, grid=FIT_GRID)
    fit = fit_points(pts, geometry="g")
    assert fit.t0_s == pytest.approx(50e-6, rel=0.25)
    assert fit.t_seq_s == pytest.approx(20e-6, rel=0.25)
    assert fit.bw_eff == pytest.approx(5e9, rel=0.05)
    assert fit.points == 6 and fit.span == pytest.approx(4 * 4097 / 257) and fit.rms_rel_error < 0.02
    for p in _points(t0=50e-6, t_seq=20e-6, bw=5e9, noise=0.0, grid=[(2, 512), (3, 2048), (8, 8192)]):
        assert fit.predict_s(batch=p.batch, kv_bytes=p.kv_bytes, layers=p.layers) == pytest.approx(
            p.step_s, rel=0.03
        )


def test_the_fit_refuses_too_few_or_too_narrow_points() -> None:
    few = _points(t0=1e-5, t_seq=1e-5, bw=1e9, noise=0.0, grid=FIT_GRID[:4])
    with pytest.raises(CalibrationError, match="4 points .* needs ≥ 5 points spanning ≥ 16×"):
        fit_points(few)
    narrow = _points(t0=1e-5, t_seq=1e-5, bw=1e9, noise=0.0, grid=[(1, c) for c in (256, 300, 400, 500, 600)])
    with pytest.raises(CalibrationError, match="spanning 2.3×"):
        fit_points(narrow)


def test_the_coefficients_are_never_negative() -> None:
    # pure streaming data: no fixed or per-sequence cost to find, and none is made up
    fit = fit_points(_points(t0=0.0, t_seq=0.0, bw=2e9, noise=0.0, grid=FIT_GRID))
    assert fit.t0_s >= 0 and fit.t_seq_s >= 0 and fit.bw_eff == pytest.approx(2e9, rel=1e-6)


def test_a_knee_past_the_caches_is_fitted_where_it_is_and_nowhere_else() -> None:
    """Bytes read more slowly once one sequence's K/V of a layer outgrows a planted 16 MiB (the cost
    per byte grows with the log of the size past it): the fit finds a knee between the grid's sizes
    around 16 MiB and predicts held-out points beyond it; linear data get no knee."""
    knee, slope = 16 * 2**20, 40e-12

    def planted(grid, noise):
        rng = random.Random(3)
        out = []
        for b, c in grid:
            kv = 2 * b * (c + 1) * 4096.0
            seq = kv / (2 * b)
            t = 2 * (50e-6 + 20e-6 * b) + kv * (1 / 5e9 + slope * max(0.0, math.log2(seq / knee)))
            out.append(
                CalibrationPoint("flash", "fp32", "g", b, c, 2, kv, t * (1 + rng.uniform(-noise, noise)))
            )
        return out

    grid = [(b, c) for b in (1, 4) for c in (512, 2048, 8192, 32768)]
    fit = fit_points(planted(grid, 0.01), geometry="g")
    assert 2048 * 4096 < fit.knee_bytes < 8192 * 4096  # between the sizes on either side of 16 MiB
    assert fit.s_knee_per_byte > 0 and "past " in fit.describe()
    for p in planted([(2, 16384), (3, 24576), (2, 1024)], 0.0):
        predicted = fit.predict_s(batch=p.batch, kv_bytes=p.kv_bytes, layers=p.layers)
        assert predicted == pytest.approx(p.step_s, rel=0.05)
    plain = fit_points(_points(t0=50e-6, t_seq=20e-6, bw=5e9, noise=0.01, grid=grid), geometry="g")
    assert plain.knee_bytes == 0 and plain.s_knee_per_byte == 0 and "past " not in plain.describe()


# -- the file, --gpu PATH, estimate, select ---------------------------------------------------------------------


def _device() -> dict:
    fp = fingerprint("cpu")
    return {
        "name": fp.get("name"),
        "fingerprint": fp,
        "bandwidth": 1e10,
        "memory_bytes": 1e11,
        "flops": {"bf16": 1e11},
    }


def _calibration(tmp_path, *, slow: str = "naive") -> Calibration:
    """Planted fits for naive and flash on tiny-gqa bf16; ``slow`` streams at a tenth of the other."""
    reg = load_registry()
    w = Workload.uniform("tiny-gqa", batch=1, context=16, dtype="bf16")
    points = []
    for name in ("naive", "flash"):
        g = geometry_key(reg.get(name), w)
        bw = 1e8 if name == slow else 1e9
        points += [
            CalibrationPoint(p.backend.replace("flash", name), "bf16", g, p.batch, p.context, p.layers, p.kv_bytes, p.step_s)
            for p in _points(t0=1e-5, t_seq=1e-5, bw=bw, noise=0.0, grid=FIT_GRID, geometry=g)
        ]  # fmt: skip
    cal = Calibration.fit(points, device=_device())
    cal.save(calibration_path(tmp_path, fingerprint("cpu")))
    return cal


def test_the_file_round_trips_and_bad_files_name_the_problem(tmp_path) -> None:
    cal = _calibration(tmp_path)
    loaded = Calibration.load(cal.path)
    assert loaded.fits == cal.fits and loaded.points == cal.points and loaded.device == cal.device
    assert cal.path.name.startswith("calibration-cpu-") and cal.path.parent == tmp_path
    bad = tmp_path / "bad.yaml"
    bad.write_text("format: 1\n")
    with pytest.raises(CalibrationError, match="not an attnbench calibration file"):
        Calibration.load(bad)
    bad.write_text("kind: attnbench calibration\nformat: 1\ndevice: {bandwidth: 1}\n")
    with pytest.raises(CalibrationError, match="field 'device.memory_bytes' is missing"):
        Calibration.load(bad)
    assert main(["estimate", "-m", "tiny-gqa", "--gpu", str(bad), "-c", "1k", "-n", "1"]) == 2


def test_gpu_path_predicts_the_attention_part_from_the_selected_backends_fit(tmp_path, capsys) -> None:
    cal = _calibration(tmp_path, slow="naive")
    gpu = load_gpu(cal.path)
    assert gpu.measured and gpu.calibration is not None and gpu.memory_bandwidth == 1e10
    est = estimate("tiny-gqa", gpu=str(cal.path), batch=2, context=1000, new_tokens=1, choose=backend_for)
    assert est.attention is not None and est.attention.backend == "flash"  # the faster calibrated one
    w = Workload.uniform("tiny-gqa", batch=2, context=1000, dtype="bf16")
    fit = cal.lookup("flash", "bf16", geometry_key(load_registry().get("flash"), w))
    per_token = backend_kv_bytes_per_token(load_registry().get("flash"), w)
    expected = fit.predict_s(batch=2, kv_bytes=2 * 1001 * per_token, layers=w.shape.num_layers)
    assert est.step.kv_s == pytest.approx(expected, rel=1e-9)
    assert est.itl_s == pytest.approx(
        max(est.step.weight_s + expected, est.step.flop_s)
    )  # no fixed cost on CPU
    assert "outside the tuned region" in est.attention.selected
    assert (
        main(["estimate", "-m", "tiny-gqa", "--gpu", str(cal.path), "-c", "1000", "-n", "1", "-b", "2"]) == 0
    )
    assert "calibrated flash" in capsys.readouterr().out


def test_select_uses_the_calibration_only_outside_the_tuned_region(tmp_path) -> None:
    _calibration(tmp_path, slow="naive")  # the calibration prefers flash
    p = stated_profile()
    rows = [
        planted_entry(Workload.uniform("tiny-gqa", batch=b, context=c), flash=9e-3, naive=4e-3, profile=p)
        for b, c in ((1, 256), (4, 2048))
    ]  # the measured map prefers naive
    path = save_table(tmp_path, dict(rows), profile=p)
    inside = attnbench.select(model="tiny-gqa", batch=2, context=1000, results_dir=tmp_path)
    assert inside.source == "tuned" and inside.backend == "naive"  # the measured map wins inside
    outside = attnbench.select(model="tiny-gqa", batch=64, context=32768, results_dir=tmp_path)
    assert outside.source == "calibrated" and outside.backend == "flash"
    text = outside.explain()
    assert "outside the tuned region" in text and "batch bucket 64 outside the tuned 1..4" in text
    assert "calibrated model:" in text and "naive: calibrated model predicts" in text
    table = ResultsTable.load(path)
    index = TunedIndex.build(table, {})
    why = {}
    for model in ("tiny-gqa", "tiny-mla"):
        w = Workload.uniform(model, batch=2, context=1000)
        key = map_key(model, w.shape.fingerprint(), w.dtype_name)
        why[model] = index.beyond_at(key, model, w.dtype_name, w.batch, w.context)
    assert why["tiny-gqa"] == "" and "no tuned entry" in why["tiny-mla"]


def test_calibrate_fits_from_a_bench_json(tmp_path, capsys) -> None:
    # a bench --save JSON of this device (planted numbers; the row fields bench writes)
    prof = stated_profile()
    rows = []
    for b, c in FIT_GRID:
        w = Workload.uniform("tiny-gqa", batch=b, context=c)
        kv = w.kv_bytes_per_step() // w.shape.num_layers  # one layer
        rows.append(
            {"workload": f"tiny-gqa b={b} ctx={c} bf16 cpu", "dtype": "bf16", "batch": b, "context": c,
             "backend": "naive", "status": "timed", "num_layers": 1, "kv_bytes": kv,
             "step": {"median_s": 1e-4 + kv / 1e9}}
        )  # fmt: skip
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"device": prof.as_dict(), "results": rows}))
    pts = points_from_bench(path, load_registry())
    assert len(pts) == 6 and {p.layers for p in pts} == {1}
    assert main(["calibrate", "--results-dir", str(tmp_path), "--bench", str(path)]) == 0
    cal = Calibration.load(calibration_path(tmp_path, fingerprint("cpu")))
    (fit,) = [f for f in cal.fits if f.backend == "naive"]
    assert fit.bw_eff == pytest.approx(1e9, rel=1e-3) and math.isfinite(fit.rms_rel_error)
    assert "naive" in capsys.readouterr().out


def test_bench_prints_measured_vs_model_per_row(tmp_path, monkeypatch, capsys) -> None:
    import attnbench.core.device as device_mod

    monkeypatch.setenv("ATTNBENCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("ATTNBENCH_RESULTS_DIR", str(tmp_path))
    real = device_mod.measure_bandwidth
    monkeypatch.setattr(
        device_mod, "measure_bandwidth", lambda device="cpu", *, nbytes=None: real(device, nbytes=2**24)
    )
    cal = _calibration(tmp_path)
    argv = (
        "bench --model tiny-gqa --batch 1 --context 64 --dtype bf16 --backends flash --repeats 2 --warmup 1"
    )
    assert main([*argv.split(), "--layers", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (row,) = report["results"]
    w = Workload.uniform("tiny-gqa", batch=1, context=64, dtype="bf16")
    fit = cal.lookup("flash", "bf16", geometry_key(load_registry().get("flash"), w))
    assert row["model"]["step_s"] == pytest.approx(fit.predict_s(batch=1, kv_bytes=row["kv_bytes"], layers=1))
    assert row["model"]["measured_over_model"] == pytest.approx(
        row["step"]["median_s"] / row["model"]["step_s"]
    )
    from rich.console import Console

    from attnbench.cli.bench import _table

    console = Console(width=250, record=True)
    console.print(_table(report))
    assert "meas/model" in console.export_text()


def test_points_from_a_tuned_table_recover_bytes_and_layers(tmp_path) -> None:
    from attnbench.cost.fit import points_from_table

    p = stated_profile()
    rows = {}
    for b, c in FIT_GRID:
        w = Workload.uniform("tiny-gqa", batch=b, context=c)
        step = w.kv_bytes_per_step() / 2e9  # planted: the step streams at exactly 2 GB/s
        result = planted_result(w, {"naive": step}, profile=p, gbps=2.0)
        rows[result.key.row] = summarize(result, profile=p)
    path = save_table(tmp_path, rows, profile=p)
    pts = points_from_table(path, load_registry())
    assert len(pts) == 6 and {pt.layers for pt in pts} == {load_shape("tiny-gqa").num_layers}
    fit = fit_points(pts)
    assert fit.bw_eff == pytest.approx(2e9, rel=1e-3)
