"""``select()`` where nothing was tuned: the roofline heuristic.

The candidate whose cache reads the fewest KV bytes per token wins (within 1 %, a tie broken by the
default order ``flash``, then ``naive``): decode attention is memory-bound, so fewer bytes is the best
guess without a measurement. Lossy caches are never chosen here. Which backend wins depends only on the
bytes per token (:attr:`Resolution.kv_bytes_per_token`), so :class:`HeuristicRanking` is computed once
per model, dtype, device and bucket and each call only scales the roofline floor to its own tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from attnbench.core.backend import Resolution
from attnbench.core.traffic import kv_bytes_per_step
from attnbench.core.workload import Workload
from attnbench.selection.choice import Choice, Rejected
from attnbench.tables.table_schema import DEFAULT_BACKENDS

__all__ = ["HeuristicRanking", "rank"]


@dataclass(frozen=True)
class HeuristicRanking:
    """The heuristic's winner for one bucket and what it rejected (the reasons need no tokens)."""

    name: str
    config: dict
    per_token: int
    tie: bool
    rejected: tuple[Rejected, ...]

    def choice(self, workload: Workload, *, bandwidth: float) -> Choice:
        nbytes = int(kv_bytes_per_step(self.per_token, tokens=workload.total_tokens + workload.batch))
        if not bandwidth > 0:
            raise ValueError(f"bandwidth = {bandwidth!r} must be > 0 (bytes/s)")
        # the roofline floor of memory-only traffic (costmodel.roofline with no weights, I/O or FLOPs
        # gives exactly this): the KV bytes over the bandwidth, without building its records per call
        estimate = nbytes / bandwidth * 1e3
        reason = (
            f"no tuned entry for {workload.shape.name} {workload.dtype_name} on this device; roofline: a "
            f"step reads {nbytes / 1e6:.4g} MB of KV cache, ≥ {estimate:.4g} ms at {bandwidth / 1e9:.3g} "
            f"GB/s; {self.name} reads the fewest bytes"
            + (" (tie broken by the default order flash, naive)" if self.tie else "")
        )
        return Choice(
            self.name,
            dict(self.config),
            "heuristic",
            workload,
            reason,
            rejected=list(self.rejected),
            estimate_ms=estimate,
        )


def rank(
    resolutions: Iterable[tuple[str, Resolution, dict]],
    *,
    failed_gate: Mapping[str, str],
    describe: str,
) -> HeuristicRanking:
    """The heuristic over ``(name, resolution, default config)`` of every registered backend, in
    registry order. ``LookupError`` when none can run (``describe`` names the workload)."""
    rejected: list[Rejected] = []
    scored: list[tuple[int, int, str, dict]] = []
    lossy: list[tuple[str, str]] = []
    for i, (name, res, config) in enumerate(resolutions):
        why_not = runnable_reason(res) or failed_gate.get(name, "")
        if why_not:
            rejected.append(Rejected(name, why_not))
        elif res.lossy:
            lossy.append((name, res.lossy))
        else:
            order = DEFAULT_BACKENDS.index(name) if name in DEFAULT_BACKENDS else len(DEFAULT_BACKENDS) + i
            scored.append((res.kv_bytes_per_token, order, name, config))
    rejected += [
        Rejected(
            n, f"lossy ({what}): chosen only from a tuned table with allow_lossy=True, never by the heuristic"
        )
        for n, what in lossy
    ]
    if not scored:
        raise LookupError(
            f"no registered backend can run {describe}: "
            + "; ".join(f"{r.backend}: {r.reason}" for r in rejected)
        )
    least = min(b for b, _, _, _ in scored)
    # within 1 % of the fewest bytes is a tie on the roofline: the default backend's order decides
    ties = sorted((order, name, b, cfg) for b, order, name, cfg in scored if b <= least * 1.01)
    _, name, per_token, config = ties[0]
    for b, _, other, _ in scored:
        if other != name:
            why = (
                f"reads {b / per_token:.2f}× the KV bytes"
                if b > least * 1.01
                else "same KV bytes; not first in the default order"
            )
            rejected.append(Rejected(other, why))
    return HeuristicRanking(name, config, per_token, len(ties) > 1, tuple(rejected))


def runnable_reason(res: Resolution) -> str:
    """Empty when the resolution can run and would run natively; else why not."""
    if res.reasons:
        return "cannot run this workload: " + "; ".join(res.reasons)
    if res.interpreted:
        return "would run interpreted here (never timed, never chosen)"
    return ""
