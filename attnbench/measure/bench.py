"""Measure one backend's decode step on a workload: check first, then time, then relate to bandwidth.

:func:`measure_decode` is what ``attnbench bench``, the tuner and the estimator's checks call::

    workload = Workload.uniform("llama-3.1-8b", batch=8, context="8k")
    m = measure_decode(backend, workload, profile=load_profile())
    m.step.median_s, m.gbps, m.pct_of_bandwidth, m.check.error.rel_l2

Order of work:

1. ``backend.resolve(workload, config)`` (or the ``resolution`` passed in) — a backend that cannot
   run the workload raises ``ValueError`` naming the reasons; the answer is reused by every step.
2. The correctness gate (:func:`attnbench.correctness.gate.check`, two layers, fresh random inputs with needle
   probes, bounds calibrated per metric) on the same shape, dtype and the workload's full context;
   when the full batch would not fit the gate's memory budget the batch is reduced first, then the
   KV heads (never the context), and the checked workload is recorded in ``check.workload``. A
   failed check raises :class:`CheckFailed`, which
   carries the :class:`~attnbench.correctness.gate.CheckResult` (``err.check``) so that callers such as the tuner
   can record the numbers. Nothing that failed is ever timed.
3. Backends whose kernels would run in an interpreter (``Resolution.interpreted``) stop here:
   the measurement has ``timed=False``, ``step=None`` and says why. Interpreted timings mean nothing.
4. The synthetic attention-only model (:class:`attnbench.measure.synthetic.SyntheticModel`) is filled to the
   workload's context (untimed), then whole decode steps — ``plan()``, every layer's ``decode()``,
   ``commit()`` — are timed with :func:`attnbench.core.timing.measure`. The model materialises
   ``layers_materialised`` distinct layer caches and cycles the ``num_layers`` calls over them (see
   :mod:`attnbench.measure.synthetic`), so every call reads its cache from DRAM. When all materialised caches
   together are smaller than 4 × the last-level cache (short contexts, small batches), a buffer of
   twice the LLC is written before each timed step, outside the timer (``llc_flushed``), because in
   a real model the weights read between two steps would have evicted the cache.

5. The timed run is checked too: one layer, chosen at random before timing, keeps a copy of its
   output at every step; afterwards one timed step is chosen at random and compared with float64
   attention on that call's own inputs (the model rebuilds the history it attended over), with the
   gate's calibrated bound (a failure raises :class:`CheckFailed`). A step that read its KV bytes
   faster than :data:`PLAUSIBLE_MARGIN` × the measured read bandwidth raises :class:`Implausible`.
   Neither is ever a result.

Each step appends a token, so the context grows by one per step during the run (``warmup + repeats``
tokens at most, e.g. 12 on a 1024-token context); ``kv_bytes`` is the mean of what the timed steps
actually read.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from attnbench.core.backend import DEFAULT_ERROR_MULTIPLE, Backend, Resolution
from attnbench.core.device import DeviceProfile, last_level_cache_bytes
from attnbench.core.timing import Timing, measure, timing_mode
from attnbench.core.traffic import decode_cost
from attnbench.core.workload import Workload
from attnbench.correctness.gate import CheckResult, Judge
from attnbench.correctness.gate import check as gate_check
from attnbench.measure.decode import SyntheticModel
from attnbench.measure.graph_step import GraphedDecodeStep

__all__ = [
    "CheckFailed",
    "DecodeMeasurement",
    "Implausible",
    "check_workload",
    "measure_decode",
    "plausibility",
]

#: Host memory the gate may use by default (it holds the cache, the history and a float64 copy).
CHECK_BUDGET_BYTES = 3 * 2**30

#: A step whose KV bytes / time exceeds this multiple of the measured read bandwidth is refused.
PLAUSIBLE_MARGIN = 1.5


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

    ``step`` is the time of ONE full decode step over all ``num_layers`` layers in the ``timing`` mode
    (the objective: ``"graph"`` replay on CUDA by default, ``"eager"`` on the CPU; a backend whose
    cache is not capturable is timed eagerly and ``note`` says so), ``None`` when the backend was
    not timed (see ``timed`` and ``note``). ``eager_step`` and ``graph_step`` are both modes' times
    (``graph_step`` only on CUDA, for a capturable cache). ``kv_bytes`` is the KV-cache bytes a timed step
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
    timed_check: CheckResult | None = None  # one timed step and layer, checked after timing
    timing: str = "eager"  # the mode ``step`` was timed in
    eager_step: Timing | None = None
    graph_step: Timing | None = None
    gate_s: float = 0.0  # wall seconds of the correctness gate and of the timed run's check
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
            "timing": self.timing,
            "eager_step": self.eager_step.as_dict() if self.eager_step else None,
            "graph_step": self.graph_step.as_dict() if self.graph_step else None,
            "kv_bytes": self.kv_bytes,
            "gbps": None if math.isnan(self.gbps) else self.gbps,
            "pct_of_bandwidth": self.pct_of_bandwidth,
            "check": self.check.as_dict() if self.check else None,
            "timed_check": self.timed_check.as_dict() if self.timed_check else None,
            "gate_s": self.gate_s,
            "lossy": self.check.lossy if self.check else "",
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

    Otherwise the batch is reduced first, then the number of KV heads (keeping the query heads per KV
    head, and at least two KV heads so a wrong head mapping still shows) — never the context, where
    long-context bugs live.
    """
    g = workload.geometry(form)
    itemsize = workload.dtype.itemsize

    def estimate(batch: int, kv_heads: int) -> int:
        values = g.qk_head_dim if form == "latent" else kv_heads * (g.qk_head_dim + g.v_head_dim)
        tokens = (workload.context + 64) * batch
        # 2 layers of cache + 2 of float32 history while planting, 2 in the dtype, float64 of one head
        per_token = values * (2 * itemsize + 2 * 4 + 2 * itemsize) + 3 * 8 * (g.qk_head_dim + g.v_head_dim)
        return per_token * tokens

    batch, heads = workload.batch, workload.shape.num_kv_heads
    while batch > 1 and estimate(batch, heads) > budget_bytes:
        batch = max(1, batch // 2)
    while form != "latent" and heads > 2 and estimate(batch, heads) > budget_bytes:
        heads = max(2, heads // 2)
    if (batch, heads) == (workload.batch, workload.shape.num_kv_heads):
        return workload
    shape = workload.shape
    if heads != shape.num_kv_heads:
        group = shape.num_heads // shape.num_kv_heads
        shape = dataclasses.replace(shape, num_kv_heads=heads, num_heads=heads * group)
    return Workload(shape, workload.context_lens[:batch], workload.dtype, workload.device)


class Implausible(RuntimeError):
    """A timed step read its KV cache faster than the device can: a measurement bug, never a winner."""


def plausibility(
    *,
    kv_bytes: int,
    seconds: float,
    profile: DeviceProfile | None,
    flops: float = 0.0,
    peak_flops: float | None = None,
    margin: float = PLAUSIBLE_MARGIN,
) -> str:
    """Why a step of ``kv_bytes`` (and ``flops``) in ``seconds`` is implausible ('' if it is not).

    The bounds are the read bandwidth measured at the same thread count (it is part of the device
    fingerprint) and, when given, the measured matmul peak, each times ``margin`` for what their own
    measurement may miss.
    """
    if seconds <= 0:
        return ""
    why = []
    if (
        profile is not None
        and profile.read_bandwidth
        and kv_bytes / seconds > margin * profile.read_bandwidth
    ):
        why.append(
            f"{kv_bytes / 1e6:.1f} MB of KV cache in {seconds * 1e3:.3g} ms is {kv_bytes / seconds / 1e9:.1f} GB/s, "
            f"over {margin:g} × the measured read bandwidth {profile.read_bandwidth / 1e9:.1f} GB/s"
        )
    if peak_flops and flops / seconds > margin * peak_flops:
        why.append(
            f"{flops / 1e9:.3g} GFLOP in {seconds * 1e3:.3g} ms is {flops / seconds / 1e9:.1f} GFLOP/s, "
            f"over {margin:g} × the measured matmul peak {peak_flops / 1e9:.1f} GFLOP/s"
        )
    return "implausible: " + "; ".join(why) if why else ""


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
    error_multiple: float | None = None,
    accuracy_budget: float | None = None,
    peak_flops: float | None = None,
    resolution: Resolution | None = None,
    timing: str | None = None,
) -> DecodeMeasurement:
    """Check ``backend`` on ``workload``, then time its decode step through the synthetic model.

    Args:
        config: the backend's tunables (defaults filled in; a bad name or value raises ``ConfigError``).
        profile: the device profile the bandwidth share is computed against (``None``: not computed).
        warmup / repeats / max_seconds: passed to :func:`attnbench.core.timing.measure`.
        check: run the correctness gate first (raises :class:`CheckFailed` on failure).
        num_layers: layers per step (default: the shape's ``num_layers``).
        materialise_bytes: budget for distinct layer caches (default: see
            :func:`attnbench.measure.synthetic.materialised_layers`).
        error_multiple: the gate's multiple of the calibration error for a backend that declares
            none of its own (default: the backend's ``error_multiple``).
        accuracy_budget: for a lossy cache, the largest rel_l2 against exact attention accepted.
        peak_flops: the measured matmul peak (FLOP/s); a step above it is refused too.
        resolution: ``backend.resolve(workload, config)`` if the caller has it (else resolved here).
        timing: ``"eager"`` or ``"graph"`` (:func:`attnbench.core.timing.timing_mode`; default: graph on
            CUDA, eager elsewhere). On CUDA both are measured, one after the other on the same cache;
            ``timing`` says which one ``step`` (the objective) is.

    Raises:
        ValueError: the backend cannot run the workload (the message lists why).
        CheckFailed: the output broke the backend's tolerance (``err.check`` has the numbers).
    """
    if resolution is None or not resolution.matches(workload, config):
        resolution = backend.resolve(workload, config)
    cfg = dict(resolution.require().config)
    mode = timing_mode(timing, workload.device)
    on_cuda = torch.device(workload.device).type == "cuda"
    layers = num_layers or workload.shape.num_layers
    base = {
        "backend": backend.name,
        "config": cfg,
        "implementation": resolution.implementation,
        "workload": workload.describe(),
        "num_layers": layers,
        "dtype": workload.dtype_name,
        "batch": workload.batch,
        "context": workload.context,
    }
    result: CheckResult | None = None
    gate_s = 0.0
    if check:
        checked = check_workload(workload, form=backend.kv_form, budget_bytes=check_budget_bytes)
        multiple = _multiple(backend, workload.dtype, cfg, error_multiple)
        gate_start = time.perf_counter()
        result = gate_check(
            backend, checked, config=cfg, num_layers=2, multiple=multiple, resolution=resolution
        )
        gc.collect()
        gate_s = time.perf_counter() - gate_start
        lossy = resolution.lossy
        if accuracy_budget is not None and lossy and not result.error.rel_l2 <= accuracy_budget:
            over = f"lossy ({lossy}): rel_l2 {result.error.rel_l2:.3g} against exact attention > the accuracy budget {accuracy_budget:g}"
            result = dataclasses.replace(result, failures=[*result.failures, over])
        if not result.passed:
            raise CheckFailed(result)
    if resolution.interpreted:
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
            gate_s=gate_s,
        )

    model = SyntheticModel(
        backend,
        workload,
        config=cfg,
        num_layers=layers,
        materialise_bytes=materialise_bytes,
        resolution=resolution,
    )
    spot = random.Random(os.urandom(8))
    model.record_layer = spot.randrange(layers) if check else None
    try:
        model.fill(extra_tokens=(2 if on_cuda else 1) * (max(warmup, 1) + repeats) + 1)
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
        check_start = time.perf_counter()
        timed_check = (
            _check_timed_step(
                backend,
                model,
                cfg,
                first=timing.warmup,
                rng=spot,
                multiple=_multiple(backend, workload.dtype, cfg, error_multiple),
            )
            if check
            else None
        )
        gate_s += time.perf_counter() - check_start
        eager_timing, graph_timing, graph_note = timing, None, ""
        if on_cuda and getattr(model.cache, "capturable", False):
            graphed = GraphedDecodeStep(model)
            graph_timing = measure(
                graphed,
                device=workload.device,
                warmup=warmup,
                repeats=repeats,
                max_seconds=max_seconds,
                before=evict,
            )
        elif mode == "graph":
            graph_note = "not capturable: timed eagerly (as an engine would run it)"
    finally:
        model.release()
        evict = None
        gc.collect()
    # step j of the run reads start_bytes + j · growth; the timed ones follow the warm-up (and the
    # graph run follows the eager one)
    if mode == "graph" and graph_timing is not None:
        timing, before_steps = graph_timing, eager_timing.warmup + eager_timing.repeats
    else:
        timing, before_steps = eager_timing, 0
    kv_bytes = int(start_bytes + (before_steps + timing.warmup + (timing.repeats - 1) / 2) * growth)
    if timed_check is not None and not timed_check.passed:
        raise CheckFailed(timed_check)
    flops = decode_cost(workload, form=backend.kv_form, num_layers=layers).flops if peak_flops else 0.0
    why = plausibility(
        kv_bytes=kv_bytes, seconds=timing.median_s, profile=profile, flops=flops, peak_flops=peak_flops
    )
    if why:
        raise Implausible(f"backend {backend.name!r} {cfg} on {workload.describe()}: {why}")
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
        timed_check=timed_check,
        gate_s=gate_s,
        timing=mode if graph_timing is not None or mode == "eager" else "eager",
        eager_step=eager_timing,
        graph_step=graph_timing,
        note=graph_note,
    )


