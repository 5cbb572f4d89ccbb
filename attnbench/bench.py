"""Measure one backend's decode step on a workload: check first, then time, then relate to bandwidth.

:func:`measure_decode` is what ``attnbench bench``, the tuner and the estimator's checks call::

    workload = Workload.uniform("llama-3.1-8b", batch=8, context="8k")
    m = measure_decode(backend, workload, profile=load_profile())
    m.step.median_s, m.gbps, m.pct_of_bandwidth, m.check.error.rel_l2

Order of work:

1. ``backend.supports(workload)`` — a backend that cannot run the workload raises ``ValueError``
   naming the reasons.
2. The correctness gate (:func:`attnbench.gate.check`, two layers, fresh random inputs) on the same
   shape, dtype and context; when the full batch would not fit the gate's memory budget (it keeps a
   float64 copy of the history) the batch is reduced first, then the context, and the checked
   workload is recorded in ``check.workload``. A failed check raises :class:`CheckFailed`, which
   carries the :class:`~attnbench.gate.CheckResult` (``err.check``) so that callers such as the tuner
   can record the numbers. Nothing that failed is ever timed.
3. Backends whose kernels would run in an interpreter (``backend.interpreted(workload)``) stop here:
   the measurement has ``timed=False``, ``step=None`` and says why. Interpreted timings mean nothing.
4. The synthetic attention-only model (:class:`attnbench.decode.SyntheticModel`) is filled to the
   workload's context (untimed), then whole decode steps — ``plan()``, every layer's ``decode()``,
   ``commit()`` — are timed with :func:`attnbench.timing.measure`. The model materialises
   ``layers_materialised`` distinct layer caches and cycles the ``num_layers`` calls over them (see
   :mod:`attnbench.decode`), so every call reads its cache from DRAM. When all materialised caches
   together are smaller than 4 × the last-level cache (short contexts, small batches), a buffer of
   twice the LLC is written before each timed step, outside the timer (``llc_flushed``), because in
   a real model the weights read between two steps would have evicted the cache.

Each step appends a token, so the context grows by one per step during the run (``warmup + repeats``
tokens at most, e.g. 12 on a 1024-token context); ``kv_bytes`` is the mean of what the timed steps
actually read.
"""

from __future__ import annotations

import gc
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from attnbench.backend import Backend
from attnbench.decode import SyntheticModel
from attnbench.device import DeviceProfile, last_level_cache_bytes
from attnbench.gate import CheckResult
from attnbench.gate import check as gate_check
from attnbench.timing import Timing, measure
from attnbench.workload import Workload

__all__ = ["CheckFailed", "DecodeMeasurement", "check_workload", "measure_decode"]

#: Host memory the gate may use by default (it holds the cache, the history and a float64 copy).
CHECK_BUDGET_BYTES = 3 * 2**30


class CheckFailed(RuntimeError):
    """The backend's output broke its declared tolerance; ``check`` holds the numbers."""

    def __init__(self, check: CheckResult) -> None:
        self.check = check
        super().__init__(
            f"backend {check.backend!r} {check.config} failed the correctness gate on {check.workload}: "
            f"{'; '.join(check.failures)}"
        )


@dataclass
class DecodeMeasurement:
    """One backend, one config, one workload.

    ``step`` is the time of ONE full decode step over all ``num_layers`` layers (``None`` when the
    backend was not timed: see ``timed`` and ``note``). ``kv_bytes`` is the KV-cache bytes a timed step
    read; ``gbps`` is ``kv_bytes / step.median_s`` in 1e9 bytes/s; ``pct_of_bandwidth`` relates it to
    the profile's measured bandwidth (``None`` without a profile).
    """

    backend: str
    config: dict[str, Any]
    implementation: str
    workload: str
    step: Timing | None
    kv_bytes: int
    gbps: float
    pct_of_bandwidth: float | None
    check: CheckResult | None
    layers_materialised: int
    num_layers: int = 0
    timed: bool = True
    note: str = ""
    dtype: str = ""
    batch: int = 0
    context: int = 0
    llc_flushed: bool = False  # the last-level cache was evicted before each timed step (small caches)
    load_avg: tuple[float, float, float] = field(default_factory=lambda: os.getloadavg())

    @property
    def per_layer_s(self) -> float:
        """Median seconds of one layer's call (step / num_layers)."""
        return self.step.median_s / self.num_layers if self.step and self.num_layers else math.nan

    def as_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "config": self.config,
            "implementation": self.implementation,
            "workload": self.workload,
            "dtype": self.dtype,
            "batch": self.batch,
            "context": self.context,
            "num_layers": self.num_layers,
            "layers_materialised": self.layers_materialised,
            "llc_flushed": self.llc_flushed,
            "timed": self.timed,
            "note": self.note,
            "step": self.step.as_dict() if self.step else None,
            "kv_bytes": self.kv_bytes,
            "gbps": None if math.isnan(self.gbps) else self.gbps,
            "pct_of_bandwidth": self.pct_of_bandwidth,
            "check": self.check.as_dict() if self.check else None,
            "load_avg": list(self.load_avg),
        }


