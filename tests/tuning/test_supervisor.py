"""The tuner's side of its worker process: one process serves request after request, and a process
that died between two requests is started again for the next, which it then serves."""

from __future__ import annotations

from attnbench.core.workload import Workload, workload_to_dict
from attnbench.tuning.supervisor import Worker
from attnbench.tuning.worker import WorkerTask

W = Workload.uniform("tiny-gqa", batch=1, context=32, dtype="fp32")
TASK = WorkerTask(
    backend_ref="attnbench.backends.naive:NaiveBackend", config={}, workload=workload_to_dict(W), repeats=2
)


def test_one_worker_process_serves_request_after_request() -> None:
    with Worker() as w:
        outcome = w.run(TASK, timeout=120)
        assert outcome.ok, (outcome.kind, outcome.reason)
        assert w.starts == 1 and w.phases["worker start-up"] > 0
        again = w.run(TASK, timeout=120)
        assert again.ok and w.starts == 1  # the same process served it


def test_a_worker_process_that_died_between_requests_is_started_again() -> None:
    with Worker() as w:
        assert w.run(TASK, timeout=120).ok
        assert w.child is not None
        w.child.kill()
        w.child.wait(timeout=30)
        outcome = w.run(TASK, timeout=120)
        assert outcome.ok, (outcome.kind, outcome.reason)
        assert w.starts == 2