def _multiple(backend: Backend, dtype: Any, config: dict[str, Any], default: float | None) -> float:
    """The backend's declared multiple where it declares one beyond the default, else ``default``."""
    own = backend.error_multiple(dtype, config=config)
    if default is None or own != DEFAULT_ERROR_MULTIPLE:
        return own
    return default


def _check_timed_step(
    backend: Backend,
    model: SyntheticModel,
    config: dict[str, Any],
    *,
    first: int,
    rng: random.Random,
    multiple: float,
) -> CheckResult | None:
    """Check one timed step (the recorded layer's output, a step chosen at random) against float64.

    The history that call attended over is rebuilt from the model's generators; the bound is the
    gate's, calibrated on these inputs. ``None`` when nothing was recorded.
    """
    timed = [(step, out) for step, out in model.recorded if step >= first]
    layer = model.record_layer
    if not timed or layer is None:
        return None
    step, out = rng.choice(timed)
    q, hk, hv, lens = model.history_for(layer, step)
    dtype = model.workload.dtype
    judge = Judge(
        backend=backend,
        config=config,
        dtype=dtype,
        scale=model.geometry.scale,
        multiple=multiple,
    )
    judge.add(out, q, hk, hv, lens)
    failures, _, _ = judge.failures()
    exact_tol, stored_tol = judge.tolerances()
    return CheckResult(
        backend=backend.name,
        config=config,
        workload=f"{model.workload.describe()}, timed step {step} layer {layer}",
        seed=model.seed,
        error=judge.exact.stats(),
        tolerance=exact_tol,
        failures=[f"timed step {step} layer {layer}: {f}" for f in failures],
        calibration=judge.calib.stats(),
        multiple=judge.multiple,
        decode_steps=1,
        lossy=model.resolution.lossy,
        stored_error=judge.stored.stats() if judge.stored else None,
        stored_calibration=judge.stored_calib.stats() if judge.stored_calib else None,
        stored_tolerance=stored_tol,
    )
