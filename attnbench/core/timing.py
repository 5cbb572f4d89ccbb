"""Timing a callable honestly: warm-up first, device sync, median over repeats, rotated inputs.

On CUDA each call is timed with CUDA events; on CPU with ``perf_counter``. The callable takes the
index of the input set to use, so that callers can rotate among several copies of their inputs and
caches do not flatter small cases. Compile and autotune time belong in the warm-up, never in a sample.

Two ways to time a decode step (:data:`TIMING_MODES`), the way engines serve it:

- ``"eager"``: ``plan()``, every layer's ``decode()`` launched from Python, ``commit()``;
- ``"graph"`` (CUDA only): ``plan()`` (host work, filling the cache's buffers), one replay of a CUDA
  graph holding every layer's ``decode()`` of the step, ``commit()`` — vLLM's and FlashInfer's
  decode under ``use_cuda_graph``. Only backends with ``capturable = True`` can be timed so.

:func:`timing_mode` picks and checks the mode: graph replay by default on CUDA, eager on the CPU
(where ``"graph"`` is refused in one line).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch

__all__ = ["TIMING_MODES", "Timing", "measure", "synchronize", "timing_mode"]

#: how a decode step is timed: launched layer by layer from Python, or replayed as one CUDA graph
TIMING_MODES = ("eager", "graph")


@dataclass(frozen=True)
class Timing:
    """Seconds per call: median, 10th and 90th percentile over ``repeats`` samples."""

    median_s: float
    p10_s: float
    p90_s: float
    repeats: int
    warmup: int

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)

    def scaled(self, factor: float) -> Timing:
        """The same samples, each ``factor`` times as long (a step of some layers as the model's step)."""
        return replace(
            self, median_s=self.median_s * factor, p10_s=self.p10_s * factor, p90_s=self.p90_s * factor
        )


def synchronize(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _quantile(sorted_samples: list[float], q: float) -> float:
    if len(sorted_samples) == 1:
        return sorted_samples[0]
    return statistics.quantiles(sorted_samples, n=100, method="inclusive")[round(q * 100) - 1]


def measure(
    fn: Callable[[int], object],
    *,
    device: torch.device | str = "cpu",
    warmup: int = 3,
    repeats: int = 15,
    rotate: int = 1,
    max_seconds: float | None = None,
    before: Callable[[int], object] | None = None,
    after: Callable[[list[float]], bool] | None = None,
    warm_seconds: float | None = None,
) -> Timing:
    """Time ``fn(i)`` where ``i`` cycles over ``range(rotate)``.

    ``warmup`` untimed calls run first (one per input set at least); with ``warm_seconds``, no more once
    those ran for that long (a step that takes seconds has touched all it touches in its first call).
    ``max_seconds`` caps the timed phase: sampling stops early once it is exceeded, keeping at least 3
    samples — or one, where that one step alone took longer than ``max_seconds`` (a step of many
    seconds, timed once: it only ranks far behind). ``before(i)``, if
    given, runs before every timed call, outside the timer (then a device sync): e.g. evicting the
    last-level cache when the data is too small to do so itself. ``after(samples)``, if given, is
    called with the samples so far after each timed call, outside the timer; ``True`` stops sampling
    there (a tuner's pruner: the candidate is clearly slower than others).
    """
    if repeats < 1:
        raise ValueError(f"repeats = {repeats} must be ≥ 1")
    dev = torch.device(device)
    warmed, warm_start = 0, time.perf_counter()
    for i in range(max(warmup, rotate)):
        fn(i % rotate)
        warmed += 1
        if warm_seconds is not None and warmed >= rotate:
            synchronize(dev)
            if time.perf_counter() - warm_start >= warm_seconds:
                break
    synchronize(dev)
    samples: list[float] = []
    start_all = time.perf_counter()
    for i in range(repeats):
        if before is not None:
            before(i % rotate)
            synchronize(dev)
        if dev.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn(i % rotate)
            end.record()
            end.synchronize()
            samples.append(begin.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn(i % rotate)
            samples.append(time.perf_counter() - t0)
        over = max_seconds is not None and time.perf_counter() - start_all > max_seconds
        if over and (len(samples) >= 3 or samples[0] > (max_seconds or 0.0)):
            break
        if after is not None and after(samples):
            break
    samples.sort()
    return Timing(
        median_s=statistics.median(samples),
        p10_s=_quantile(samples, 0.10),
        p90_s=_quantile(samples, 0.90),
        repeats=len(samples),
        warmup=warmed,
    )


def timing_mode(requested: str | None, device: torch.device | str) -> str:
    """The timing mode for ``device``: ``requested``, or ``"graph"`` on CUDA and ``"eager"`` elsewhere.

    Raises ``ValueError`` (one line naming ``--timing``, the value and what is accepted) for an
    unknown mode, or for ``"graph"`` off CUDA.
    """
    dev = torch.device(device)
    if requested is None:
        return "graph" if dev.type == "cuda" else "eager"
    if requested not in TIMING_MODES:
        raise ValueError(f"--timing = {requested!r} not in {TIMING_MODES}")
    if requested == "graph" and dev.type != "cuda":
        raise ValueError(
            f"--timing = 'graph' needs a CUDA device (CUDA graphs); on {dev.type} decode steps are "
            "timed eagerly: use --timing eager"
        )
    return requested
