"""The tuner's side of its worker process: a worker begun early (its process loading torch while the
tuner measures the device) serves the first request once ready, and one that died before it was
ready is started again."""

from __future__ import annotations

from attnbench.core.workload import Workload, workload_to_dict
from attnbench.tuning.supervisor import Worker
from attnbench.tuning.worker import WorkerTask

W = Workload.uniform("tiny-gqa", batch=1, context=32, dtype="fp32")
TASK = WorkerTask(
    backend_ref="attnbench.backends.naive:NaiveBackend", config={}, workload=workload_to_dict(W), repeats=2
)


def test_a_begun_worker_serves_its_first_request_once_ready() -> None:
    with Worker() as w:
        w.begin()
        assert w.child is not None and w.child.poll() is None and w.starts == 1
        outcome = w.run(TASK, timeout=120)
        assert outcome.ok, (outcome.kind, outcome.reason)
        assert w.starts == 1  # the begun process served it: none started a second time
        assert w.phases["worker start-up"] > 0
        again = w.run(TASK, timeout=120)
        assert again.ok and w.starts == 1


def test_a_begun_worker_that_died_before_it_was_ready_is_started_again() -> None:
    with Worker() as w:
        w.begin()
        assert w.child is not None
        w.child.kill()
        w.child.wait(timeout=30)
        outcome = w.run(TASK, timeout=120)
        assert outcome.ok, (outcome.kind, outcome.reason)
        assert w.starts == 2
