"""The tuner's side of its worker process (:mod:`attnbench.tuning.worker`): it starts the process, sends
it one task at a time, and turns a crash, a hang or a broken pipe into an :class:`Outcome` with its
reason, killing the process group and starting a fresh process for the next task; it keeps the
process's stderr in a temporary file and reads only its tail, and accounts where each request's wall
time went (gate, cache, warm-up, samples, re-timing) for ``tune --profile``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from attnbench.core.child import Child
from attnbench.tables.table_schema import CandidateResult
from attnbench.tuning.worker import OnReport, Outcome, WorkerTask

__all__ = ["Worker", "WorkerDied"]


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
        if message.get("op") == "interleave":  # its own split: gates, caches, checks, warm-up, rounds
            what = f"re-timing ({self.section or 'finalists'})"
            for phase, seconds in outcome.phases.items():
                self._add("", f"{what}: {phase}", seconds)
            rest = max(0.0, outcome.wall_s - sum(outcome.phases.values()))
            self._add("", f"{what}: worker", rest)
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
    def run(self, task: WorkerTask, *, timeout: float, on_report: OnReport = None) -> Outcome:
        """Evaluate ``task``; with ``task.report``, ``on_report(step, running median seconds)`` answers
        after each timed step whether to prune it."""
        return self.request(task.as_dict(), timeout=timeout, on_report=on_report)

    def request(self, message: dict[str, Any], *, timeout: float, on_report: OnReport = None) -> Outcome:
        """Send one task (a :class:`WorkerTask`'s dict, or another ``op``) and wait for its verdict."""
        outcome = self._exchange(message, timeout, on_report)
        self._account(message, outcome)
        return outcome

    def _exchange(self, message: dict[str, Any], timeout: float, on_report: OnReport) -> Outcome:
        """:meth:`request`'s exchange with the child: its answer, or the crash or hang as an outcome."""
        if self.child is None or self.child.poll() is not None:
            self.start()
        t0 = time.monotonic()
        try:
            reply = self._ask(message, timeout)
            while reply is not None and "report" in reply:  # a timed step's running median: prune?
                prune = on_report(int(reply["report"]), float(reply["value"])) if on_report else False
                assert self.child is not None
                self.child.send({"prune": bool(prune)})
                reply = self.child.receive(timeout)
                self.eof = self.child.eof
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
