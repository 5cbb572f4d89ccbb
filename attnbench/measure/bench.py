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
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from attnbench.core.backend import Backend, Resolution
from attnbench.core.device import DeviceProfile
from attnbench.core.timing import Timing, timing_mode
from attnbench.core.traffic import decode_cost
from attnbench.core.workload import Workload
from attnbench.correctness import (  # the gate's public names (attnbench.correctness re-exports them)
    CHECK_BUDGET_BYTES,
    CaseShelf,
    CheckFailed,
    CheckResult,
    Implausible,
    check_workload,
    error_multiple_for,
    plausibility,
)
from attnbench.correctness import check as gate_check
from attnbench.measure.decode import SyntheticModel
from attnbench.measure.timed_run import ModelShelf, Pruned, TimedRun, timed_run

__all__ = [
    "CheckFailed",
    "DecodeMeasurement",
    "Implausible",
    "ModelShelf",
    "check_workload",
    "gate_candidate",
    "measure_decode",
    "plausibility",
]


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
    #: wall seconds by phase: ``gate`` (the correctness gate), ``cache`` (the synthetic model's caches
    #: made and filled), ``warmup`` (untimed steps and cache eviction around the timed ones),
    #: ``samples`` (the timed steps), ``check`` (the timed step's check), ``graph`` (CUDA-graph timing)
    phases: dict[str, float] = field(default_factory=dict)
    load_avg: tuple[float, float, float] = field(default_factory=lambda: os.getloadavg())

    @property
    def per_layer_s(self) -> float:
        """Median seconds of one layer's call (step / num_layers)."""
        return self.step.median_s / self.num_layers if self.step and self.num_layers else math.nan

    def as_dict(self) -> dict[str, Any]:
        """Every field (timings and checks as their dicts; ``gbps`` ``None`` when not timed) and the
        check's ``lossy``."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in ("step", "eager_step", "graph_step", "check", "timed_check"):
            out[name] = out[name].as_dict() if out[name] is not None else None
        return out | {
            "gbps": None if math.isnan(self.gbps) else self.gbps,
            "lossy": self.check.lossy if self.check else "",
            "load_avg": list(self.load_avg),
        }


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
    gate: CheckResult | None = None,
    shelf: ModelShelf | None = None,
    report: Callable[[list[float]], bool] | None = None,
    cases: CaseShelf | None = None,
    seed: int | None = None,
) -> DecodeMeasurement:
    """Check ``backend`` on ``workload``, then time its decode step through the synthetic model.

    Args:
        config: the backend's tunables (defaults filled in; a bad name or value raises ``ConfigError``).
        profile: the device profile the bandwidth share is computed against (``None``: not computed).
        warmup / repeats / max_seconds: passed to :func:`attnbench.core.timing.measure`.
        check: run the correctness gate first (raises :class:`CheckFailed` on failure).
        num_layers: layers per step (default: the shape's ``num_layers``).
        materialise_bytes: budget for distinct layer caches (default: see
            :func:`attnbench.measure.layers.materialised_layers`).
        error_multiple: the gate's multiple of the calibration error for a backend that declares
            none of its own (default: the backend's ``error_multiple``).
        accuracy_budget: for a lossy cache, the largest rel_l2 against exact attention accepted.
        peak_flops: the measured matmul peak (FLOP/s); a step above it is refused too.
        resolution: ``backend.resolve(workload, config)`` if the caller has it (else resolved here).
        timing: ``"eager"`` or ``"graph"`` (:func:`attnbench.core.timing.timing_mode`; default: graph on
            CUDA, eager elsewhere). On CUDA both are measured, one after the other on the same cache;
            ``timing`` says which one ``step`` (the objective) is.
        gate: with ``check``, the gate's verdict for a config that computes the same bits (one that
            differs only in the backend's ``result_neutral`` tunables) instead of running the gate; the
            timed step is checked as always.
        shelf: keeps the filled model of a backend that declares ``cache_neutral`` tunables after the
            run, and runs a later call that differs only in those on it, rewound (see :class:`ModelShelf`).
        report: called with the step times so far after each timed step (eager timing only); ``True``
            stops the run there and raises :class:`~attnbench.measure.timed_run.Pruned` (a tuner's
            pruner: the gate passed, the steps ran are checked too, never a result).
        cases: the gate's inputs and float64 references kept for the next candidate of the same
            workload (:class:`~attnbench.correctness.timed.CaseShelf`; default: drawn for this call).
        seed: the synthetic model's seed (its inputs, history and checked call; default: drawn from
            ``os.urandom``). Measurements that share one share the timed check's float64 references.

    Raises:
        ValueError: the backend cannot run the workload (the message lists why).
        CheckFailed: the output broke the backend's tolerance (``err.check`` has the numbers).
    """
    if resolution is None or not resolution.matches(workload, config):
        resolution = backend.resolve(workload, config)
    cfg = dict(resolution.require().config)
    layers = num_layers or workload.shape.num_layers
    base = _identity(backend, workload, resolution, layers)
    multiple = error_multiple_for(backend, workload.dtype, cfg, error_multiple)
    # the shelf's model first: one for another key is freed before the gate allocates its own caches
    key = ModelShelf.key(backend, workload, cfg, layers, materialise_bytes, warmup, repeats)
    shelved = shelf.take(key, backend, cfg, resolution) if shelf is not None else None
    result, gate_s = gate, 0.0  # a verdict reused: the gate passed a config that computes the same bits
    if check and gate is None:
        started = time.perf_counter()
        result, _ = gate_candidate(
            backend, workload, config=cfg, resolution=resolution, error_multiple=error_multiple,
            accuracy_budget=accuracy_budget, check_budget_bytes=check_budget_bytes, cases=cases,
        )  # fmt: skip
        gate_s = time.perf_counter() - started
    if resolution.interpreted:  # checked, never timed
        return _untimed(base, workload.kv_bytes_per_step(backend.kv_form), check=result, gate_s=gate_s)
    made = time.perf_counter()
    model = shelved
    if model is None:
        model = SyntheticModel(
            backend,
            workload,
            config=cfg,
            num_layers=layers,
            materialise_bytes=materialise_bytes,
            resolution=resolution,
            seed=seed,
        )
    made = time.perf_counter() - made
    run = timed_run(
        model,
        mode=timing_mode(timing, workload.device),
        warmup=warmup,
        repeats=repeats,
        max_seconds=max_seconds,
        multiple=multiple if check else None,
        keep=shelf.put if shelf is not None and backend.cache_neutral else None,
        key=key,
        report=report,
    )
    flops = decode_cost(workload, form=backend.kv_form, num_layers=layers).flops if peak_flops else 0.0
    phases = {"gate": gate_s} | run.phases | {"cache": made + run.phases.get("cache", 0.0)}
    m = _measurement(
        run, base, check=result, gate_s=gate_s, profile=profile, flops=flops, peak_flops=peak_flops
    )
    if run.pruned:  # checked and held against the bandwidth as every timed run, then not a result
        raise Pruned(run.step, result, phases)
    m.phases = phases
    return m


def gate_candidate(
    backend: Backend,
    workload: Workload,
    *,
    config: Mapping[str, Any] | None = None,
    error_multiple: float | None = None,
    accuracy_budget: float | None = None,
    check_budget_bytes: int = CHECK_BUDGET_BYTES,
    cases: CaseShelf | None = None,
    gate: CheckResult | None = None,
    resolution: Resolution | None = None,
) -> tuple[CheckResult, float]:
    """The correctness gate alone, exactly as :func:`measure_decode` runs it before timing, for a caller
    that times the backend on models of its own (the tuner's interleaved re-timing): the verdict
    (raises :class:`CheckFailed` on failure) and the multiple of the calibration error that the caller
    must then hold one of its timed steps to (:func:`~attnbench.measure.timed_run.check_timed_step`).
    ``gate``: as in :func:`measure_decode`, the verdict for a config that computes the same bits,
    returned instead of running the gate (the caller's timed step is checked all the same).
    ``resolution``: ``backend.resolve(workload, config)`` if the caller has it."""
    if resolution is None or not resolution.matches(workload, config):
        resolution = backend.resolve(workload, config)
    cfg = dict(resolution.require().config)
    multiple = error_multiple_for(backend, workload.dtype, cfg, error_multiple)
    if gate is not None:
        return gate, multiple
    result = _gate_first(
        backend,
        workload,
        resolution,
        multiple,
        budget=check_budget_bytes,
        accuracy=accuracy_budget,
        cases=cases,
    )
    return result, multiple


def _untimed(
    base: dict[str, Any], kv_bytes: int, *, check: CheckResult | None, gate_s: float
) -> DecodeMeasurement:
    """The measurement of a backend whose kernels would run in an interpreter: checked, never timed."""
    return DecodeMeasurement(
        **base,
        step=None,
        kv_bytes=kv_bytes,
        gbps=math.nan,
        pct_of_bandwidth=None,
        check=check,
        layers_materialised=0,
        timed=False,
        note="interpreted kernels: checked for correctness, never timed",
        gate_s=gate_s,
        phases={"gate": gate_s},
    )


def _identity(backend: Backend, workload: Workload, resolution: Resolution, layers: int) -> dict[str, Any]:
    """The fields that say what a :class:`DecodeMeasurement` measured."""
    return {
        "backend": backend.name,
        "config": dict(resolution.config),
        "implementation": resolution.implementation,
        "workload": workload.describe(),
        "num_layers": layers,
        "dtype": workload.dtype_name,
        "batch": workload.batch,
        "context": workload.context,
    }


def _gate_first(
    backend: Backend,
    workload: Workload,
    resolution: Resolution,
    multiple: float,
    *,
    budget: int,
    accuracy: float | None,
    cases: CaseShelf | None = None,
) -> CheckResult:
    """The correctness gate before anything is timed (step 2 of the module doc): its result; raises
    :class:`CheckFailed` when it fails (a lossy cache also against ``accuracy``, the largest rel_l2
    against exact attention accepted)."""
    checked = check_workload(workload, form=backend.kv_form, budget_bytes=budget)
    cfg = dict(resolution.config)
    case = cases.get(checked, form=backend.kv_form, num_layers=2) if cases is not None else None
    try:
        result = gate_check(
            backend, checked, config=cfg, num_layers=2, multiple=multiple, resolution=resolution, case=case
        )
    finally:
        if cases is not None:
            cases.verify()
    gc.collect()
    lossy = resolution.lossy
    if accuracy is not None and lossy and not result.error.rel_l2 <= accuracy:
        over = f"lossy ({lossy}): rel_l2 {result.error.rel_l2:.3g} against exact attention > the accuracy budget {accuracy:g}"
        result = dataclasses.replace(result, failures=[*result.failures, over])
    if not result.passed:
        raise CheckFailed(result)
    return result


def _measurement(
    run: TimedRun,
    base: dict[str, Any],
    *,
    check: CheckResult | None,
    gate_s: float,
    profile: DeviceProfile | None,
    flops: float,
    peak_flops: float | None,
) -> DecodeMeasurement:
    """``run`` as a :class:`DecodeMeasurement` (``base``: what identifies it; ``check``/``gate_s``:
    the gate's result and time before the run). Raises :class:`CheckFailed` when the timed step's
    check failed and :class:`Implausible` when the time is faster than the device allows."""
    if run.check is not None and not run.check.passed:
        raise CheckFailed(run.check)
    why = plausibility(
        kv_bytes=run.kv_bytes,
        seconds=run.step.median_s,
        profile=profile,
        flops=flops,
        peak_flops=peak_flops,
    )
    if why:
        raise Implausible(f"backend {base['backend']!r} {base['config']} on {base['workload']}: {why}")
    bytes_per_s = run.kv_bytes / run.step.median_s
    return DecodeMeasurement(
        **base,
        step=run.step,
        kv_bytes=run.kv_bytes,
        gbps=bytes_per_s / 1e9,
        pct_of_bandwidth=100 * bytes_per_s / profile.bandwidth if profile else None,
        check=check,
        layers_materialised=run.materialised,
        llc_flushed=run.llc_flushed,
        timed_check=run.check,
        gate_s=gate_s + run.check_s,
        timing=run.mode,
        eager_step=run.eager,
        graph_step=run.graph,
        note=run.note,
        phases=dict(run.phases),
    )
