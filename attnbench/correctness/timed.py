"""What guards a timed run: the gate's workload within a memory budget, the plausibility bound of a
measured step, and the errors that stop a measurement (a failed check, an implausible time).

:func:`attnbench.measure.bench.measure_decode` uses all of them; the tuner's interleaved re-timing
applies :func:`plausibility` to each finalist.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from attnbench.core.backend import DEFAULT_ERROR_MULTIPLE, Backend
from attnbench.core.device import DeviceProfile, ReadMeter
from attnbench.core.shapes import KVForm
from attnbench.core.workload import Workload
from attnbench.correctness.gate import CheckResult, GateCase, prepare_case

__all__ = [
    "CHECK_BUDGET_BYTES",
    "PLAUSIBLE_MARGIN",
    "CaseShelf",
    "CheckFailed",
    "Implausible",
    "check_workload",
    "error_multiple_for",
    "plausibility",
]


class CaseShelf:
    """The gate's inputs and float64 references for the last workload it gated, kept for the next
    candidate of the same workload (a tuner's worker: one study's candidates share one draw).

    Drawing them dominates a gate at long context (batch 8 × 32k tokens on a 2-core EPYC, the gate's
    batch-2 workload: 4.6 s of a 5.9-s gate; 0.9 s with the case reused), and they do not depend on
    the candidate's config, only on the workload, the K/V form and the layer count. Each candidate is
    still gated in full against them (its own cache, its decode, every needle probe), on inputs drawn
    fresh for this worker's study, never seen by the backend before; the seed is the verdict's, so
    ``ATTNBENCH_SEED`` replays a failure. A backend that wrote into the inputs it was handed would make
    the next candidate's gate wrong, so the inputs' sums are compared after every use and a changed
    case is dropped (the next candidate draws a new one).
    """

    def __init__(self) -> None:
        self._case: GateCase | None = None
        self._sums: list[float] = []

    def get(self, workload: Workload, *, form: KVForm, num_layers: int) -> GateCase:
        """The kept case where it answers ``workload`` in ``form`` over ``num_layers``, else a new one."""
        case = self._case
        if case is not None and case.matches(workload, form) and case.num_layers == num_layers:
            return case
        self.clear()
        case = prepare_case(workload, form=form, num_layers=num_layers)
        self._case, self._sums = case, _sums(case)
        return case

    def verify(self) -> bool:
        """After a candidate used the case: ``False`` (and the case dropped) where its inputs changed."""
        if self._case is None or _sums(self._case) == self._sums:
            return True
        self.clear()
        return False

    def clear(self) -> None:
        self._case, self._sums = None, []


def _sums(case: GateCase) -> list[float]:
    """The inputs' sums in float64, each tensor's: what :meth:`CaseShelf.verify` compares."""
    tensors = [t for pair in case.inputs.history for t in pair]
    tensors += [t for step in case.inputs.steps for call in step for t in call]
    return [float(t.sum(dtype=torch.float64)) for t in tensors]


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


def check_workload(
    workload: Workload, *, form: KVForm = "expanded", budget_bytes: int = CHECK_BUDGET_BYTES
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
    measurement may miss. A step over the profile's read bandwidth is checked once more against the
    read bandwidth measured again now (same buffer size, :class:`attnbench.core.device.ReadMeter`)
    before it is refused: on a shared VM the memory bandwidth moves by half within hours (the
    project's 2-vCPU VM read 22 GB/s when its profile was cached and 33 GB/s the next morning, and
    ``cpu_decode`` then read 36 GB/s), and a stale profile must not refuse an honest kernel.
    """
    if seconds <= 0:
        return ""
    why = []
    rate = kv_bytes / seconds
    if profile is not None and profile.read_bandwidth and rate > margin * profile.read_bandwidth:
        bound = f"the measured read bandwidth {profile.read_bandwidth / 1e9:.1f} GB/s"
        now = _read_bandwidth_now(profile)
        if now is not None:
            bound += f" (measured again now: {now / 1e9:.1f} GB/s)"
        if now is None or rate > margin * now:
            why.append(
                f"{kv_bytes / 1e6:.1f} MB of KV cache in {seconds * 1e3:.3g} ms is {rate / 1e9:.1f} GB/s, "
                f"over {margin:g} × {bound}"
            )
    if peak_flops and flops / seconds > margin * peak_flops:
        why.append(
            f"{flops / 1e9:.3g} GFLOP in {seconds * 1e3:.3g} ms is {flops / seconds / 1e9:.1f} GFLOP/s, "
            f"over {margin:g} × the measured matmul peak {peak_flops / 1e9:.1f} GFLOP/s"
        )
    return "implausible: " + "; ".join(why) if why else ""


def _read_bandwidth_now(profile: DeviceProfile) -> float | None:
    """The read bandwidth measured again on the profile's buffer size (``None`` when that buffer would
    sit in the last-level cache: then there is nothing to re-measure)."""
    return ReadMeter(str(profile.fingerprint.get("kind", "cpu")), profile.buffer_bytes)()


def error_multiple_for(backend: Backend, dtype: Any, config: dict[str, Any], default: float | None) -> float:
    """The backend's declared multiple where it declares one beyond the default, else ``default``."""
    own = backend.error_multiple(dtype, config=config)
    if default is None or own != DEFAULT_ERROR_MULTIPLE:
        return own
    return default
