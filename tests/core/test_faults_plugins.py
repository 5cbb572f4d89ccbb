"""Faults planted in plugin code that the parent process calls: a ``supports()`` that hangs holding
the GIL must not hang ``tune``, ``backends`` or ``select()``; answers are cached so the next call is fast."""

from __future__ import annotations

import ctypes
import time

from attnbench.backends.naive import NaiveBackend
from attnbench.core.plugin_call import ask, ask_many
from attnbench.core.workload import Workload
from attnbench.tuning import BackendRef, build_space

W = Workload.uniform("tiny-gqa", batch=1, context=32, dtype="fp32")


class HangingSupports(NaiveBackend):
    """A plugin whose supports() sleeps in C with the GIL held (no thread of the process runs)."""

    name = "planted_hanging_supports"

    def supports(self, workload):
        ctypes.PyDLL(None).sleep(3600)
        return []


class Answering(NaiveBackend):
    name = "planted_answering"


def test_a_hanging_supports_is_bounded_and_the_other_backends_still_answer(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNBENCH_CACHE_DIR", str(tmp_path))
    t0 = time.monotonic()
    hung, fine = ask_many([HangingSupports, Answering], W, timeout=3)
    took = time.monotonic() - t0
    assert took < 3 + 60, took  # the deadline (plus starting the child), not an hour
    assert "gave no answer to supports() within 3 s" in hung.reasons[0]
    assert fine.reasons == () and not fine.interpreted
    space = build_space(W, [BackendRef.of(Answering), BackendRef.of(HangingSupports)])
    assert list(space.backends) == ["planted_answering"]  # cached: no second wait
    assert "gave no answer" in space.excluded[0].reasons[0]


def test_answers_are_cached_so_select_stays_fast(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNBENCH_CACHE_DIR", str(tmp_path))
    first = ask(Answering, W, timeout=60)
    assert list((tmp_path / "probes").glob("*.json"))
    t0 = time.perf_counter()
    again = ask(Answering, W, timeout=60)
    assert time.perf_counter() - t0 < 0.5 and again == first


def test_one_child_process_per_bucket_not_per_request_shape(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNBENCH_CACHE_DIR", str(tmp_path))
    ask(Answering, Workload.uniform("tiny-gqa", batch=8, context=1000, dtype="fp32"), timeout=60)
    for batch, context in ((7, 1000), (8, 1100), (9, 900)):  # the same buckets (8, 1024)
        t0 = time.perf_counter()
        ask(Answering, Workload.uniform("tiny-gqa", batch=batch, context=context, dtype="fp32"), timeout=60)
        assert time.perf_counter() - t0 < 0.5
    assert len(list((tmp_path / "probes").glob("*.json"))) == 1


def test_a_plugin_whose_import_hangs_is_listed_broken_and_the_rest_load(tmp_path, monkeypatch):
    from importlib.metadata import EntryPoint

    import attnbench.core.registry as registry_mod

    (tmp_path / "ab_hanging_import.py").write_text("import ctypes\nctypes.PyDLL(None).sleep(3600)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("ATTNBENCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("ATTNBENCH_PLUGIN_TIMEOUT", "3")
    eps = [EntryPoint("ab_hanging_import", "ab_hanging_import", registry_mod.ENTRY_POINT_GROUP)]
    monkeypatch.setattr(registry_mod, "entry_points", lambda group: eps)
    t0 = time.monotonic()
    reg = registry_mod.load_registry(env={})
    assert time.monotonic() - t0 < 30
    (failure,) = reg.failures
    assert failure.stage == "import" and "did not finish within 3 s" in failure.error
    assert {"naive", "flash"} <= set(reg.names())
