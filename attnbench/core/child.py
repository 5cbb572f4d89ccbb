"""The one way attnbench runs code in a child Python process with a deadline.

Four things run where they cannot hurt the caller: the tuner's worker (a candidate that crashes, hangs
or runs out of memory), a plugin's ``resolve()`` (plugin code bounded in time), a plugin's first import
(an import can hang holding the GIL, which no thread can bound) and Triton's ahead-of-time compiles
(which need a process where the interpreter is off). All of them start a :class:`Child`:

- the same interpreter (``sys.executable``), in a session of its own, so that Ctrl-C in a terminal
  reaches only the parent and a kill takes the child's own children with it;
- requests and answers as JSON lines over stdin/stdout (:meth:`Child.send`, :meth:`Child.receive`,
  which waits at most a given time and tells end-of-file from a deadline);
- :meth:`Child.kill` ends the whole session and reaps it, and runs on every exit path (a context
  manager).

:func:`run_child` is the one-shot form: run to completion without a protocol, killed at the deadline.
"""

from __future__ import annotations

import ctypes
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any

__all__ = ["Child", "ChildRun", "die_with_parent", "run_child"]


class Child:
    """``python <args>`` in its own session, speaking JSON lines; see the module doc.

    ``stderr`` is where the child's stderr goes (a file to read its tail later, or
    ``subprocess.DEVNULL``); ``env`` replaces the environment.
    """

    def __init__(
        self,
        args: Sequence[str],
        *,
        stderr: int | IO[bytes] | None = subprocess.DEVNULL,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.proc: subprocess.Popen[bytes] = subprocess.Popen(
            [sys.executable, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=dict(env) if env is not None else None,
            start_new_session=True,
        )
        self._buffer = b""
        #: Set by :meth:`receive`: True when it returned ``None`` because the child closed stdout.
        self.eof = False

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.proc.wait(timeout)

    def send(self, message: Mapping[str, Any]) -> None:
        """One JSON line to the child's stdin (``BrokenPipeError`` if it has gone)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(message, default=str) + "\n").encode())
        self.proc.stdin.flush()

    def close_input(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()

    def receive(self, timeout: float) -> dict[str, Any] | None:
        """The child's next JSON line, or ``None`` at end-of-file or after ``timeout`` seconds
        (:attr:`eof` tells which)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        self.eof = False
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                if not sel.select(min(left, 1.0)):  # nothing yet (or an interrupted wait): look again
                    continue
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    self.eof = True
                    return None
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def kill(self) -> None:
        """End the child's whole session (if still running), reap it, close the pipes."""
        proc = self.proc
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None and not stream.closed:
                stream.close()


@dataclass(frozen=True)
class ChildRun:
    """How a :func:`run_child` ended: the exit status (``None``: killed at the deadline) and the
    tail of its stderr."""

    returncode: int | None
    stderr: str

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def run_child(
    args: Sequence[str],
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    stderr_bytes: int = 4000,
) -> ChildRun:
    """Run ``python <args>`` to completion, without a protocol, killing its session at ``timeout``."""
    with tempfile.TemporaryFile() as err:
        child = Child(args, stderr=err, env=env)
        child.close_input()
        try:
            code: int | None = child.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            child.kill()
        size = err.seek(0, os.SEEK_END)
        err.seek(max(0, size - stderr_bytes))
        return ChildRun(code, err.read().decode(errors="replace").strip())


def die_with_parent(parent: int) -> None:
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
