"""A study's outcome as a results-table entry: finalists' intervals, the margin policy, merging.

The winner is decided by :func:`attnbench.tables.margin.decide` over the finalists' interleaved
times (:mod:`attnbench.tuning.interleave`), never over times from two different runs. **Merging,
never shrinking**: an existing entry's candidates that this run did not measure are kept when they
were measured under the same attnbench/torch/triton versions and their backend's own code hash is
unchanged (``code_hashes`` per backend, so a run over fewer backends keeps the others); its winner
(the incumbent) is re-measured beside this run's finalists, so it can only lose to a measured rival.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from attnbench.core.device import DeviceProfile
from attnbench.core.timing import Timing
from attnbench.tables.margin import SWITCH_MARGIN, Interval, decide, too_wide
from attnbench.tables.table import versions
from attnbench.tables.table_schema import Candidate, CandidateResult, TableEntry
from attnbench.tuning.refine import PointMeasurement

if TYPE_CHECKING:  # the study needs Optuna; a summary of its records does not
    from attnbench.tuning.study import KeyResult

__all__ = ["candidate_label", "gate_summary", "mergeable", "study_interval", "summarize", "versions"]

_SAME = ("attnbench", "torch", "triton")


def candidate_label(c: Mapping[str, Any]) -> str:
    """The label of a table candidate (``backend[k=v,…]``), as :meth:`Candidate.label` gives it."""
    return Candidate(c["backend"], c.get("config") or {}).label()


def mergeable(prior: Mapping[str, Any], code_hashes: Mapping[str, str]) -> list[CandidateResult]:
    """The candidates of an existing entry that may stand beside this run's: same versions, same
    code hash of their own backend (entries without per-backend hashes merge nothing)."""
    now, then = versions(), prior.get("versions") or {}
    if any(now.get(k) != then.get(k) for k in _SAME):
        return []
    hashes = prior.get("code_hashes") or {}
    return [
        CandidateResult.from_dict(c, where=f"candidates[{i}]")
        for i, c in enumerate(prior.get("candidates") or [])
        if not c.get("missing")
        and hashes.get(c["backend"])
        and hashes[c["backend"]] == code_hashes.get(c["backend"])
    ]


def summarize(
    result: KeyResult,
    *,
    profile: DeviceProfile,
    margin: float = SWITCH_MARGIN,
    command: str = "",
    retimed: PointMeasurement | None = None,
    prior: Mapping[str, Any] | None = None,
    code_hashes: Mapping[str, str] | None = None,
) -> dict:
    """The table entry for one tuned key: winner, runner-up, margin, default, every candidate.

    ``retimed``: the finalists' interleaved intervals (the winner is decided over these); without it
    the study's medians stand, as single times. ``prior``: the entry already in the table, merged.
    """
    plan = result.plan
    code_hashes = dict(code_hashes or {})
    default = plan.space.default_candidate() if plan.space.default_backend else None
    default_label = default.label() if default else None
    cands: dict[str, CandidateResult] = {
        r.candidate.label(): replace(r, study_interval=None) for r in result.records
    }
    merged: list[str] = []
    for c in mergeable(prior, code_hashes) if prior else []:
        label = c.candidate.label()
        if label not in cands:  # re-timed then, not in this run's interleaved measurement
            cands[label] = replace(c, retimed=False, merged=str((prior or {}).get("tuned_at", "earlier")))
            merged.append(label)
    if retimed is not None:
        times = dict(retimed.times)
        for label in [*times, *retimed.failed]:  # another key's finalist, gated here in the re-timing
            mc = retimed.candidates.get(label)
            if label not in cands and mc is not None:
                why = retimed.failed.get(label)
                kind = why.split(":")[0] if why else None
                cands[label] = CandidateResult(
                    mc.backend, dict(mc.config), lossy=mc.lossy or None, failed=kind, reason=why
                )
        for label, interval in times.items():
            if label in cands:
                c = cands[label]
                cands[label] = replace(
                    c,
                    study_ms=c.study_ms if c.merged else c.step_ms,
                    step_ms=round(interval.median_ms, 4),
                    interval=interval.as_dict(),
                    retimed=True,
                )
        for label, why in retimed.failed.items():
            if label in cands and not cands[label].failed:
                cands[label] = replace(cands[label], retime_failed=why)
    else:
        times = {r.candidate.label(): Interval.exact(r.step_ms) for r in result.records if r.ok and r.step_ms}
    kinds = {r.candidate.label(): r.failed for r in result.records if r.failed}
    verdict = decide(times, default=default_label if default_label in times else None, margin=margin)
    winner = cands.get(verdict.winner) if verdict.winner else None
    decision = verdict.reason
    if not times:
        decision = "no candidate passed the correctness gate"
    elif default_label in kinds:
        decision = f"fastest correct candidate; the default failed ({kinds[default_label]})"
    others = sorted((k for k in times if k != verdict.winner), key=lambda k: times[k].median_ms)
    runner = cands[others[0]] if others else None
    ratio = (
        times[others[0]].median_ms / times[verdict.winner].median_ms - 1
        if others and verdict.winner
        else None
    )
    if runner is None and winner is not None and winner.study_ms:  # the only finalist: the rest far
        studied = {  # behind by the study (attnbench.tables.margin.finalists), its times say by how much
            k: c.step_ms
            for k, c in cands.items()
            if k != verdict.winner and c.ok and c.step_ms and not c.retimed
        }
        if studied:
            behind = min(studied, key=lambda k: studied[k] or 0.0)
            runner, ratio = cands[behind], (studied[behind] or 0.0) / winner.study_ms - 1
    # too wide to decide: only matters when the result is a tie on a candidate whose interval is wide
    wide = [k for k in too_wide(times) if k in (default_label, verdict.fastest)] if verdict.tie else []
    entry: dict[str, Any] = {
        "model": plan.key.model,
        "shape_hash": plan.key.shape_hash,
        "dtype": plan.key.dtype,
        "batch_bucket": plan.key.batch_bucket,
        "context_bucket": plan.key.context_bucket,
        "measured_at": {"batch": plan.workload.batch, "context": plan.workload.context},
        "winner": winner.as_dict() if winner else None,
        "decision": decision,
        "tie": verdict.tie,
        "runner_up": runner.as_dict() if runner else None,
        "margin": round(ratio, 4) if ratio is not None else None,
        "default": cands[default_label].as_dict()
        if default_label in cands
        else ({"backend": default.backend, "missing": True} if default else None),
        "switch_margin": margin,
        "candidates": [
            c.as_dict() for c in sorted(cands.values(), key=lambda c: (c.step_ms is None, c.step_ms or 0))
        ],
        "excluded": [e.as_dict() for e in plan.space.excluded],
        "complete": result.complete,
        "study": plan.study_name,
        "trials": len(cands),
        "search": _search(result),
        "space_size": plan.space.size(),
        "device_fingerprint_id": profile.id,
        "code_hash": plan.code_hash,
        "code_hashes": {
            b: h for b, h in sorted(code_hashes.items()) if any(c.backend == b for c in cands.values())
        },
        "versions": versions(),
        "tuned_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }
    if retimed is not None:
        entry["retimed"] = {
            "interleaved": not retimed.isolated,
            "finalists": sorted(times, key=lambda k: times[k].median_ms),
            "samples": min((t.samples for t in times.values()), default=0),
            "load_avg": list(retimed.load_avg),
        }
        if retimed.isolated:  # timed one at a time: the table says so rather than claim interleaving
            entry["retimed"]["isolated"] = retimed.isolated
    if merged:
        entry["merged"] = merged
    if wide:
        entry["spread"] = {
            "too_wide": wide,
            "advice": "spread too wide to decide: rerun with more --samples (and --threads fewer than the cores) on a quieter machine",
        }
    if command:
        entry["command"] = command
    return TableEntry.from_dict(entry, where=plan.key.row).as_dict()  # the schema holds for what we write


def _search(result: KeyResult) -> str:
    """How the key was searched: ``grid`` or ``tpe``, from the shipped corpus's finalists, or from this
    run's cheaper keys' finalists (:mod:`attnbench.tuning.seeding`)."""
    plan = result.plan
    how = "grid" if plan.exhaustive else "tpe"
    note = f" ({result.corpus_note})" if result.corpus_note else ""
    if result.corpus == "agreed":
        return f"corpus finalists ({len(plan.corpus_first)}): agreed with {plan.corpus_label}{note}"
    if result.corpus == "disagreed":
        return f"{how} (the corpus's winner, from {plan.corpus_label}, lost here{note}: searched in full)"
    if plan.seeds:
        stop = (
            f"stopped after {plan.patience} in a row brought nothing better"
            if result.converged
            else "searched to the end"
        )
        return f"tpe from the finalists of {plan.seeded_from} ({len(plan.seeds)}): {stop}"
    return how


def study_interval(step: Timing) -> Interval:
    """A study trial's time as an approximate 95 % interval of its median, from the 10th–90th
    percentile of its steps (p90 − p10 ≈ 2.56 σ; the median's standard error ≈ 1.25 σ / √n). Used
    only to pick the finalists, which are then re-timed interleaved."""
    med, n = step.median_s * 1e3, max(1, step.repeats)
    half = 0.96 * (step.p90_s - step.p10_s) * 1e3 / n**0.5
    return Interval(med, max(med - half, 0.0), med + half, n)


def gate_summary(check: dict[str, Any] | None) -> dict[str, Any] | None:
    """The gate's numbers a table keeps: worst error, calibration error, their ratio, the bound."""
    if not check:
        return None

    def few(d: dict[str, Any] | None) -> dict[str, Any] | None:
        keys = ("max_abs", "rel_l2", "cosine")
        return {k: float(f"{d[k]:.4g}") for k in keys if isinstance(d.get(k), (int, float))} if d else None

    out = {
        "error": few(check.get("error")),
        "calibration": few(check.get("calibration")),
        "multiple": check.get("multiple"),
        "ratios": {k: float(f"{v:.3g}") for k, v in (check.get("ratios") or {}).items()},
        "retrieval": check.get("retrieval"),
        "workload": check.get("workload"),
    }
    if check.get("stored_error"):
        out["stored_error"] = few(check.get("stored_error"))
    return {k: v for k, v in out.items() if v is not None}
