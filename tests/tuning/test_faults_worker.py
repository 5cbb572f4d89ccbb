"""Faults planted in the worker and the command line: a backend stuck in C code holding the GIL when
its tuner is killed, 50 MB of backend output, a plugin printing in ``--json`` mode, SIGTERM."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from helpers.fake_plugins import plugin_env, plugin_source, write_fake_dist

from attnbench.backends.naive import NaiveBackend
from attnbench.core.workload import Workload, workload_to_dict
from attnbench.tuning import WorkerTask

W = Workload.uniform("tiny-gqa", batch=1, context=32, dtype="fp32")
HERE = Path(__file__).resolve().parent
TESTS = HERE.parent  # tests/: the helpers package (helpers.fake_plugins) a subprocess imports too


class GILHangBackend(NaiveBackend):
    """Sleeps in C while holding the GIL (a ctypes.PyDLL call does not release it)."""

    name = "planted_gil_hang"

    def decode(self, cache, plan, *, layer, q, k, v):
        marker = os.environ.get("ATTNBENCH_TEST_HANG_MARKER")
        if marker:
            Path(marker).write_text(str(os.getpid()))
        ctypes.PyDLL(None).sleep(3600)  # libc sleep(), GIL held: no Python thread runs
        return super().decode(cache, plan, layer=layer, q=q, k=k, v=v)


class LoudBackend(NaiveBackend):
    """Writes ~50 MB to stderr before it fails."""

    name = "planted_loud"

    def decode(self, cache, plan, *, layer, q, k, v):
        line = b"x" * 1023 + b"\n"
        for _ in range(50 * 1024):
            os.write(2, line)
        os.write(2, b"the last line\n")
        os._exit(9)


def _task(cls) -> WorkerTask:
    return WorkerTask(
        backend_ref=f"test_faults_worker:{cls.__name__}", config={}, workload=workload_to_dict(W), repeats=2
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/stat")
    return not (status.exists() and status.read_text().split()[2] == "Z")


def test_a_worker_stuck_in_c_holding_the_gil_dies_with_its_killed_tuner(tmp_path):
    marker = tmp_path / "worker.pid"
    script = textwrap.dedent(
        f"""
        import sys
        sys.path[:0] = [{str(HERE)!r}, {str(TESTS)!r}]
        from test_faults_worker import GILHangBackend, _task
        from attnbench.tuning import Worker
        with Worker() as w:
            w.run(_task(GILHangBackend), timeout=3600)
        """
    )
    env = dict(os.environ, ATTNBENCH_TEST_HANG_MARKER=str(marker))
    tuner = subprocess.Popen([sys.executable, "-c", script], env=env)
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert time.monotonic() < deadline and tuner.poll() is None, "the worker never reached decode"
        time.sleep(0.1)
    time.sleep(0.3)
    worker_pid = int(marker.read_text())
    assert _alive(worker_pid)
    tuner.kill()  # SIGKILL: no cleanup code of the tuner runs
    tuner.wait()
    deadline = time.monotonic() + 10
    while _alive(worker_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker_pid), "the worker outlived its tuner"


def test_fifty_megabytes_of_output_keep_the_tuner_small_and_the_tail_whole():
    """In a fresh process, so that its peak RSS (``ru_maxrss``) starts from this test alone."""
    script = textwrap.dedent(
        f"""
        import json, resource, sys
        sys.path[:0] = [{str(HERE)!r}, {str(TESTS)!r}]
        from test_faults_worker import LoudBackend, _task
        from attnbench.tuning import Worker
        with Worker() as w:
            w.start()
            before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
            outcome = w.run(_task(LoudBackend), timeout=120)
            after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps({{"grew_kib": after - before, "kind": outcome.kind, "reason": outcome.reason,
                          "tail": outcome.attrs.get("stderr_tail", "")}}))
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["kind"] == "crash" and "exited with code 9" in result["reason"]
    tail = result["tail"].splitlines()
    assert tail[-1] == "the last line" and len(tail) == 15 and set(tail[0]) == {"x"}
    assert result["grew_kib"] < 20 * 1024, (
        f"the tuner grew by {result['grew_kib']} KiB reading 50 MB of output"
    )


PRINTING_PLUGIN = plugin_source(
    "Chatty",
    "chatty",
    preamble="""
    import os
    print("plugin says hello from Python")
    os.write(1, b"plugin says hello from C-level fd 1\\n")
    """,
)


def test_a_plugin_that_prints_never_reaches_json_stdout(tmp_path):
    site = tmp_path / "site"
    write_fake_dist(
        site,
        entry="chatty",
        dist="chatty-plugin",
        version="1.0",
        module="chatty_plugin",
        source=PRINTING_PLUGIN,
    )
    env = plugin_env(site, allow="chatty")
    proc = subprocess.run(
        [sys.executable, "-m", "attnbench", "backends", "--json"], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)  # the whole of stdout is one JSON document
    assert "chatty" in json.dumps(data)
    assert "hello from Python" in proc.stderr and "hello from C-level fd 1" in proc.stderr


def test_sigterm_is_handled_like_ctrl_c(tmp_path):
    script = textwrap.dedent(
        """
        import sys, time
        from attnbench.cli.common import sigterm_as_interrupt
        try:
            with sigterm_as_interrupt():
                print("ready", flush=True)
                time.sleep(60)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            sys.exit(130)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "interrupted" in out
