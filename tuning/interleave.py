"""Re-timing the finalists interleaved: one decode step of each in turn, round after round.

After a study, every candidate within two confidence intervals of the best (at least three, plus
the default and the incumbent of an existing entry) is timed again in **one worker**, round-robin:
round ``r`` runs one decode step of each candidate, in the order :func:`round_order` gives (a
Williams design: over a cycle of rounds every candidate runs in every position, and right after
every other candidate, equally often). A change in the machine's load then hits every candidate
alike, and so does what one step leaves behind for the next (caches holding another candidate's
pool, freed memory, a busy allocator): with a mere rotation each candidate would follow the same one
in almost every round and inherit its after-effects every time. Each candidate's median gets a
seeded bootstrap interval (:func:`attnbench.tables.margin.bootstrap_median`). Rounds run in blocks
(:func:`attnbench.tables.margin.sample_rounds`): after the first, a candidate whose interval lies
wholly above the best's, by more than the switch margin, stops being timed (the default is often
several times slower than the winner) and the rounds go to those still in doubt. A candidate whose
model is small (short contexts) gets two or four instances (:func:`instances_for`; one where timed as
CUDA graphs): a round steps each of them once, and the candidate's time is the median over its
instances of each one's median over the rounds — over the placements (one config on two instances
has measured up to 25 % apart at sub-millisecond steps), and each instance's series as robust to a
load spike as a single one's. If the interleaved run kills its worker, each candidate is timed alone
(isolated) and a candidate that kills it alone fails with the reason.

The child side (:func:`run_interleaved`) runs in the tuner's worker process (``op: interleave``);
the parent side is :func:`retime`.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from attnbench.core.device import DeviceProfile
from attnbench.core.registry import load_backend_class
from attnbench.core.timing import synchronize, timing_mode
from attnbench.core.workload import Workload, workload_from_dict, workload_to_dict
from attnbench.correctness.timed import CaseShelf
from attnbench.measure.bench import CheckFailed, Implausible, plausibility
from attnbench.measure.graph_step import GraphedDecodeStep
from attnbench.measure.synthetic import SyntheticModel
from attnbench.tables.dispatch import MapCandidate
from attnbench.tables.margin import bootstrap_median, median_time, sample_rounds
from attnbench.tuning.admit import check_first_step, gate_here, room_for
from attnbench.tuning.refine import PointMeasurement

__all__ = ["Finalist", "retime", "round_order", "run_interleaved", "step_scale"]


@dataclass(frozen=True)
class Finalist:
    """A candidate to re-time: its label, the import path its worker loads and its config."""

    label: str
    backend: str
    backend_ref: str
    config: dict[str, Any]
    lossy: str = ""
    #: gate it at this point first (a finalist of another key that this point's study never measured)
    check: bool = False


def round_order(n: int, r: int, *, seed: int = 0) -> list[int]:
    """The order of ``n`` candidates in round ``r``: a row of a Williams design, relabelled per cycle.

    For even ``n`` the ``n`` rows ``0, 1, n-1, 2, n-2, …`` shifted by the row number make a Latin
    square in which every ordered pair of candidates is adjacent exactly once; for odd ``n`` those
    rows and their reverses (``2n`` rows) make every ordered pair adjacent exactly twice. So over a
    cycle each candidate runs in every position, and right after every other candidate, equally
    often within the rounds. The step between two rounds (one round's last, the next one's first)
    is not balanced by the square, so each cycle's candidates are relabelled by a permutation drawn
    from ``seed`` and the cycle number: those extra transitions then fall on different pairs from
    cycle to cycle instead of always on the same one.
    """
    if n <= 0:
        return []
    base = [0, *((k + 1) // 2 if k % 2 else n - k // 2 for k in range(1, n))]  # 0, 1, n-1, 2, n-2, …
    rows = n if n % 2 == 0 else 2 * n
    cycle, j = divmod(r, rows)
    label = list(range(n))
    random.Random(f"{seed}:{cycle}").shuffle(label)
    row = [label[(x + j % n) % n] for x in base]
    return row if j < n else row[::-1]


# --------------------------------------------------------------------------------------------------
# child side (in the worker)
# --------------------------------------------------------------------------------------------------
def run_interleaved(
    task: dict[str, Any],
    *,
    cases: CaseShelf | None = None,
    model_seed: int | None = None,
    verdicts: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Gate (where asked: the task's ``check``, or a candidate's: the gate, then the first step of the
    candidate's first timed model checked against float64, the same two checks as a trial's on the
    models that are timed, with no model filled just to be checked) and time ``task["candidates"]``
    round-robin; returns samples per label. ``cases`` and ``model_seed``: the worker's gate draw and
    synthetic-model seed for this workload, which a gate here shares with the studies' (see the worker).
    ``verdicts``: the gate verdicts passed so far by :func:`verdict_key` (the worker's, its studies'
    too), where a candidate differing from one gated only in ``result_neutral`` tunables finds its own."""

    workload = workload_from_dict(task["workload"])
    clock = _clock(task.get("clock"))
    profile = DeviceProfile(**task["profile"]) if task.get("profile") else None
    samples, warmup = int(task.get("samples", 15)), int(task.get("warmup", 1))
    failed: dict[str, str] = {}
    models: dict[str, list[SyntheticModel]] = {}  # label -> its instances (:func:`instances_for`)
    #: label -> its instances' steps as timed (CUDA graph replays where capturable)
    steps: dict[str, list[Any]] = {}
    graph = timing_mode(task.get("timing"), workload.device) == "graph"
    #: the first model filled of each cache layout (:func:`_layout`): the later ones copy its cache
    filled: dict[tuple[str, ...], SyntheticModel] = {}
    passed: dict[str, Any] = verdicts if verdicts is not None else {}  # by verdict_key
    #: where the run's time went (:func:`_spend`): the gates, the caches, the checked steps, warm-up, rounds
    phases: dict[str, float] = {}
    deferred: list[str] = []  # no room for their models beside the others': timed in a later run
    largest = 0  # the most bytes one candidate's models took so far
    try:
        for cand in task["candidates"]:
            label = cand["label"]
            checked = bool(task.get("check") or cand.get("check"))
            if models and not room_for(largest, workload.device, task, checked=checked):
                deferred.append(label)
                continue
            try:
                backend = load_backend_class(cand["backend_ref"])()
                reasons = backend.supports(workload)
                if reasons:
                    failed[label] = "unsupported: " + "; ".join(reasons)
                    continue
                multiple = None  # the multiple its first model's first step is checked to, where gated here
                if checked:  # not measured here: the gate first, as in a trial
                    with _spend(phases, "gate"):
                        multiple = gate_here(backend, workload, cand, task, cases, passed)
                models[label], steps[label] = _instances(
                    backend,
                    workload,
                    cand["config"],
                    task,
                    graph=graph,
                    extra=warmup + 4 * samples + 2,
                    filled=filled,
                    check=multiple,
                    seed=model_seed,
                    phases=phases,
                )
                largest = max(largest, sum(m.cache.nbytes() for m in models[label] if m.cache is not None))
            except CheckFailed as err:
                failed[label] = f"gate: {err}"
            except Implausible as err:
                failed[label] = f"implausible: {err}"
            except Exception as err:  # the candidate's own failure: the others are still timed
                failed[label] = f"exception: {type(err).__name__}: {err}"
        order = list(models)
        seed = task.get("seed", 0)

        def one_round(r: int, labels: Sequence[str] | None) -> dict[str, float | list[float]]:
            """One step of each of ``labels``: its time, or one per instance (:func:`bootstrap_median`)."""
            got: dict[str, float | list[float]] = {}
            timed = list(labels) if labels is not None else order  # those still in doubt
            for i in round_order(len(timed), r, seed=seed):  # balanced for position and for predecessor
                label = timed[i]
                ms = []
                for step in steps[label]:  # each of its instances once, each its own series
                    t0 = clock()
                    step()
                    synchronize(workload.device)
                    ms.append((clock() - t0) * 1e3)
                got[label] = ms[0] if len(ms) == 1 else ms
            return got

        synchronize(workload.device)
        rounds = time.perf_counter()
        times = (
            sample_rounds(
                one_round,
                samples=samples,
                max_samples=task.get("max_samples"),
                seed=seed,
                max_seconds=task.get("max_seconds"),
                protect=task.get("protect") or (),
            )
            if order
            else {}
        )
        phases["rounds"] = time.perf_counter() - rounds
        for label, made in models.items():
            med = median_time(times[label]) / 1e3
            why = plausibility(kv_bytes=made[0].kv_bytes_per_step(), seconds=med, profile=profile)
            if why:
                failed[label] = f"implausible: {why}"
                del times[label]
        scale = step_scale(task, workload)  # a tuner's step of fewer layers, as the model's step
        times = {label: _scaled(t, scale) for label, t in times.items()}
    finally:
        with _spend(phases, "release"):  # the models' memory handed back
            for made in models.values():
                for model in made:
                    model.release()
            models.clear()
            steps.clear()
            gc.collect()
    attrs = {"samples_ms": times, "failed": failed, "deferred": deferred}
    return {"ok": True, "attrs": attrs, "phases": phases}


