"""The estimator's device specifications (presets, aliases, validation) and its calibrated
attention term, on planted fits (nothing measured)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from attnbench.core.shapes import load_shape
from attnbench.core.traffic import shape_kv_bytes_per_token
from attnbench.cost.fit import Calibration, Fit
from attnbench.cost.gpuspec import GPUSpec, check_fraction, list_gpus, load_gpu
from attnbench.cost.measured_term import CalibratedAttention, calibrated_attention


def test_presets_load_by_name_and_alias_with_a_bf16_peak() -> None:
    names = list_gpus()
    assert names
    for name in names:
        spec = load_gpu(name)
        assert isinstance(spec, GPUSpec) and spec.name == name
        assert spec.memory_bandwidth > 0 and spec.peak_flops("bf16")[1] == "bf16"
        assert spec.peak_flops("no-such-dtype") == (spec.flops["bf16"], "bf16")  # falls back to bf16
    assert load_gpu("h100").name in names
    assert load_gpu(names[0], achievable=0.5).achievable == 0.5
    with pytest.raises(LookupError, match="unknown GPU"):
        load_gpu("no-such-gpu")


def test_a_spec_refuses_bad_fields_naming_them() -> None:
    spec = load_gpu(list_gpus()[0])
    with pytest.raises(ValueError, match="memory_bandwidth"):
        replace(spec, memory_bandwidth=0)
    with pytest.raises(ValueError, match="'bf16' entry"):
        replace(spec, flops={"fp32": 1e12})
    with pytest.raises(ValueError, match=r"--achievable = 1.5 must be a fraction in \(0, 1\]"):
        check_fraction(1.5)
    assert check_fraction(1) == 1.0


def _calibrated(fits: list[Fit]) -> GPUSpec:
    return replace(load_gpu(list_gpus()[0]), calibration=Calibration(device={}, fits=fits, points=[]))


def test_calibrated_attention_is_the_chosen_backends_fit() -> None:
    shape = load_shape("llama-3.1-8b")
    fit = Fit("naive", "bf16", None, 2e-6, 1e-6, 1e-12, 6, 64.0, 0.01, 0.02)
    spec = _calibrated([fit])
    att, at0, per_ctx = calibrated_attention(
        shape, spec, batch=2, context=1024, tp=1, kv_dtype="bf16", choose=lambda w, d: ("naive", "planted")
    )
    assert isinstance(att, CalibratedAttention) and att.backend == "naive" and att.selected == "planted"
    per_token = shape_kv_bytes_per_token(shape, dtype="bf16")
    assert att.kv_bytes_per_token == per_token
    assert per_ctx == pytest.approx(2 * per_token * 1e-12)
    assert at0 == pytest.approx(shape.num_layers * (2e-6 + 2 * 1e-6) + 2 * per_token * 1e-12)
    assert att.as_dict()["fit"] == fit.describe()


def test_calibrated_attention_says_why_not_without_a_fit() -> None:
    shape = load_shape("llama-3.1-8b")
    att, why, per_ctx = calibrated_attention(
        shape,
        _calibrated([]),
        batch=1,
        context=1024,
        tp=1,
        kv_dtype="bf16",
        choose=lambda w, d: ("naive", ""),
    )
    assert att is None and per_ctx == 0.0 and why.startswith("no fit for naive/bf16")
    att, why, _ = calibrated_attention(
        shape, _calibrated([]), batch=1, context=1024, tp=1, kv_dtype="bf16", choose=None
    )
    assert att is None and why.startswith("no backend chosen")
