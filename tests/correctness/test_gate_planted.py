"""The correctness gate's matrix: every planted wrong backend fails, every built-in passes.

Planted bugs (:mod:`planted`) × bf16, fp16, fp32 × contexts 1k, 8k, 32k, 128k, batch 1, on
a small geometry (2 layers, 8 query heads over 2 KV heads of 32 dims; the MLA latent form on
``tiny-mla``). Inputs and references are built once per cell and shared by its candidates; seeds are
fresh each run and every failure prints the one to replay (``ATTNBENCH_SEED``). The same matrix over
30 seeds per cell, on llama-3.1-8b's geometry up to 32k, is ``scripts/gate_matrix.py``.
"""

from __future__ import annotations

import pytest
import torch
from helpers.planted import GATE_SMALL, PLANTED, PLANTED_LATENT, Precise, PreciseLatent

from attnbench.core.backend import Backend
from attnbench.core.registry import load_registry
from attnbench.core.shapes import load_shape
from attnbench.core.workload import Workload
from attnbench.correctness.gate import check, prepare_case

SMALL = GATE_SMALL
CONTEXTS = (1024, 8192, 32768, 131072)
DTYPES = ("bf16", "fp16", "fp32")


def _verdicts(backends: dict[str, Backend], workload: Workload, form: str) -> dict[str, object]:
    case = prepare_case(workload, form=form)
    return {name: check(b, workload, case=case) for name, b in backends.items()}


@pytest.mark.parametrize("context", CONTEXTS, ids=lambda c: f"{c // 1024}k")
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_planted_bug_fails_and_the_precise_base_passes(dtype: str, context: int) -> None:
    for shape, form, base, bugs in (
        (SMALL, "expanded", Precise, PLANTED),
        (load_shape("tiny-mla"), "latent", PreciseLatent, PLANTED_LATENT),
    ):
        workload = Workload(shape, (context,), dtype, "cpu")
        results = _verdicts({"base": base(), **{n: cls() for n, cls in bugs.items()}}, workload, form)
        base_result = results.pop("base")
        assert base_result.passed, f"{form} base {dtype} {context}: {base_result.summary()}"
        assert base_result.probes > 0 and base_result.retrieval == 1.0
        passed = [f"{n}: {r.summary()}" for n, r in results.items() if r.passed]
        assert not passed, f"planted bugs passed the gate at {dtype} {context}: {passed}"


def _builtins(kv_form: str, *, interpreted: bool) -> dict[str, Backend]:
    """Built-in backends of this form; Triton ones (interpreted here) only when asked."""
    registry = load_registry(env={"ATTNBENCH_DISABLE_PLUGIN_AUTOLOAD": "1"})
    out: dict[str, Backend] = {}
    for entry in registry:
        b = entry.cls()
        if entry.source.kind != "builtin" or b.kv_form != kv_form:
            continue
        w = Workload(SMALL if kv_form == "expanded" else load_shape("tiny-mla"), (64,), torch.float32, "cpu")
        if b.supports(w) or b.interpreted(w) != interpreted:
            if b.name == "mla" and not interpreted:  # its torch path runs everywhere
                out["mla[torch]"] = b
            continue
        out[b.name] = b
    return out


@pytest.mark.parametrize("context", CONTEXTS, ids=lambda c: f"{c // 1024}k")
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_builtin_passes_the_matrix(dtype: str, context: int) -> None:
    for shape, form in ((SMALL, "expanded"), (load_shape("tiny-mla"), "latent")):
        workload = Workload(shape, (context,), dtype, "cpu")
        backends = _builtins(form, interpreted=False)
        assert backends, f"no built-in {form} backend runs natively here"
        case = prepare_case(workload, form=form)
        for name, b in backends.items():
            config = {"kernel": "torch"} if name == "mla[torch]" else None
            r = check(b, workload, case=case, config=config)
            assert r.passed, f"{name} {dtype} {context}: {r.summary()}"
            assert r.retrieval == 1.0 and r.bound_share() <= 1.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_interpreted_triton_backends_pass_at_1k(dtype: str) -> None:
    for shape, form in ((SMALL, "expanded"), (load_shape("tiny-mla"), "latent")):
        backends = _builtins(form, interpreted=True)
        workload = Workload(shape, (1024,), dtype, "cpu")
        case = prepare_case(workload, form=form)
        for name, b in backends.items():
            r = check(b, workload, case=case)
            assert r.passed, f"{name} {dtype} 1k: {r.summary()}"


def test_the_gate_checks_the_full_context_and_reports_numbers() -> None:
    workload = Workload(SMALL, (40_000, 3_000), "bf16", "cpu")
    r = check(Precise(), workload)
    assert r.passed and r.workload == workload.describe()
    d = r.as_dict()
    assert d["calibration"]["rel_l2"] > 0 and d["ratios"]["rel_l2"] > 0 and d["multiple"] == 2.0
    labels = {lab for p in _probes_of(workload) for lab in p.labels}
    assert {"newest", "first", "previous step", "2^15", "2^15-1"} <= labels


def _probes_of(workload: Workload) -> list:
    return prepare_case(workload, form="expanded").inputs.probes


def test_replaying_a_seed_gives_the_same_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    workload = Workload(SMALL, (300, 77), "bf16", "cpu")
    first = check(PLANTED["output-x1.01"](), workload)
    assert not first.passed and str(first.seed) in first.summary()
    monkeypatch.setenv("ATTNBENCH_SEED", str(first.seed))
    again = check(PLANTED["output-x1.01"](), workload)
    assert again.seed == first.seed and again.error == first.error


def test_bad_multiple_and_seed_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    workload = Workload(SMALL, (64,), "bf16", "cpu")
    with pytest.raises(ValueError, match="must be a positive number"):
        check(Precise(), workload, multiple=-1.0)
    monkeypatch.setenv("ATTNBENCH_SEED", "eight")
    with pytest.raises(ValueError, match="ATTNBENCH_SEED = 'eight' is not an integer"):
        check(Precise(), workload)
