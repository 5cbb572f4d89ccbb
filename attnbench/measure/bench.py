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
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from attnbench.core.backend import Backend, Resolution
from attnbench.core.device import DeviceProfile, last_level_cache_bytes
from attnbench.core.timing import Timing, measure, timing_mode
from attnbench.core.traffic import decode_cost
from attnbench.core.workload import Workload
from attnbench.correctness.gate import CheckResult, Judge
from attnbench.correctness.gate import check as gate_check
from attnbench.correctness.timed import (
    CHECK_BUDGET_BYTES,
    CheckFailed,
    Implausible,
    check_workload,
    error_multiple_for,
    plausibility,
)
from attnbench.measure.decode import SyntheticModel
from attnbench.measure.graph_step import GraphedDecodeStep

__all__ = [
    "CheckFailed",
    "DecodeMeasurement",
    "Implausible",
    "ModelShelf",
    "check_workload",
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
        gate: with ``check``, the gate's verdict for a config that computes the same bits (one that
            differs only in the backend's ``result_neutral`` tunables) instead of running the gate; the
            timed step is checked as always.
        shelf: keeps the filled model of a backend that declares ``cache_neutral`` tunables after the
            run, and runs a later call that differs only in those on it, rewound (see :class:`ModelShelf`).

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
        result, gate_s = _gate_first(
            backend, workload, resolution, multiple, budget=check_budget_bytes, accuracy=accuracy_budget
        )
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
        )
    made = time.perf_counter() - made
    run = _timed_run(
        model,
        mode=timing_mode(timing, workload.device),
        warmup=warmup,
        repeats=repeats,
        max_seconds=max_seconds,
        multiple=multiple if check else None,
        keep=shelf.put if shelf is not None and backend.cache_neutral else None,
        key=key,
    )
    flops = decode_cost(workload, form=backend.kv_form, num_layers=layers).flops if peak_flops else 0.0
    m = run.measurement(
        base, check=result, gate_s=gate_s, profile=profile, flops=flops, peak_flops=peak_flops
    )
    m.phases = {"gate": gate_s} | run.phases | {"cache": made + run.phases.get("cache", 0.0)}
    return m


class ModelShelf:
    """One filled synthetic model kept between measurements (the tuner's worker holds one).

    A backend's ``cache_neutral`` tunables (KV splits, a prefetch distance) change how its kernel walks
    the cache and never the cache, so a measurement of a config that differs from the shelved model's
    only in those runs on that model — its lengths rewound to the fill (:meth:`SyntheticModel.rewind`),
    the config handed to the cache (``Backend.reconfigure_cache``) — instead of allocating and filling
    it again. Everything else is as for a fresh model: the same inputs at the same positions, one timed
    step checked against float64. Anything else frees the shelf first, so it holds one model at most.
    """

    def __init__(self) -> None:
        self._key: str | None = None
        self._model: SyntheticModel | None = None
        self.reused = 0  #: measurements that ran on a shelved model

    @staticmethod
    def key(
        backend: Backend,
        workload: Workload,
        config: Mapping[str, Any],
        layers: int,
        materialise_bytes: int | None,
        warmup: int,
        repeats: int,
    ) -> str:
        """What a shelved model must share with a measurement to serve it: the backend's class, the
        workload, the model's sizes, the steps it has room for and the config but its ``cache_neutral``."""
        kept = sorted((k, repr(v)) for k, v in config.items() if k not in backend.cache_neutral)
        cls = type(backend)
        return repr(
            (
                f"{cls.__module__}.{cls.__qualname__}",
                workload.describe(),
                tuple(workload.context_lens),
                workload.dtype_name,
                str(workload.device),
                layers,
                materialise_bytes,
                warmup,
                repeats,
                kept,
            )
        )

    def take(
        self, key: str, backend: Backend, config: Mapping[str, Any], resolution: Resolution
    ) -> SyntheticModel | None:
        """The shelved model for ``key``, rewound and reconfigured for ``config``; else ``None`` (and
        the shelf emptied, so that a new model never shares memory with an old one)."""
        model, self._model = self._model, None
        if model is None or key != self._key or model.cache is None:
            if model is not None:
                model.release()
            return None
        backend.reconfigure_cache(model.cache, config)
        model.backend, model.config, model.resolution = backend, dict(config), resolution
        model.rewind()
        self.reused += 1
        return model

    def put(self, key: str, model: SyntheticModel) -> None:
        """Keep ``model`` (filled, after a run that completed) for a later measurement of ``key``."""
        self.clear()
        self._key, self._model = key, model

    def clear(self) -> None:
        if self._model is not None:
            self._model.release()
        self._key, self._model = None, None


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
) -> tuple[CheckResult, float]:
    """The correctness gate before anything is timed (step 2 of the module doc): its result and the
    seconds it took; raises :class:`CheckFailed` when it fails (a lossy cache also against
    ``accuracy``, the largest rel_l2 against exact attention accepted)."""
    checked = check_workload(workload, form=backend.kv_form, budget_bytes=budget)
    cfg = dict(resolution.config)
    start = time.perf_counter()
    result = gate_check(backend, checked, config=cfg, num_layers=2, multiple=multiple, resolution=resolution)
    gc.collect()
    seconds = time.perf_counter() - start
    lossy = resolution.lossy
    if accuracy is not None and lossy and not result.error.rel_l2 <= accuracy:
        over = f"lossy ({lossy}): rel_l2 {result.error.rel_l2:.3g} against exact attention > the accuracy budget {accuracy:g}"
        result = dataclasses.replace(result, failures=[*result.failures, over])
    if not result.passed:
        raise CheckFailed(result)
    return result, seconds


