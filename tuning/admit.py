"""Admitting a candidate to an interleaved re-timing (:mod:`attnbench.tuning.interleave`) at a point
where no study measured it: the correctness gate as in a trial (a verdict passed for a config that
computes the same bits is reused: :func:`verdict_key`), the first step of the model that is then timed
checked against float64 as a trial's timed step is, and room in memory for its models beside the
others' (all finalists' models are held at once)."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from typing import Any

from attnbench.core.device import available_memory, make_room
from attnbench.core.workload import Workload
from attnbench.correctness.timed import CHECK_BUDGET_BYTES, CaseShelf
from attnbench.measure.bench import CheckFailed, gate_candidate
from attnbench.measure.synthetic import SyntheticModel
from attnbench.measure.timed_run import check_timed_step

__all__ = ["KEEP_FREE", "MEMORY_RESERVE", "check_first_step", "gate_here", "room_for", "verdict_key"]


def verdict_key(
    backend_ref: str,
    workload: dict[str, Any],
    config: dict[str, Any],
    neutral: Sequence[str],
    task: dict[str, Any],
) -> str:
    """What decides a gate verdict: the backend, the workload, its config but its ``result_neutral``
    tunables (a config differing only in those computes the same bits) and the gate's own settings
    (the error multiple, a lossy cache's accuracy budget)."""
    kept = {k: v for k, v in config.items() if k not in neutral}
    settings = [task.get("error_multiple"), task.get("accuracy_budget")]
    return json.dumps([backend_ref, workload, kept, settings], sort_keys=True, default=str)


def gate_here(
    backend: Any,
    workload: Workload,
    cand: dict[str, Any],
    task: dict[str, Any],
    cases: CaseShelf | None,
    passed: dict[str, Any],
) -> float:
    """Gate a candidate that no study measured at this point, as a trial does (raises
    :class:`CheckFailed`), and return the multiple its first timed model's step is then checked to
    (:func:`check_first_step`). ``passed``: the verdicts passed so far by :func:`verdict_key` (this run's
    and the worker's studies'): a sibling that differs only in ``result_neutral`` tunables computes the
    same bits, so its gate would repeat the first one's; its step is checked all the same, so a wrong
    declaration still fails."""
    neutral = getattr(backend, "result_neutral", ())
    key = verdict_key(cand["backend_ref"], task["workload"], cand["config"], neutral, task)
    found = passed.get(key)  # (the label of the config that drew it, the verdict)
    verdict, multiple = gate_candidate(
        backend,
        workload,
        config=cand["config"],
        error_multiple=task.get("error_multiple"),
        accuracy_budget=task.get("accuracy_budget"),
        cases=cases,
        gate=found[1] if found else None,
    )
    passed[key] = found or (cand["label"], verdict)
    return multiple


#: what the interleaved run leaves free at the least (besides a gate's inputs, for a candidate gated
#: there): all finalists' models are held at once, and at long contexts on a small machine they do not
#: fit (a 24-GiB machine's worker was killed for memory at three of six keys of a grid); a candidate
#: whose models would take more is timed in a later run (:func:`~attnbench.tuning.interleave.retime`)
MEMORY_RESERVE = 2 * 2**30

#: what the worker leaves free at the least while it keeps the caches' memory of the candidates it timed
#: to lend to the next (:func:`~attnbench.core.device.keep_huge_buffers`): the re-timing's reserve and a
#: gate's inputs' budget
KEEP_FREE = MEMORY_RESERVE + CHECK_BUDGET_BYTES


def room_for(nbytes: int, device: str, task: dict[str, Any], *, checked: bool) -> bool:
    """Whether one more candidate's models (``nbytes``, the most any took so far) fit beside those made,
    leaving :data:`MEMORY_RESERVE` (``task["memory_reserve"]`` where given), and the gate's inputs'
    budget for a candidate gated here, free; ``True`` where the free memory is unknown. The worker's
    kept idle cache buffers (:func:`~attnbench.core.device.keep_huge_buffers`) are freed for it first,
    as far as it needs."""
    reserve = task.get("memory_reserve", MEMORY_RESERVE) + (CHECK_BUDGET_BYTES if checked else 0)
    if device.split(":")[0] == "cpu":  # only a CPU's caches are kept
        make_room(nbytes, keep_free=reserve)
    free = available_memory(device)
    return free is None or free - nbytes >= reserve


def check_first_step(model: SyntheticModel, multiple: float) -> None:
    """One eager step of ``model`` with a layer's output recorded, checked against float64 as
    :func:`~attnbench.measure.timed_run.timed_run` checks a timed step (the layer drawn from the model's
    seed); raises :class:`CheckFailed` when it fails. What is timed after it is this model's steps."""
    spot = random.Random(model.seed * 0x9E3779B1 + 1)
    model.record_layer = spot.randrange(model.num_layers)
    try:
        model.decode_step()
        result = check_timed_step(model, first=0, rng=spot, multiple=multiple)
    finally:
        model.record_layer, model.recorded = None, []
    if result is None:
        raise RuntimeError(f"{model.backend.name}: its checked step recorded no output")
    if not result.passed:
        raise CheckFailed(result)