def step_scale(task: dict[str, Any], workload: Workload) -> float:
    """What a timed step's time is multiplied by to stand for a step of the task's ``step_layers``
    (a tuner's step of :func:`~attnbench.measure.layers.timed_layers` layers, as the model's step)."""
    run = task.get("num_layers") or workload.shape.num_layers
    return (task.get("step_layers") or run) / run


def _scaled(samples: Any, factor: float) -> Any:
    """Round times (one series, or one per instance) each ``factor`` times as long."""
    return [_scaled(x, factor) for x in samples] if isinstance(samples, list) else samples * factor


#: models per candidate by the size of its caches (:func:`instances_for`): two instances of one
#: config have measured up to 25 % apart at sub-millisecond steps (the same computation on other
#: memory: its pages' placement), more than the margins the re-timing decides by; a candidate's time
#: is the median over its instances of each one's median, so it is over placements, not one
#: placement's luck. The smaller the caches, the cheaper an instance and the larger that spread.
INSTANCES = ((128 * 2**20, 4), (512 * 2**20, 2))


def instances_for(nbytes: int) -> int:
    """How many model instances a candidate whose caches take ``nbytes`` is timed on (:data:`INSTANCES`):
    one above 512 MiB (long contexts: a step long enough that one placement's luck is small beside it)."""
    return next((n for limit, n in INSTANCES if nbytes <= limit), 1)