@dataclass(frozen=True)
class _Run:
    """What :func:`_timed_run` measured: the objective's timing and both runs, the mean KV bytes a
    timed step read, the check of one timed step and how long it took."""

    step: Timing
    eager: Timing
    graph: Timing | None
    mode: str
    note: str
    kv_bytes: int
    materialised: int
    llc_flushed: bool
    check: CheckResult | None
    check_s: float
    #: wall seconds by phase (see :attr:`DecodeMeasurement.phases`), the gate's excepted
    phases: dict[str, float] = field(default_factory=dict)

    def measurement(
        self,
        base: dict[str, Any],
        *,
        check: CheckResult | None,
        gate_s: float,
        profile: DeviceProfile | None,
        flops: float,
        peak_flops: float | None,
    ) -> DecodeMeasurement:
        """The run as a :class:`DecodeMeasurement` (``base``: what identifies it; ``check``/``gate_s``:
        the gate's result and time before the run). Raises :class:`CheckFailed` when the timed step's
        check failed and :class:`Implausible` when the time is faster than the device allows."""
        if self.check is not None and not self.check.passed:
            raise CheckFailed(self.check)
        why = plausibility(
            kv_bytes=self.kv_bytes,
            seconds=self.step.median_s,
            profile=profile,
            flops=flops,
            peak_flops=peak_flops,
        )
        if why:
            raise Implausible(f"backend {base['backend']!r} {base['config']} on {base['workload']}: {why}")
        bytes_per_s = self.kv_bytes / self.step.median_s
        return DecodeMeasurement(
            **base,
            step=self.step,
            kv_bytes=self.kv_bytes,
            gbps=bytes_per_s / 1e9,
            pct_of_bandwidth=100 * bytes_per_s / profile.bandwidth if profile else None,
            check=check,
            layers_materialised=self.materialised,
            llc_flushed=self.llc_flushed,
            timed_check=self.check,
            gate_s=gate_s + self.check_s,
            timing=self.mode,
            eager_step=self.eager,
            graph_step=self.graph,
            note=self.note,
            phases=dict(self.phases),
        )


def _timed_run(
    model: SyntheticModel,
    *,
    mode: str,
    warmup: int,
    repeats: int,
    max_seconds: float | None,
    multiple: float | None,
    keep: Callable[[str, SyntheticModel], None] | None = None,
    key: str = "",
) -> _Run:
    """Steps 4-5 of the module doc: fill (unless ``model`` is filled and rewound: a
    :class:`ModelShelf`'s), time the steps eagerly (and as a graph on CUDA), check one timed step at
    random (``multiple=None``: unchecked). The model is released on every path, but handed to
    ``keep(key, model)`` after a run that completed without a graph and passed its check."""
    device = model.workload.device
    on_cuda = torch.device(device).type == "cuda"
    spot = random.Random(os.urandom(8))
    model.record_layer = spot.randrange(model.num_layers) if multiple is not None else None
    graph, note = None, ""
    phases: dict[str, float] = {}
    kept = False
    try:
        t0 = time.perf_counter()
        if model.cache is None:
            model.fill(extra_tokens=(2 if on_cuda else 1) * (max(warmup, 1) + repeats) + 1)
        phases["cache"] = time.perf_counter() - t0
        start_bytes, growth = model.kv_bytes_per_step(), model.kv_bytes_per_step_growth()
        evict = _llc_evictor(model)
        flushed = evict is not None

        def timed(step: Callable[[int], object], rotate: int = 1) -> Timing:
            return measure(
                step,
                device=device,
                warmup=warmup,
                repeats=repeats,
                rotate=rotate,
                max_seconds=max_seconds,
                before=evict,
            )

        t0 = time.perf_counter()
        eager = timed(lambda i: model.decode_step(), rotate=1)
        timed_s = time.perf_counter() - t0
        phases["samples"] = min(timed_s, eager.median_s * eager.repeats)  # the median × the timed steps
        phases["warmup"] = timed_s - phases["samples"]
        materialised = model.layers_materialised
        check_start = time.perf_counter()
        checked = None
        if multiple is not None:
            checked = _check_timed_step(model, first=eager.warmup, rng=spot, multiple=multiple)
        check_s = time.perf_counter() - check_start
        phases["check"] = check_s
        if on_cuda and getattr(model.cache, "capturable", False):
            t0 = time.perf_counter()
            graph = timed(GraphedDecodeStep(model))
            phases["graph"] = time.perf_counter() - t0
        elif mode == "graph":
            note = "not capturable: timed eagerly (as an engine would run it)"
        if keep is not None and graph is None and (checked is None or checked.passed):
            keep(key, model)
            kept = True
    finally:
        if not kept:
            model.release()
        evict = None
        gc.collect()
    # step j of the run reads start_bytes + j · growth; the timed ones follow the warm-up (and the
    # graph run follows the eager one)
    if mode == "graph" and graph is not None:
        step, before_steps = graph, eager.warmup + eager.repeats
    else:
        step, before_steps = eager, 0
    kv_bytes = int(start_bytes + (before_steps + step.warmup + (step.repeats - 1) / 2) * growth)
    return _Run(
        step=step,
        eager=eager,
        graph=graph,
        mode=mode if graph is not None or mode == "eager" else "eager",
        note=note,
        kv_bytes=kv_bytes,
        materialised=materialised,
        llc_flushed=flushed,
        check=checked,
        check_s=check_s,
        phases=phases,
    )


def _check_timed_step(
    model: SyntheticModel, *, first: int, rng: random.Random, multiple: float
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
    backend, config = model.backend, dict(model.config)
    judge = Judge(
        backend=backend,
        config=config,
        dtype=model.workload.dtype,
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
