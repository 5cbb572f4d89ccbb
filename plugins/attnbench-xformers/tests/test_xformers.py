"""The xformers backend: the reason xformers gives where it cannot run, conformance on CUDA with the
real package, and the plugin's plumbing through the conformance suite on CPU with a stand-in."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from attnbench_xformers import backend as xb
from attnbench_xformers.backend import XformersBackend

from attnbench import Workload
from attnbench.testing import BackendConformance

STAND_IN = Path(__file__).parent / "stand_in"


def _real_import_error() -> str | None:
    try:
        importlib.import_module("xformers.ops")
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None


def _forget_xformers() -> None:
    for name in [m for m in sys.modules if m == "xformers" or m.startswith("xformers.")]:
        del sys.modules[name]
    xb.xformers_import_error.cache_clear()
    xb.xformers_refusal.cache_clear()


def test_reason_is_the_import_error_when_xformers_is_missing() -> None:
    err = _real_import_error()
    if err is None:
        pytest.skip("xformers is installed here; the missing-package path cannot be shown")
    workload = Workload.uniform("tiny-gqa", batch=2, context=64, dtype="bf16")
    reasons = XformersBackend().supports(workload)
    assert reasons == [f"xformers not importable ({err})"]
    assert XformersBackend().implementation(workload) == f"unavailable: xformers not importable ({err})"
    with pytest.raises(ValueError, match="xformers not importable"):
        XformersBackend().create_cache(workload, config={}, num_layers=1, max_seq_len=8)


def test_reason_is_xformers_own_refusal_on_cpu() -> None:
    if _real_import_error() is not None:
        pytest.skip("xformers is not installed; its own refusal cannot be shown")
    reasons = XformersBackend().supports(Workload.uniform("tiny-gqa", batch=2, context=64, dtype="bf16"))
    assert reasons and reasons[0].startswith("xformers refuses"), reasons


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.skipif(
    _real_import_error() is not None, reason=f"xformers not importable: {_real_import_error()}"
)
class TestXformersCuda(BackendConformance):
    backend = XformersBackend
    device = "cuda"
    dtypes = ("bf16", "fp16")


class TestXformersPlumbingWithStandIn(BackendConformance):
    """The conformance suite on CPU with ``tests/stand_in`` imported as ``xformers``.

    This checks what the plugin does around the kernel (cache layout, the 5-D GQA view with stride-0
    heads, the per-step ragged bias, the output reshape, op selection) — not xformers' kernels.
    """

    backend = XformersBackend
    dtypes = ("fp32", "bf16")
    configs: ClassVar[list[dict[str, Any]]] = [
        {"op": "auto"},
        {"op": "triton_splitk"},
        {"op": "triton_splitk8"},
    ]

    @pytest.fixture(autouse=True)
    def _stand_in(self, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
        _forget_xformers()
        monkeypatch.syspath_prepend(str(STAND_IN))
        import xformers

        assert "stand-in" in xformers.__version__
        yield
        _forget_xformers()
