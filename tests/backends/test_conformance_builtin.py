"""The conformance suite over every registered backend, and proof that it catches a wrong one."""

from __future__ import annotations

import pytest
import torch

from attnbench.backends.flash import FlashBackend
from attnbench.backends.naive import NaiveBackend
from attnbench.core.registry import load_registry
from attnbench.testing import CASES, LONG_CASES, BackendConformance, run_case


class TestNaive(BackendConformance):
    backend = NaiveBackend
    dtypes = ("fp32", "bf16", "fp16")


class TestFlash(BackendConformance):
    backend = FlashBackend
    dtypes = ("fp32", "bf16", "fp16")


def test_every_registered_backend_has_a_conformance_class() -> None:
    """A backend registered later must be added to a conformance test (here or in its own file)."""
    import pathlib

    tests = pathlib.Path(__file__).parents[1]  # tests/: the conformance classes live in any of its folders
    text = "\n".join(p.read_text() for p in tests.rglob("test_*.py"))
    for entry in load_registry(env={"ATTNBENCH_DISABLE_PLUGIN_AUTOLOAD": "1"}):
        assert f"backend = {entry.cls.__name__}" in text, f"no BackendConformance subclass for {entry.name}"


class OffByOneBackend(NaiveBackend):
    """Planted bug: decode forgets the newest token (a classic cache-length error)."""

    name = "off_by_one"

    def decode(self, cache, plan, *, layer, q, k, v):  # type: ignore[override]
        cache.write(plan, layer=layer, k=k[:, None], v=v[:, None])
        short = type(plan)(
            plan.num_new,
            plan.positions,
            tuple(n - 1 for n in plan.seq_lens_after),
            plan.device_lens - 1,
            plan.device_positions,
            {},
        )
        g = cache.geometry
        s = max(short.seq_lens_after)
        qg = q.view(q.shape[0], g.num_kv_heads, g.group_size, -1)
        scores = torch.matmul(qg, cache.k[layer, :, :, :s].transpose(-1, -2)).float() * g.scale
        probs = torch.softmax(scores, -1).to(q.dtype)
        return torch.matmul(probs, cache.v[layer, :, :, :s]).view(q.shape[0], g.num_q_heads, -1)


class NoScaleBackend(NaiveBackend):
    """Planted bug: softmax without the 1/sqrt(d) scale."""

    name = "no_scale"

    def decode(self, cache, plan, *, layer, q, k, v):  # type: ignore[override]
        return super().decode(cache, plan, layer=layer, q=q * (1 / cache.geometry.scale) ** 0.5, k=k, v=v)


@pytest.mark.parametrize("wrong", [OffByOneBackend, NoScaleBackend], ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_planted_wrong_backend_fails_run_case(wrong: type, dtype: str) -> None:
    with pytest.raises(AssertionError, match="decode step 0"):
        run_case(wrong(), CASES[1], dtype=dtype)


def test_planted_wrong_backend_fails_the_suite(pytester: pytest.Pytester) -> None:
    """Run the suite as a plugin author would, on a wrong backend: its numeric tests must fail."""
    pytester.makepyfile(
        test_wrong="""
        import torch
        from attnbench.backends.naive import NaiveBackend
        from attnbench.testing import BackendConformance

        class Wrong(NaiveBackend):
            name = "wrong"
            def decode(self, cache, plan, *, layer, q, k, v):
                return super().decode(cache, plan, layer=layer, q=q, k=k, v=v) * 1.05

        class TestWrong(BackendConformance):
            backend = Wrong
            dtypes = ("fp32",)
        """
    )
    result = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider")
    outcomes = result.parseoutcomes()
    # every numeric test fails (the long decode-context case too); the contract tests pass
    n_cases = len(CASES)
    n_long = len([c for c in LONG_CASES if not c.shape.is_mla])  # an expanded backend's long cases
    assert outcomes.get("failed") == 3 * n_cases + n_long, result.stdout.str()[-3000:]
    # the contract tests, and the prefill in two turns (whole and chunked) per case: only decode is wrong
    assert outcomes.get("passed") == 4 + 2 * n_cases, result.stdout.str()[-3000:]


def test_nan_never_passes() -> None:
    class NaNBackend(NaiveBackend):
        name = "nan"

        def decode(self, cache, plan, *, layer, q, k, v):  # type: ignore[override]
            out = super().decode(cache, plan, layer=layer, q=q, k=k, v=v)
            out[0, 0, 0] = float("nan")
            return out

    with pytest.raises(AssertionError, match="NaN or inf"):
        run_case(NaNBackend(), CASES[0], dtype="fp32")
