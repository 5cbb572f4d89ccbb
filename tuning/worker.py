"""Isolated worker processes: each candidate is checked and timed in a child process with a timeout.

The parent (:class:`Worker`) starts ``python -m attnbench.tuning.worker`` in its own session and talks
to it in JSON lines over a private pipe (the child's ``stdout`` is redirected to its ``stderr``, so a
backend that prints cannot corrupt the protocol). A worker serves candidates one after another; when a
candidate crashes the process (``os._exit``, a segfault, the kernel's out-of-memory killer), hangs past
its timeout, or the pipe breaks, the parent records the reason, kills the worker's process group and
starts a fresh one for the next candidate. An exception, an out-of-memory error, a failed correctness
gate or a NaN is reported by the worker itself, which stays alive. The worker asks the kernel for
SIGKILL when its parent dies (``PR_SET_PDEATHSIG``), so it never outlives a killed tuner, even while a
backend holds the GIL in C code. The parent keeps the worker's stderr in a temporary file and reads
only its tail, from the end, so a backend's endless output costs disk, never the tuner's memory.

Backends are loaded by import path (``"package.module:Class"``), or by registry name, so a backend
registered only in a test's registry, or by a plugin, reaches the worker the same way.
"""

from __future__ import annotations

import ctypes
import faulthandler
import gc
import json
import math
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from attnbench.core.child import Child
from attnbench.core.workload import workload_from_dict
from attnbench.tables.margin import Interval
from attnbench.tables.table_schema import CandidateResult
from attnbench.tuning.interleave import run_interleaved

if TYPE_CHECKING:
    from attnbench.core.timing import Timing

__all__ = ["Outcome", "Worker", "WorkerTask", "evaluate"]

_ERROR_KEYS = ("max_abs", "rel_l2", "cosine", "nonfinite")  # a failed candidate's error, in its record
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

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


