"""One synthetic model's timed run, and the shelf that keeps a filled model between runs.

:func:`timed_run` fills the model's caches (unless it is a :class:`ModelShelf`'s, rewound), times whole
decode steps eagerly (and as a CUDA graph where the cache is capturable), and checks one timed step,
chosen at random, against float64 (:func:`check_timed_step`); :func:`attnbench.measure.bench.measure_decode`
runs the gate before it and turns its :class:`TimedRun` into a measurement. :func:`llc_evictor` keeps a
step from finding its caches still in the last-level cache.
"""

from __future__ import annotations

import gc
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from attnbench.core.backend import Backend, Resolution
from attnbench.core.device import last_level_cache_bytes
from attnbench.core.timing import Timing, measure
from attnbench.core.workload import Workload
from attnbench.correctness.gate import CheckResult, Judge
from attnbench.correctness.reference import reference_pair
from attnbench.measure.graph_step import GraphedDecodeStep
from attnbench.measure.synthetic import SyntheticModel

__all__ = ["ModelShelf", "Pruned", "TimedRun", "check_timed_step", "llc_evictor", "timed_run"]


class Pruned(RuntimeError):
    """The timed steps stopped early at a tuner's pruner: the candidate was clearly slower than
    others. ``step``: the steps it ran; ``check``: the gate's verdict it passed before."""

    def __init__(
        self, step: Timing, check: CheckResult | None, phases: dict[str, float] | None = None
    ) -> None:
        super().__init__(f"pruned after {step.repeats} timed steps (median {step.median_s * 1e3:.4g} ms)")
        self.step = step
        self.check = check
        self.phases = dict(phases or {})  #: wall seconds by phase, as a measurement's


def llc_evictor(model: SyntheticModel) -> Callable[[int], object] | None:
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
    scratch = _scratch(model.device, min(2 * llc, 2**30) // 4)
    return lambda i: scratch.add_(1.0)


#: the eviction pass's buffer, one per process (the last device and size asked for): made and touched
#: for the first time per measurement, up to 1 GiB cost more than the passes over it (a 480-MiB LLC)
_SCRATCH: dict[tuple[str, int], torch.Tensor] = {}


def _scratch(device: str | torch.device, n: int) -> torch.Tensor:
    key = (str(device), n)
    if key not in _SCRATCH:
        _SCRATCH.clear()  # the previous one freed before the next is made
        _SCRATCH[key] = torch.empty(n, dtype=torch.float32, device=device).fill_(1.0)
    return _SCRATCH[key]


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


@dataclass(frozen=True)
class TimedRun:
    """What :func:`timed_run` measured: the objective's timing and both runs, the mean KV bytes a
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
    #: ``report`` stopped the timed steps early (a tuner's pruner): checked all the same, not a result
    pruned: bool = False


def timed_run(
    model: SyntheticModel,
    *,
    mode: str,
    warmup: int,
    repeats: int,
    max_seconds: float | None,
    multiple: float | None,
    keep: Callable[[str, SyntheticModel], None] | None = None,
    key: str = "",
    report: Callable[[list[float]], bool] | None = None,
) -> TimedRun:
    """Steps 4-5 of :mod:`attnbench.measure.bench`'s doc: fill (unless ``model`` is filled and rewound: a
    :class:`ModelShelf`'s), time the steps eagerly (and as a graph on CUDA), check one timed step at
    random (``multiple=None``: unchecked). The model is released on every path, but handed to
    ``keep(key, model)`` after a run that completed without a graph and passed its check (or was
    pruned). ``report(samples)``: called after each timed step where the eager steps are the
    objective; ``True`` stops the run there, as ``pruned`` (its steps still checked)."""
    device = model.workload.device
    on_cuda = torch.device(device).type == "cuda"
    # the checked call is drawn from the model's seed (itself drawn from os.urandom unless a caller
    # shares one between models of a workload): every model of that seed checks the same layer and
    # timed step, whose float64 references are then computed once (check_timed_step)
    spot = random.Random(model.seed * 0x9E3779B1 + 1)
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
        evict = llc_evictor(model)
        flushed = evict is not None

        pruned = False

        def stop(samples: list[float]) -> bool:
            nonlocal pruned
            pruned = report is not None and report(samples)
            return pruned

        def timed(step: Callable[[int], object], rotate: int = 1, *, reported: bool = False) -> Timing:
            return measure(
                step,
                device=device,
                warmup=warmup,
                repeats=repeats,
                rotate=rotate,
                max_seconds=max_seconds,
                before=evict,
                after=stop if reported else None,
                # warmed up once the warm-up took a timed step's share of the budget
                warm_seconds=max_seconds / repeats if max_seconds else None,
            )

        t0 = time.perf_counter()
        eager = timed(
            lambda i: model.decode_step(), rotate=1, reported=report is not None and mode == "eager"
        )
        timed_s = time.perf_counter() - t0
        phases["samples"] = min(timed_s, eager.median_s * eager.repeats)  # the median × the timed steps
        phases["warmup"] = timed_s - phases["samples"]
        materialised = model.layers_materialised
        check_start = time.perf_counter()
        checked = None
        if multiple is not None:  # a pruned run's steps too: a wrong backend is "gate", never just slow
            checked = check_timed_step(model, first=eager.warmup, rng=spot, multiple=multiple)
        check_s = time.perf_counter() - check_start
        phases["check"] = check_s
        if pruned:
            pass
        elif on_cuda and getattr(model.cache, "capturable", False):
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
    return TimedRun(
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
        pruned=pruned,
    )


#: float64 and calibration outputs of recently checked calls, by :meth:`SyntheticModel.history_key`
#: (a tuner's worker checks every candidate of a study on one seed's inputs: the first computes them)
_EXPECTED: dict[tuple[Any, ...], tuple[torch.Tensor, list[torch.Tensor]]] = {}
_EXPECTED_KEPT = 4


def _exact(backend: Backend) -> bool:
    """Whether ``backend`` stores K/V exactly (it does not override ``reference_kv``)."""
    return type(backend).reference_kv is Backend.reference_kv


def check_timed_step(
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
    backend, config = model.backend, dict(model.config)
    # an exact cache's references depend on the call's inputs only: kept per history_key, for the next
    # model of the same seed (a lossy one's reference_kv depends on its config: computed each time)
    key = model.history_key(layer, step) if _exact(backend) else None
    expected = _EXPECTED.pop(key, None) if key is not None else None
    if expected is not None:
        q, lens = model.call_query(layer, step)
        hk = hv = torch.empty(0)  # not read: reference_kv of an exact cache is None
    else:
        q, hk, hv, lens = model.history_for(layer, step)
        expected = reference_pair(q, hk, hv, lens, scale=model.geometry.scale)
    if key is not None:
        _EXPECTED[key] = expected
        while len(_EXPECTED) > _EXPECTED_KEPT:
            _EXPECTED.pop(next(iter(_EXPECTED)))
    judge = Judge(
        backend=backend,
        config=config,
        dtype=model.workload.dtype,
        scale=model.geometry.scale,
        multiple=multiple,
    )
    judge.add(out, q, hk, hv, lens, expected=expected)
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