def _wanted(model: SyntheticModel) -> int:
    return instances_for(model.cache.nbytes()) if model.cache is not None else 1


def _layout(backend: Any, config: dict[str, Any]) -> tuple[str, ...] | None:
    """What models of ``backend`` must share to copy one another's filled cache: its class and the
    config but its ``cache_neutral`` tunables; ``None`` for a backend that declares none (its cache is
    filled every time)."""
    neutral = getattr(backend, "cache_neutral", ())
    if not neutral:
        return None
    cls = type(backend)
    kept = sorted(f"{k}={v!r}" for k, v in backend.resolve_config(config).items() if k not in neutral)
    return (f"{cls.__module__}.{cls.__qualname__}", *kept)


def _instances(
    backend: Any,
    workload: Any,
    config: dict[str, Any],
    task: dict[str, Any],
    *,
    graph: bool,
    extra: int,
    filled: dict[tuple[str, ...], SyntheticModel] | None = None,
    check: float | None = None,
    seed: int | None = None,
    phases: dict[str, float] | None = None,
) -> tuple[list[SyntheticModel], list[Any]]:
    """One candidate's filled, warmed-up models (more than one where the first is small:
    :func:`instances_for`; ``task["instances"]`` where given; one where timed as CUDA graphs: the
    spread between placements was measured on CPUs) and their steps; the models are released
    if making any of them fails. A round steps each instance once and keeps each one's time: the
    candidate's time is the median over the instances of their medians (pooling the instances' steps
    as one series gives a mixture of their speeds, whose median jumps between them; a round's median
    over the instances is moved by one load spike in two instances, or two in four).

    ``filled``: the first model filled of each cache layout in this run (:func:`_layout`); a model
    of a layout already there copies its cache (:meth:`SyntheticModel.fill_like`: the same bytes in
    memory of its own) instead of generating and writing it again — a finalist's further instances,
    and finalists that differ only in tunables that never change the cache (KV splits, a prefetch
    distance).

    ``check``: the multiple the first model's first step is checked to (:func:`_check_step`; a
    candidate gated here, not in a study), ``None`` for none. ``seed``: the first model's seed (the
    worker's for this workload, whose float64 references the studies' checks share). ``phases``: the
    seconds spent filling (``cache``), checking (``check``) and warming up (``warmup``) are added there."""
    spent: dict[str, float] = phases if phases is not None else {}
    made: list[SyntheticModel] = []
    calls: list[Any] = []
    warmup = int(task.get("warmup", 1))
    layout = _layout(backend, config) if filled is not None else None
    try:
        while not made or (not graph and len(made) < (task.get("instances") or _wanted(made[0]))):
            model = SyntheticModel(
                backend,
                workload,
                config=config,
                num_layers=task.get("num_layers"),
                materialise_bytes=task.get("materialise_bytes"),
                seed=None if made else seed,
            )
            made.append(model)
            source = filled.get(layout) if filled is not None and layout is not None else None
            with _spend(spent, "cache"):
                if source is not None and source.cache is not None:
                    model.fill_like(source, extra_tokens=extra)
                else:
                    model.fill(extra_tokens=extra)
                    if filled is not None and layout is not None:
                        filled[layout] = model
            if check is not None and len(made) == 1:
                with _spend(spent, "check"):
                    check_first_step(model, check)
            capturable = graph and getattr(model.cache, "capturable", False)
            step = GraphedDecodeStep(model) if capturable else model.decode_step
            with _spend(spent, "warmup"):
                for _ in range(max(warmup, 1 if graph else 0)):  # a graph is captured in its first step
                    step()
            calls.append(step)
    except BaseException:
        for model in made:
            model.release()
        raise
    return made, calls