@dataclass
class Outcome:
    """What came of one candidate: ``ok`` with ``value`` (median step seconds), or a failure.

    ``kind`` of a failure: ``gate`` (wrong values, in the gate or in the timed run), ``implausible``
    (faster than the measured read bandwidth allows), ``nan`` (non-finite output or time), ``exception``,
    ``oom``, ``crash`` (the process died), ``timeout`` (hang), ``unsupported``, ``not-timed``,
    ``interrupted`` (Ctrl-C; not a verdict on the candidate).
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
    from attnbench.measure.timed_run import ModelShelf

    global _SHELF
    if _SHELF is None:
        _SHELF = ModelShelf()

    name, config = task.get("backend") or task["backend_ref"], task["config"]

    def failed(kind: str, reason: str, check: Any = None, **attrs: Any) -> dict[str, Any]:
        error = {k: v for k, v in ((check or {}).get("error") or {}).items() if k in _ERROR_KEYS} or None
        gate, lossy = _gate_summary(check), (check or {}).get("lossy") or None
        result = CandidateResult(
            name, config, failed=kind, reason=reason, gate=gate, lossy=lossy, error=error
        )
        return {"ok": False, "kind": kind, "reason": reason, "result": result.as_dict(), "attrs": attrs}

    try:
        backend = load_backend_class(task["backend_ref"])()
        workload = workload_from_dict(task["workload"])
        resolution = backend.resolve(workload, config)
        if not resolution.runnable:
            return failed("unsupported", "; ".join(resolution.reasons))
        profile = DeviceProfile(**task["profile"]) if task.get("profile") else None
        settings: dict[str, Any] = {k: task.get(k) for k in MEASURE_SETTINGS}
        key = _gate_key(task, config, backend.result_neutral)
        passed = _PASSED.get(key)
        m = measure_decode(
            backend, workload, config=config, resolution=resolution, profile=profile, check=True,
            gate=passed[1] if passed else None, shelf=_SHELF, **settings,
        )  # fmt: skip
        if passed is None and m.check is not None and m.check.passed:
            _PASSED[key] = (_label(name, config), m.check)
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
    value = m.step.median_s
    if not math.isfinite(value) or value <= 0:
        return failed("nan", f"step time {value!r} is not a positive number", check)
    gate = _gate_summary(check)
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
        study_interval=_study_interval(m.step).as_dict(),
    )
    return {"ok": True, "value": value, "result": result.as_dict(), "phases": m.phases}


#: the filled model of the last candidate whose backend declares ``cache_neutral`` tunables: the next
#: candidate that differs from it only in those is timed on it (attnbench.measure.timed_run.ModelShelf)
_SHELF: Any = None

#: the gate verdicts this worker drew and passed, by what decides them: the backend, the workload, the
#: measuring settings and the config without its ``result_neutral`` tunables (a candidate differing
#: only in those computes the same bits, so its gate would repeat this one's); each value the label of
#: the config that drew it and the verdict
_PASSED: dict[str, tuple[str, Any]] = {}


def _gate_key(task: dict[str, Any], config: dict[str, Any], neutral: tuple[str, ...]) -> str:
    settings = {k: task.get(k) for k in MEASURE_SETTINGS}
    kept = {k: v for k, v in config.items() if k not in neutral}
    return json.dumps([task["backend_ref"], task["workload"], settings, kept], sort_keys=True, default=str)


def _label(name: str, config: dict[str, Any]) -> str:
    return f"{name}[{','.join(f'{k}={v}' for k, v in sorted(config.items()))}]" if config else name


def _study_interval(step: Timing) -> Interval:
    """A study trial's time as an approximate 95 % interval of its median, from the 10th–90th
    percentile of its steps (p90 − p10 ≈ 2.56 σ; the median's standard error ≈ 1.25 σ / √n). Used
    only to pick the finalists, which are then re-timed interleaved."""
    med, n = step.median_s * 1e3, max(1, step.repeats)
    half = 0.96 * (step.p90_s - step.p10_s) * 1e3 / n**0.5
    return Interval(med, max(med - half, 0.0), med + half, n)


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


def _die_with_parent(parent: int) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux ``PR_SET_PDEATHSIG``).

    Unlike a watcher thread, this works while a backend holds the GIL in C code. The signal follows
    the parent *thread* that started the worker, so the tuner starts workers from its main thread.
    Elsewhere, a watcher thread is the fallback.
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, signal.SIGKILL, 0, 0, 0) == 0:  # PR_SET_PDEATHSIG = 1
            if os.getppid() != parent:  # the parent died before the call: nobody will signal
                os._exit(3)
            return
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()


def _watch_parent(parent: int) -> None:
    while True:  # an orphaned worker (parent killed) must not run on
        if os.getppid() != parent:
            os._exit(3)
        time.sleep(1.0)


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
    _die_with_parent(init["parent"])
    # torch and the measuring code, now that stdout is the protocol's and the limit is set, before "ready"
    import torch

    import attnbench.measure.bench  # noqa: F401

    # what is loaded now lives as long as the worker: out of the collector's sight, a full collection
    # (the measuring code runs one after each candidate, to hand back its caches) scans only what the
    # candidates made, ~50 µs instead of ~70 ms over torch's objects (measured: 124 trials, 8.7 s of a tune)
    gc.freeze()
    if init.get("threads"):  # the parent's thread count (`tune --threads`): its fingerprint says so
        torch.set_num_threads(int(init["threads"]))

    proto.write(json.dumps({"ready": True, "pid": os.getpid()}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        task = json.loads(line)
        # finalists are timed round-robin (attnbench.tuning.interleave); any other task is one candidate
        if task.get("op") == "interleave":  # its finalists' models need the memory the shelf holds
            if _SHELF is not None:
                _SHELF.clear()
            verdict = run_interleaved(task)
        else:
            verdict = evaluate(task)
        proto.write(json.dumps(verdict, default=str) + "\n")


# --------------------------------------------------------------------------------------------------
# parent side
# --------------------------------------------------------------------------------------------------
class WorkerDied(RuntimeError):
    pass


class Worker:
    """A replaceable child process that evaluates candidates one at a time.

    ``run(task, timeout=...)`` never raises for a candidate's failure: it returns an :class:`Outcome`
    and, if the process died or hung, replaces it before the next call. ``KeyboardInterrupt`` kills the
    worker and propagates. Use as a context manager so the process is always reaped.
    """

    def __init__(self, *, start_timeout: float = 180.0, memory_limit_bytes: int | None = None) -> None:
        self.start_timeout = start_timeout
        self.memory_limit_bytes = memory_limit_bytes
        self.child: Child | None = None
        self._stderr: Any = None
        self.eof = False
        self.starts = 0
        #: wall seconds by phase over every request (see :meth:`_account`), and per backend
        self.phases: dict[str, float] = {}
        #: what an interleaved re-timing is for, in :attr:`phases` ("": the finalists of a key)
        self.section = ""
        self.by_backend: dict[str, dict[str, float]] = {}

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- process management -----------------------------------------------------------------------
    def start(self) -> None:
        t0 = time.monotonic()
        try:
            self._start()
        finally:
            self._add("", "worker start-up", time.monotonic() - t0)

    def _add(self, backend: str, phase: str, seconds: float) -> None:
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds
        if backend:
            mine = self.by_backend.setdefault(backend, {})
            mine[phase] = mine.get(phase, 0.0) + seconds

    def _account(self, message: dict[str, Any], outcome: Outcome) -> None:
        """Where one request's wall time went: the measurement's phases, the rest as the worker's
        own (pipes, loading the backend, resolving it); a failed candidate's whole time as failed;
        an interleaved re-timing as such."""
        backend = str(message.get("backend") or message.get("backend_ref") or "")
        if message.get("op") == "interleave":
            self._add("", f"re-timing ({self.section or 'finalists'}, interleaved)", outcome.wall_s)
        elif outcome.phases:
            for phase, seconds in outcome.phases.items():
                self._add(backend, phase, seconds)
            self._add(backend, "worker", max(0.0, outcome.wall_s - sum(outcome.phases.values())))
        else:
            self._add(backend, "failed or refused", outcome.wall_s)

    def _start(self) -> None:
        self.close()
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115  (lives as long as the worker; closed in close())
        self.child = Child(["-m", "attnbench.tuning.worker"], stderr=self._stderr)
        self.starts += 1
        init = {
            "sys_path": sys.path,
            "parent": os.getpid(),
            "memory_limit_bytes": self.memory_limit_bytes,
            "threads": _torch_threads(),
        }
        reply = self._ask(init, self.start_timeout)
        if reply is None or not reply.get("ready"):
            tail = self.stderr_tail()
            self.close()
            raise WorkerDied(f"the tuning worker did not start: {tail or 'no output'}")

    def close(self) -> None:
        child, self.child = self.child, None
        if child is not None:
            child.kill()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    def stderr_tail(self, lines: int = 15, *, max_bytes: int = 64 << 10) -> str:
        """The last ``lines`` lines of the worker's stderr, read from the end (at most ``max_bytes``)."""
        if self._stderr is None:
            return ""
        size = self._stderr.seek(0, os.SEEK_END)
        self._stderr.seek(max(0, size - max_bytes))
        data = self._stderr.read(max_bytes)
        self._stderr.seek(0, os.SEEK_END)
        text = data.decode(errors="replace")
        if size > max_bytes:  # the first line read is probably cut: drop it
            text = text.partition("\n")[2]
        return "\n".join(text.strip().splitlines()[-lines:])

    def _ask(self, message: dict[str, Any], timeout: float) -> dict[str, Any] | None:
        """Send ``message``; its answer (one JSON line), or ``None`` on EOF or timeout (``self.eof``
        tells which)."""
        assert self.child is not None
        self.child.send(message)
        reply = self.child.receive(timeout)
        self.eof = self.child.eof
        return reply

    # -- one candidate ----------------------------------------------------------------------------
    def run(self, task: WorkerTask, *, timeout: float) -> Outcome:
        return self.request(task.as_dict(), timeout=timeout)

    def request(self, message: dict[str, Any], *, timeout: float) -> Outcome:
        """Send one task (a :class:`WorkerTask`'s dict, or another ``op``) and wait for its verdict."""
        outcome = self._request(message, timeout=timeout)
        self._account(message, outcome)
        return outcome

    def _request(self, message: dict[str, Any], *, timeout: float) -> Outcome:
        if self.child is None or self.child.poll() is not None:
            self.start()
        t0 = time.monotonic()
        try:
            reply = self._ask(message, timeout)
        except BrokenPipeError:
            reply, self.eof = None, True
        except KeyboardInterrupt:
            self.close()
            raise
        wall = time.monotonic() - t0
        if reply is not None:
            return Outcome(
                ok=bool(reply["ok"]),
                value=reply.get("value"),
                kind=reply.get("kind", ""),
                reason=reply.get("reason", ""),
                attrs=reply.get("attrs", {}),
                wall_s=wall,
                result=CandidateResult.from_dict(reply["result"], where="worker")
                if reply.get("result")
                else None,
                phases={str(k): float(v) for k, v in (reply.get("phases") or {}).items()},
            )
        assert self.child is not None
        kind = "crash" if self.eof else "timeout"
        if not self.eof:  # no answer by the deadline and the pipe still open: a hang
            reason = f"no result after {timeout:.3g} s (hang or too slow); worker killed and replaced"
        else:  # the pipe closed: the process is dying or dead (EOF can come before it is reaped)
            try:
                reason = _death_reason(self.child.wait(timeout=10))
            except subprocess.TimeoutExpired:
                reason = "worker closed its pipe but did not exit; killed and replaced"
        tail = self.stderr_tail()
        self.close()
        return Outcome(
            ok=False, kind=kind, reason=reason, attrs={"stderr_tail": tail} if tail else {}, wall_s=wall
        )


def _torch_threads() -> int | None:
    """This process's torch thread count, if torch is loaded (the worker is told to use the same)."""
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else None


def _death_reason(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (the kernel's out-of-memory killer sends SIGKILL)" if -code == signal.SIGKILL else ""
        return f"worker process killed by {name}{hint}; replaced"
    return f"worker process exited with code {code} in the middle of the candidate; replaced"


if __name__ == "__main__":
    main()