def _llc_evictor(model: SyntheticModel) -> Callable[[int], object] | None:
    """When every materialised cache together is under 4 × the last-level cache, a step could find
    them still cached from the previous step (a real model's weights would have evicted them): return
    an untimed pass over a buffer of 2 × the LLC to run before each timed step. ``None`` otherwise."""
    llc = last_level_cache_bytes(model.device)
    cache = model.cache
    total = cache.nbytes() if cache is not None else 0
    if not total:
        total = model.per_layer_bytes(model._last_max_seq_len) * model.layers_materialised
    if total >= 4 * llc:
        return None
    scratch = torch.empty(min(2 * llc, 2**30) // 4, dtype=torch.float32, device=model.device).fill_(1.0)
    return lambda i: scratch.add_(1.0)


def check_workload(
    workload: Workload, *, form: str = "expanded", budget_bytes: int = CHECK_BUDGET_BYTES
) -> Workload:
    """The workload the gate runs for ``workload``: the same one when it fits ``budget_bytes``.

    Otherwise the batch is reduced first (keeping the full context, where kernels differ most), then
    the context is halved until it fits.
    """
    g = workload.geometry(form)
    values = g.qk_head_dim if form == "latent" else g.num_kv_heads * (g.qk_head_dim + g.v_head_dim)
    itemsize = workload.dtype.itemsize

    def estimate(lens: tuple[int, ...]) -> int:
        per_layer = values * itemsize * (max(lens) + 2) * len(lens)
        # 2 layers of cache + 2 of history + transient copies + the float64 reference of one layer
        return per_layer * (6 + 2 * 8 // itemsize)

    lens = workload.context_lens
    while len(lens) > 1 and estimate(lens) > budget_bytes:
        lens = lens[: max(1, len(lens) // 2)]
    while max(lens) > 16 and estimate(lens) > budget_bytes:
        lens = tuple(max(1, n // 2) for n in lens)
    if lens == workload.context_lens:
        return workload
    return Workload(workload.shape, lens, workload.dtype, workload.device)


def measure_decode(
    backend: Backend,
    workload: Workload,
    *,
    config: Mapping[str, Any] | None = None,
    profile: DeviceProfile | None = None,
    warmup: int = 2,
    repeats: int = 10,
    max_seconds: float | None = None,
    check: bool = True,
    num_layers: int | None = None,
    materialise_bytes: int | None = None,
    check_budget_bytes: int = CHECK_BUDGET_BYTES,
) -> DecodeMeasurement:
    """Check ``backend`` on ``workload``, then time its decode step through the synthetic model.

    Args:
        config: the backend's tunables (defaults filled in; a bad name or value raises ``ConfigError``).
        profile: the device profile the bandwidth share is computed against (``None``: not computed).
        warmup / repeats / max_seconds: passed to :func:`attnbench.timing.measure`.
        check: run the correctness gate first (raises :class:`CheckFailed` on failure).
        num_layers: layers per step (default: the shape's ``num_layers``).
        materialise_bytes: budget for distinct layer caches (default: see
            :func:`attnbench.decode.materialised_layers`).

    Raises:
        ValueError: the backend cannot run the workload (the message lists why).
        CheckFailed: the output broke the backend's tolerance (``err.check`` has the numbers).
    """
    reasons = backend.supports(workload)
    if reasons:
        raise ValueError(f"backend {backend.name!r} cannot run {workload.describe()}: {'; '.join(reasons)}")
    cfg = backend.resolve_config(config)
    layers = num_layers or workload.shape.num_layers
    base = {
        "backend": backend.name,
        "config": cfg,
        "implementation": backend.implementation(workload),
        "workload": workload.describe(),
        "num_layers": layers,
        "dtype": workload.dtype_name,
        "batch": workload.batch,
        "context": workload.context,
    }
    result: CheckResult | None = None
    if check:
        checked = check_workload(workload, form=backend.kv_form, budget_bytes=check_budget_bytes)
        result = gate_check(backend, checked, config=cfg, num_layers=2)
        gc.collect()
        if not result.passed:
            raise CheckFailed(result)
    if backend.interpreted(workload):
        return DecodeMeasurement(
            **base,
            step=None,
            kv_bytes=workload.kv_bytes_per_step(backend.kv_form),
            gbps=math.nan,
            pct_of_bandwidth=None,
            check=result,
            layers_materialised=0,
            timed=False,
            note="interpreted kernels: checked for correctness, never timed",
        )

    model = SyntheticModel(
        backend, workload, config=cfg, num_layers=layers, materialise_bytes=materialise_bytes
    )
    try:
        model.fill(extra_tokens=max(warmup, 1) + repeats + 1)
        start_bytes = model.kv_bytes_per_step()
        growth = model.kv_bytes_per_step_growth()
        evict = _llc_evictor(model)
        timed_with_flush = evict is not None
        timing = measure(
            lambda i: model.decode_step(),
            device=workload.device,
            warmup=warmup,
            repeats=repeats,
            rotate=1,
            max_seconds=max_seconds,
            before=evict,
        )
        materialised = model.layers_materialised
    finally:
        model.release()
        evict = None
        gc.collect()
    # step j of the run reads start_bytes + j · growth; the timed ones follow the warm-up
    kv_bytes = int(start_bytes + (timing.warmup + (timing.repeats - 1) / 2) * growth)
    bytes_per_s = kv_bytes / timing.median_s
    return DecodeMeasurement(
        **base,
        step=timing,
        kv_bytes=kv_bytes,
        gbps=bytes_per_s / 1e9,
        pct_of_bandwidth=100 * bytes_per_s / profile.bandwidth if profile else None,
        check=result,
        layers_materialised=materialised,
        llc_flushed=timed_with_flush,
    )