@contextlib.contextmanager
def _spend(phases: dict[str, float], phase: str) -> Iterator[None]:
    """Add the wall seconds of the ``with`` body to ``phases[phase]``."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        phases[phase] = phases.get(phase, 0.0) + time.perf_counter() - t0


def _clock(ref: str | None) -> Any:
    """``time.perf_counter``, or the zero-argument clock at import path ``ref`` (tests plant one)."""
    if not ref:
        return time.perf_counter

    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


# --------------------------------------------------------------------------------------------------
# parent side
# --------------------------------------------------------------------------------------------------
def retime(
    worker: Any,
    finalists: Sequence[Finalist],
    *,
    workload: Any,
    samples: int = 15,
    warmup: int = 1,
    check: bool = False,
    num_layers: int | None = None,
    materialise_bytes: int | None = None,
    error_multiple: float | None = None,
    accuracy_budget: float | None = None,
    profile: dict[str, Any] | None = None,
    timeout_s: float = 120.0,
    seed: int = 0,
    clock: str | None = None,
    timing: str | None = None,
    max_seconds: float | None = None,
    instances: int | None = None,
    step_layers: int | None = None,
    protect: Sequence[str] = (),
) -> PointMeasurement:
    """Time ``finalists`` interleaved in ``worker``; fall back to one at a time if it dies.

    ``clock``: import path of a zero-argument clock in seconds to time with instead of
    ``time.perf_counter`` (tests plant a virtual one, so that planted timings ignore the load).
    ``max_seconds``: no new block of rounds once the rounds took that long (the first block always runs;
    :func:`attnbench.tables.margin.sample_rounds`), over all the runs the worker's memory splits the
    finalists into: a later run gets what the earlier ones left (at least its first block). ``instances``: model instances per finalist, at
    least 1 (default: by the size of its caches, :func:`instances_for`). ``step_layers``: the layers
    the times stand for, each step × ``step_layers`` / ``num_layers`` (None: as timed). ``protect``:
    the default and an incumbent among them, timed while within the switch margin of the best
    (:func:`attnbench.tables.margin.contending`); the others while they could be the fastest.
    """
    if instances is not None and (
        isinstance(instances, bool) or not isinstance(instances, int) or instances < 1
    ):
        raise ValueError(
            f"retime: instances={instances!r}; expected a whole number of model instances >= 1, or None"
        )

    base = {
        "op": "interleave",
        "workload": workload_to_dict(workload),
        "samples": samples,
        "warmup": warmup,
        "check": check,
        "num_layers": num_layers,
        "step_layers": step_layers,
        "materialise_bytes": materialise_bytes,
        "error_multiple": error_multiple,
        "accuracy_budget": accuracy_budget,
        "profile": profile,
        "seed": seed,
        "clock": clock,
        "timing": timing,
        "max_seconds": max_seconds,
        "instances": instances,
        "protect": list(protect),
    }

    rounds_s = 0.0  # the rounds' seconds so far, over the runs (a budget for the key, not per run)

    def ask(group: Sequence[Finalist]) -> tuple[dict[str, list[Any]], dict[str, str], list[str]]:
        nonlocal rounds_s
        left = None if max_seconds is None else max(0.0, max_seconds - rounds_s)
        message = base | {
            "max_seconds": left,
            "candidates": [
                {"label": f.label, "backend_ref": f.backend_ref, "config": f.config, "check": f.check}
                for f in group
            ],
        }
        outcome = worker.request(message, timeout=timeout_s * max(1, len(group)) * 2)
        if outcome.ok:
            rounds_s += (outcome.phases or {}).get("rounds", 0.0)
            return outcome.attrs["samples_ms"], outcome.attrs["failed"], outcome.attrs.get("deferred", [])
        raise _Died(f"{outcome.kind}: {outcome.reason}")

    load = os.getloadavg()
    evaluations = len(finalists)
    isolated = ""
    try:
        raw, failed, later = ask(finalists)
        runs = 1
        while later:  # the worker's memory held only some models at once: the rest in runs of their own
            rest = [f for f in finalists if f.label in later]
            got, bad, later = ask(rest)
            raw, failed, runs, evaluations = raw | got, failed | bad, runs + 1, evaluations + len(rest)
        if runs > 1:
            isolated = f"memory: the finalists' models did not fit at once; timed in {runs} interleaved runs"
    except _Died as died:
        raw, failed = {}, {}
        isolated = f"the interleaved run's worker died ({died}): each candidate timed alone"
        if len(finalists) == 1:
            failed[finalists[0].label] = str(died)
        else:  # isolated runs: a candidate that kills its worker alone is the one to blame
            for f in finalists:
                evaluations += 1
                try:
                    got, bad, _ = ask([f])
                except _Died as alone:
                    bad, got = {f.label: str(alone)}, {}
                raw |= got
                failed |= bad
    times = {k: bootstrap_median(v, seed=seed) for k, v in raw.items() if v}
    return PointMeasurement(
        times=times,
        failed=failed,
        candidates={f.label: MapCandidate(f.backend, dict(f.config), f.lossy) for f in finalists},
        load_avg=tuple(round(x, 2) for x in load),
        evaluations=evaluations,
        isolated=isolated if len(finalists) > 1 else "",
    )


class _Died(RuntimeError):
    pass
