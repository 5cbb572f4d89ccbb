"""A study's outcome as a results-table entry: finalists' intervals, the margin policy, merging.

The winner is decided by :func:`attnbench.tuning.margin.decide` over the finalists' interleaved
times (:mod:`attnbench.tuning.interleave`), never over times from two different runs. **Merging,
never shrinking**: an existing entry's candidates that this run did not measure are kept when they
were measured under the same attnbench/torch/triton versions and their backend's own code hash is
unchanged (``code_hashes`` per backend, so a run over fewer backends keeps the others); its winner
(the incumbent) is re-measured beside this run's finalists, so it can only lose to a measured rival.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from attnbench.core.device import DeviceProfile
from attnbench.core.version import __version__
from attnbench.tuning.margin import SWITCH_MARGIN, Interval, decide, too_wide
from attnbench.tuning.refine import PointMeasurement
from attnbench.tuning.space import Candidate
from attnbench.tuning.table_schema import TableEntry

if TYPE_CHECKING:  # the study needs Optuna; a summary of its records does not
    from attnbench.tuning.study import KeyResult, TrialRecord

__all__ = ["candidate_label", "mergeable", "summarize", "versions"]

_SAME = ("attnbench", "torch", "triton")


def versions() -> dict[str, str]:
    import torch

    from attnbench.core.device import _triton_version

    return {"attnbench": __version__, "torch": str(torch.__version__), "triton": str(_triton_version())}


def candidate_label(c: Mapping[str, Any]) -> str:
    """The label of a table candidate (``backend[k=v,…]``), as :meth:`Candidate.label` gives it."""
    return Candidate(c["backend"], c.get("config") or {}).label()


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1e3, 4)


def _gate_summary(check: dict[str, Any] | None) -> dict[str, Any] | None:
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


def _cand(r: TrialRecord) -> dict[str, Any]:
    out: dict[str, Any] = {"backend": r.candidate.backend, "config": dict(r.candidate.config)}
    gate = _gate_summary(r.attrs.get("check"))
    if gate:
        out["gate"] = gate
    if r.attrs.get("lossy") or (r.attrs.get("check") or {}).get("lossy"):
        out["lossy"] = r.attrs.get("lossy") or r.attrs["check"]["lossy"]
    if r.ok:
        m = r.attrs
        out |= {"step_ms": _ms(r.value)}
        if m.get("gbps") is not None:
            out["gbps"] = round(m["gbps"], 3)
        if m.get("pct_of_bandwidth") is not None:
            out["pct_of_bandwidth"] = round(m["pct_of_bandwidth"], 2)
        if m.get("implementation"):
            out["implementation"] = m["implementation"]
    else:
        out |= {"failed": r.kind, "reason": r.reason}
        err = (r.attrs.get("check") or {}).get("error")
        if err:
            out["error"] = {k: err[k] for k in ("max_abs", "rel_l2", "cosine", "nonfinite") if k in err}
    return out


def search_interval(r: TrialRecord) -> Interval:
    """A study trial's time as an approximate 95 % interval of its median, from the 10th–90th
    percentile of its steps (p90 − p10 ≈ 2.56 σ; the median's standard error ≈ 1.25 σ / √n). Used
    only to pick the finalists, which are then re-timed interleaved."""
    step = r.attrs.get("step") or {}
    med = (r.value or 0.0) * 1e3
    lo, hi, n = step.get("p10_s"), step.get("p90_s"), int(step.get("repeats", 1) or 1)
    if lo is None or hi is None:
        return Interval.exact(med)
    half = 0.96 * (hi - lo) * 1e3 / n**0.5
    return Interval(med, max(med - half, 1e-9), med + half, n)


def mergeable(prior: Mapping[str, Any], code_hashes: Mapping[str, str]) -> list[dict[str, Any]]:
    """The candidates of an existing entry that may stand beside this run's: same versions, same
    code hash of their own backend (entries without per-backend hashes merge nothing)."""
    now, then = versions(), prior.get("versions") or {}
    if any(now.get(k) != then.get(k) for k in _SAME):
        return []
    hashes = prior.get("code_hashes") or {}
    return [
        dict(c)
        for c in prior.get("candidates") or []
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
    cands: dict[str, dict[str, Any]] = {r.candidate.label(): _cand(r) for r in result.records}
    kinds = {r.candidate.label(): r.kind for r in result.records if not r.ok}
    merged: list[str] = []
    for c in mergeable(prior, code_hashes) if prior else []:
        label = candidate_label(c)
        if label not in cands:
            c.pop("retimed", None)  # re-timed then, not in this run's interleaved measurement
            cands[label] = c | {"merged": prior.get("tuned_at", "earlier")}  # type: ignore[union-attr]
            merged.append(label)
    if retimed is not None:
        times = dict(retimed.times)
        for label, interval in times.items():
            if label in cands:
                study = {} if "merged" in cands[label] else {"study_ms": cands[label].get("step_ms")}
                cands[label] = (
                    cands[label]
                    | {k: v for k, v in study.items() if v is not None}
                    | {
                        "step_ms": round(interval.median_ms, 4),
                        "interval": interval.as_dict(),
                        "retimed": True,
                    }
                )
        for label, why in retimed.failed.items():
            if label in cands and "failed" not in cands[label]:
                cands[label] = cands[label] | {"retime_failed": why}
    else:
        times = {
            r.candidate.label(): Interval.exact(r.value * 1e3) for r in result.records if r.ok and r.value
        }
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
    # too wide to decide: only matters when the result is a tie on a candidate whose interval is wide
    wide = [k for k in too_wide(times) if k in (default_label, verdict.fastest)] if verdict.tie else []
    entry: dict[str, Any] = {
        "model": plan.key.model,
        "shape_hash": plan.key.shape_hash,
        "dtype": plan.key.dtype,
        "batch_bucket": plan.key.batch_bucket,
        "context_bucket": plan.key.context_bucket,
        "measured_at": {"batch": plan.workload.batch, "context": plan.workload.context},
        "winner": winner,
        "decision": decision,
        "tie": verdict.tie,
        "runner_up": runner,
        "margin": round(ratio, 4) if ratio is not None else None,
        "default": cands.get(default_label)
        if default_label in cands
        else ({"backend": default.backend, "missing": True} if default else None),
        "switch_margin": margin,
        "candidates": sorted(cands.values(), key=lambda c: (c.get("step_ms") is None, c.get("step_ms") or 0)),
        "excluded": [e.as_dict() for e in plan.space.excluded],
        "complete": result.complete,
        "study": plan.study_name,
        "trials": len(cands),
        "search": "grid" if plan.exhaustive else "tpe",
        "space_size": plan.space.size(),
        "device_fingerprint_id": profile.id,
        "code_hash": plan.code_hash,
        "code_hashes": {
            b: h for b, h in sorted(code_hashes.items()) if any(c["backend"] == b for c in cands.values())
        },
        "versions": versions(),
        "tuned_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }
    if retimed is not None:
        entry["retimed"] = {
            "interleaved": True,
            "finalists": sorted(times, key=lambda k: times[k].median_ms),
            "samples": min((t.samples for t in times.values()), default=0),
            "load_avg": list(retimed.load_avg),
        }
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
