"""Isolated worker processes: each candidate is checked and timed in a child process with a timeout.

The parent (:class:`attnbench.tuning.supervisor.Worker`) starts ``python -m attnbench.tuning.worker``
in its own session and talks to it in JSON lines over a private pipe (the child's ``stdout`` is
redirected to its ``stderr``, so a backend that prints cannot corrupt the protocol). A worker serves
candidates one after another; when a candidate crashes the process (``os._exit``, a segfault, the
kernel's out-of-memory killer), hangs past its timeout, or the pipe breaks, the parent records the
reason, kills the worker's process group and starts a fresh one for the next candidate. An exception,
an out-of-memory error, a failed correctness gate or a NaN is reported by the worker itself, which
stays alive. The worker asks the kernel for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``), so it
never outlives a killed tuner, even while a backend holds the GIL in C code. The parent keeps the
worker's stderr in a temporary file and reads only its tail, from the end, so a backend's endless
output costs disk, never the tuner's memory.

Backends are loaded by import path (``"package.module:Class"``), or by registry name, so a backend
registered only in a test's registry, or by a plugin, reaches the worker the same way.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import math
import os
import resource
import signal
import statistics
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from attnbench.core.child import die_with_parent
from attnbench.core.device import keep_huge_buffers
from attnbench.core.workload import workload_from_dict
from attnbench.correctness.timed import CaseShelf
from attnbench.tables.table_schema import CandidateResult
from attnbench.tuning.admit import KEEP_FREE, verdict_key
from attnbench.tuning.interleave import run_interleaved, step_scale
from attnbench.tuning.summary import gate_summary, study_interval

__all__ = ["MEASURE_SETTINGS", "OnReport", "Outcome", "WorkerTask", "evaluate"]

_ERROR_KEYS = ("max_abs", "rel_l2", "cosine", "nonfinite")  # a failed candidate's error, in its record
#: a running study's answer to each timed step's running median (seconds): prune the candidate?
OnReport = Callable[[int, float], bool] | None
_OOM_MARKERS = ("out of memory", "can't allocate memory", "cannot allocate memory", "outofmemoryerror")


#: the settings of a measurement that a task carries from the tune's options to ``measure_decode``
MEASURE_SETTINGS: tuple[str, ...] = ("warmup", "repeats", "max_seconds", "num_layers", "materialise_bytes")
MEASURE_SETTINGS += ("error_multiple", "accuracy_budget", "timing")


@dataclass(frozen=True)
class WorkerTask:
    """What a worker needs to check and time one candidate (everything JSON-serialisable)."""

    backend_ref: str
    config: dict[str, Any]
    workload: dict[str, Any]  # {"shape": fields, "context_lens": [...], "dtype": "bf16", "device": "cpu"}
    profile: dict[str, Any] | None = None
    warmup: int = 2
    repeats: int = 10
    max_seconds: float | None = None
    num_layers: int | None = None
    materialise_bytes: int | None = None
    error_multiple: float | None = None
    accuracy_budget: float | None = None
    timing: str | None = None  # the objective: "eager" or "graph" (None: graph on CUDA, else eager)
    backend: str = ""  # the candidate's name in the search space (its record's ``backend``)
    #: report each timed step's running median to the parent, which may answer "prune" (Optuna's pruner)
    report: bool = False
    #: the layers the reported times stand for (None: ``num_layers``): each is step × these / num_layers
    step_layers: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


@dataclass
class Outcome:
    """What came of one candidate: ``ok`` with ``value`` (median step seconds), or a failure.

    ``kind`` of a failure: ``gate`` (wrong values, in the gate or in the timed run), ``implausible``
    (faster than the measured read bandwidth allows), ``nan`` (non-finite output or time), ``exception``,
    ``oom``, ``crash`` (the process died), ``timeout`` (hang), ``unsupported``, ``not-timed``,
    ``interrupted`` (Ctrl-C; not a verdict on the candidate); ``pruned`` is no failure: the gate passed
    and the parent's pruner stopped the timed steps early (``value``: their median so far).
    """

    ok: bool
    value: float | None = None
    kind: str = ""
    reason: str = ""
    attrs: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0
    result: CandidateResult | None = None  # a candidate's trial record, as the worker built it
    #: where the worker's time went (``DecodeMeasurement.phases``; a measured candidate only)
    phases: dict[str, float] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------------
# child side
# --------------------------------------------------------------------------------------------------
def _classify(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".lower()
    if isinstance(err, MemoryError) or any(m in text for m in _OOM_MARKERS):
        return "oom"
    return "exception"


def evaluate(task: dict[str, Any]) -> dict[str, Any]:
    """Check, then time, one candidate (runs in the worker).

    Returns the verdict line: ``ok``, ``value`` (median step seconds), ``kind`` and ``reason`` of a
    failure, ``result`` (the trial's :class:`CandidateResult` as a dict) and ``attrs`` (a failure's
    traceback)."""
    # deferred: the worker loads torch and the measuring code only once its stdout is the protocol's and
    # its memory limit is set (main); the parent, which imports this module too, needs neither here
    from attnbench.core.device import DeviceProfile
    from attnbench.core.registry import load_backend_class
    from attnbench.measure.bench import CheckFailed, Implausible, measure_decode
    from attnbench.measure.timed_run import ModelShelf, Pruned

    global _SHELF
    if _SHELF is None:
        _SHELF = ModelShelf()

    name, config = task.get("backend") or task["backend_ref"], task["config"]

    def failed(kind: str, reason: str, check: Any = None, **attrs: Any) -> dict[str, Any]:
        error = {k: v for k, v in ((check or {}).get("error") or {}).items() if k in _ERROR_KEYS} or None
        gate, lossy = gate_summary(check), (check or {}).get("lossy") or None
        result = CandidateResult(
            name, config, failed=kind, reason=reason, gate=gate, lossy=lossy, error=error
        )
        return {"ok": False, "kind": kind, "reason": reason, "result": result.as_dict(), "attrs": attrs}

    scale = 1.0
    try:
        backend = load_backend_class(task["backend_ref"])()
        workload = workload_from_dict(task["workload"])
        resolution = backend.resolve(workload, config)
        if not resolution.runnable:
            return failed("unsupported", "; ".join(resolution.reasons))
        profile = DeviceProfile(**task["profile"]) if task.get("profile") else None
        settings: dict[str, Any] = {k: task.get(k) for k in MEASURE_SETTINGS}
        key = verdict_key(task["backend_ref"], task["workload"], config, backend.result_neutral, task)
        passed = _PASSED.get(key)
        scale = step_scale(task, workload)
        report = _reporter(int(task.get("repeats") or 0), scale) if task.get("report") else None
        m = measure_decode(
            backend, workload, config=config, resolution=resolution, profile=profile, check=True,
            gate=passed[1] if passed else None, shelf=_SHELF, report=report, cases=_CASES,
            seed=_seed_for(task["workload"]), **settings,
        )  # fmt: skip
        if passed is None and m.check is not None and m.check.passed:
            _PASSED[key] = (_label(name, config), m.check)
    except Pruned as err:  # the gate passed; the parent's pruner stopped the timed steps early
        if passed is None and err.check is not None and err.check.passed:
            _PASSED[key] = (_label(name, config), err.check)
        check = err.check.as_dict() if err.check is not None else None
        verdict = failed("pruned", f"{err}: the tuner's pruner found it slower than others there", check)
        verdict["result"]["implementation"] = resolution.implementation or None
        running = err.step.median_s * scale  # its running median there
        verdict["result"]["study_ms"] = round(running * 1e3, 4)
        return verdict | {"value": running, "phases": err.phases}
    except CheckFailed as err:
        return failed("nan" if err.check.error.nonfinite else "gate", str(err), err.check.as_dict())
    except Implausible as err:  # faster than the device can read: a measurement bug, never a winner
        return failed("implausible", str(err))
    except Exception as err:  # the candidate's own failure: report it, stay alive for the next one
        tb = traceback.format_exc().strip().splitlines()
        return failed(_classify(err), f"{type(err).__name__}: {err}", traceback="\n".join(tb[-12:]))
    check = m.check.as_dict() if m.check else None
    if not m.timed or m.step is None:
        return failed("not-timed", m.note or "not timed", check)
    step = m.step.scaled(scale)
    value = step.median_s
    if not math.isfinite(value) or value <= 0:
        return failed("nan", f"step time {value!r} is not a positive number", check)
    gate = gate_summary(check)
    if gate is not None and passed is not None:
        gate["reused_from"] = passed[0]  # the same bits as this config: the verdict was not drawn again
    result = CandidateResult(
        name,
        config,
        step_ms=round(value * 1e3, 4),
        gbps=None if math.isnan(m.gbps) else round(m.gbps, 3),
        pct_of_bandwidth=None if m.pct_of_bandwidth is None else round(m.pct_of_bandwidth, 2),
        implementation=m.implementation or None,
        gate=gate,
        lossy=(check or {}).get("lossy") or None,
        study_interval=study_interval(step).as_dict(),
    )
    return {"ok": True, "value": value, "result": result.as_dict(), "phases": m.phases}


#: the filled model of the last candidate whose backend declares ``cache_neutral`` tunables: the next
#: candidate that differs from it only in those is timed on it (attnbench.measure.timed_run.ModelShelf)
_SHELF: Any = None

#: the gate's inputs and float64 references of the last workload gated: a study's candidates share one
#: draw, each gated in full against it (attnbench.correctness.timed.CaseShelf)
_CASES = CaseShelf()

#: a seed per workload for the models this worker times: a study's candidates share inputs and history,
#: so the timed check's float64 references are computed once (attnbench.measure.timed_run)
_SEEDS: dict[str, int] = {}


def _seed_for(workload: dict[str, Any]) -> int:
    return _SEEDS.setdefault(json.dumps(workload, sort_keys=True), int.from_bytes(os.urandom(4), "little"))


#: the worker's way to ask the parent a question mid-task (set by main: a line out, a line back)
_ASK: Any = None


def _reporter(repeats: int, scale: float) -> Any:
    """``report(samples)`` for :func:`measure_decode`: each timed step's running median (× ``scale``, as
    the model's step) to the parent, which answers whether to prune (Optuna's pruner, in the study);
    the last of ``repeats`` steps is not reported (stopping there saves nothing)."""

    def report(samples: list[float]) -> bool:
        if _ASK is None or len(samples) >= repeats:
            return False
        answer = _ASK({"report": len(samples), "value": statistics.median(samples) * scale})
        return bool(answer.get("prune"))

    return report


#: the gate verdicts this worker drew and passed, by what decides them
#: (:func:`~attnbench.tuning.interleave.verdict_key`: a candidate differing only in ``result_neutral``
#: tunables computes the same bits, so its gate would repeat this one's), for its trials and its
#: interleaved re-timings alike; each value the label of the config that drew it and the verdict
_PASSED: dict[str, tuple[str, Any]] = {}


def _label(name: str, config: dict[str, Any]) -> str:
    return f"{name}[{','.join(f'{k}={v}' for k, v in sorted(config.items()))}]" if config else name


def main() -> None:
    """The worker process: read a task per line, answer a verdict per line."""

    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything a backend prints goes to stderr, never into the protocol
    faulthandler.enable()  # a segfault leaves its Python traceback in stderr for the parent
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    init = json.loads(sys.stdin.readline())
    for entry in reversed(init.get("sys_path", [])):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    if init.get("memory_limit_bytes"):
        limit = int(init["memory_limit_bytes"])
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    die_with_parent(init["parent"])
    # torch and the measuring code, now that stdout is the protocol's and the limit is set, before "ready"
    import torch

    import attnbench.measure.bench  # noqa: F401

    # what is loaded now lives as long as the worker: out of the collector's sight, a full collection
    # (the measuring code runs one after each candidate, to hand back its caches) scans only what the
    # candidates made, ~50 µs instead of ~70 ms over torch's objects (measured: 124 trials, 8.7 s of a tune)
    gc.freeze()
    if not init.get("memory_limit_bytes"):  # caches' memory kept and lent again: first touches cost seconds
        keep_huge_buffers(KEEP_FREE)
    if init.get("threads"):  # the parent's thread count (`tune --threads`): its fingerprint says so
        torch.set_num_threads(int(init["threads"]))

    def ask(message: dict[str, Any]) -> dict[str, Any]:
        proto.write(json.dumps(message) + "\n")
        line = sys.stdin.readline()
        return json.loads(line) if line.strip() else {}

    global _ASK
    _ASK = ask
    proto.write(json.dumps({"ready": True, "pid": os.getpid()}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        task = json.loads(line)
        # finalists are timed round-robin (attnbench.tuning.interleave); any other task is one candidate
        if task.get("op") == "interleave":  # its finalists' models need the memory the shelf holds
            if _SHELF is not None:
                _SHELF.clear()
            _CASES.clear()
            verdict = run_interleaved(
                task, cases=_CASES, model_seed=_seed_for(task["workload"]), verdicts=_PASSED
            )
        else:
            verdict = evaluate(task)
        proto.write(json.dumps(verdict, default=str) + "\n")


if __name__ == "__main__":
    main()
