"""The model shelf: a config that differs from the last one only in the backend's ``cache_neutral``
tunables is timed on the last one's filled cache, rewound, instead of a cache allocated and filled
again — and what it times is checked exactly as on a fresh cache, so a false declaration fails."""

from __future__ import annotations

import time
from typing import Any, ClassVar

import pytest
import torch
from helpers.tuning_helpers import planted_registry

from attnbench.backends.mla import MLABackend
from attnbench.backends.naive import NaiveBackend
from attnbench.core.backend import KVCache
from attnbench.core.resolution import Tunable
from attnbench.core.shapes import load_shape
from attnbench.core.workload import Workload
from attnbench.measure.bench import CheckFailed, measure_decode
from attnbench.measure.synthetic import SyntheticModel
from attnbench.measure.timed_run import ModelShelf
from attnbench.tuning import TuneOptions, tune

pytestmark = pytest.mark.usefixtures("one_thread")

WORKLOAD = Workload.uniform("tiny-gqa", batch=2, context=48, dtype="fp32")


class Walker(NaiveBackend):
    """Correct at every ``walk`` (how a kernel would walk its cache)."""

    name = "shelf_walker"
    tunables: ClassVar[tuple[Tunable, ...]] = (
        Tunable("walk", (0, 1, 2), 0, "changes only the speed"),
        Tunable("layout", (0, 1), 0, "a cache per value"),
    )
    cache_neutral: ClassVar[tuple[str, ...]] = ("walk",)

    def reconfigure_cache(self, cache: KVCache, config: Any) -> None:
        cache.config = dict(self.resolve_config(config))


class ScaledV(Walker):
    """Declares ``walk`` cache-neutral, but stores V times ``1 + walk`` and divides it out at the end:
    exact on a cache made for its own config, wrong on one made for another."""

    name = "shelf_scaled_v"

    def append(self, cache: KVCache, plan: Any, *, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        cache.write(plan, layer=layer, k=k, v=v * (1 + cache.config["walk"]))

    def decode(self, cache: Any, plan: Any, *, layer: int, q: Any, k: Any, v: Any) -> Any:
        scale = 1 + cache.config["walk"]
        cache.write(plan, layer=layer, k=k[:, None], v=v[:, None] * scale)
        return self.attend(cache, plan, layer=layer, q=q) / scale


def _measure(backend: Any, shelf: ModelShelf, **config: Any) -> Any:
    return measure_decode(backend, WORKLOAD, config=config, warmup=1, repeats=3, num_layers=4, shelf=shelf)


@pytest.fixture
def fills(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The configs of the synthetic models filled (the gate's own caches are not counted)."""
    done: list[dict[str, Any]] = []
    fill = SyntheticModel.fill

    def counted(self: SyntheticModel, *, extra_tokens: int) -> None:
        done.append(dict(self.config))
        fill(self, extra_tokens=extra_tokens)

    monkeypatch.setattr(SyntheticModel, "fill", counted)
    return done


def test_a_cache_neutral_config_runs_on_the_shelved_cache_and_is_checked(fills: list[dict[str, Any]]) -> None:
    shelf, backend = ModelShelf(), Walker()
    first = _measure(backend, shelf, walk=0)
    again = [_measure(backend, shelf, walk=w) for w in (1, 2, 0)]
    assert len(fills) == 1 and shelf.reused == 3
    for m in (first, *again):
        assert m.check is not None and m.check.passed and m.timed_check is not None and m.timed_check.passed
    assert [m.config["walk"] for m in again] == [1, 2, 0]


def test_another_layout_fills_a_new_cache(fills: list[dict[str, Any]]) -> None:
    shelf, backend = ModelShelf(), Walker()
    _measure(backend, shelf, layout=0)
    _measure(backend, shelf, layout=1)
    _measure(backend, shelf, layout=1, walk=2)
    assert [c["layout"] for c in fills] == [0, 1] and shelf.reused == 1


def test_a_backend_without_cache_neutral_tunables_is_never_shelved() -> None:
    shelf = ModelShelf()
    for _ in range(2):
        _measure(NaiveBackend(), shelf)
    assert shelf.reused == 0 and shelf._model is None


def test_a_false_declaration_fails_the_timed_check() -> None:
    """The gate passes ``walk=2`` on its own caches; only the timed step on the shelved cache, made for
    ``walk=0``, shows the lie — and is never a result."""
    shelf, backend = ModelShelf(), ScaledV()
    _measure(backend, shelf, walk=0)
    with pytest.raises(CheckFailed):
        _measure(backend, shelf, walk=2)
    _measure(backend, ModelShelf(), walk=2)  # on a cache of its own it is right


def test_rewound_steps_repeat_the_first_run_bit_for_bit() -> None:
    model = SyntheticModel(NaiveBackend(), WORKLOAD, num_layers=3, seed=7)
    model.record_layer = 1
    model.fill(extra_tokens=5)
    first = [model.decode_step().clone() for _ in range(4)]
    recorded = [out for _, out in model.recorded]
    model.rewind()
    assert model.cache is not None and model.cache.seq_lens == tuple(WORKLOAD.context_lens)
    assert model.recorded == []
    second = [model.decode_step() for _ in range(4)]
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert all(torch.equal(a, b) for a, (_, b) in zip(recorded, model.recorded, strict=True))


class SlowWalk(Walker):
    """``walk=1`` is the fastest by far (5 ms a layer call less)."""

    name = "shelf_slow_walk"

    def decode(self, cache: Any, plan: Any, *, layer: int, q: Any, k: Any, v: Any) -> Any:
        if cache.config["walk"] != 1:
            time.sleep(0.005)
        return super().decode(cache, plan, layer=layer, q=q, k=k, v=v)


def test_tune_fills_one_cache_per_layout(tmp_path, profile) -> None:  # type: ignore[no-untyped-def]
    """Six candidates over two layouts, timed in the worker with its shelf: the fast walk wins."""
    report = tune(
        [WORKLOAD],
        registry=planted_registry(SlowWalk),
        results_dir=tmp_path,
        options=TuneOptions(timeout_s=60.0, warmup=1, repeats=3),
        profile=profile,
        samples=0,
    )
    (entry,) = report.entries.values()
    assert entry["trials"] == 6 and all(c.get("step_ms") for c in entry["candidates"])
    assert entry["winner"]["config"]["walk"] == 1


@pytest.mark.parametrize(
    ("model_name", "context_lens"),
    [("tiny-gqa", (48, 48)), ("tiny-gqa", (33, 60)), ("tiny-mla", (40, 17))],
    ids=["uniform", "ragged", "latent"],
)
def test_the_fills_kept_history_is_the_one_generated_again(model_name, context_lens) -> None:  # type: ignore[no-untyped-def]
    """The timed step's check reads the recorded layer's history as the fill generated it (kept, copied
    before the backend saw it) instead of generating it again: the same tensors, bit for bit."""
    workload = Workload(load_shape(model_name), context_lens, "fp32")
    backend = MLABackend() if model_name == "tiny-mla" else NaiveBackend()
    model = SyntheticModel(backend, workload, num_layers=3, materialise_bytes=1)  # one cache slot or few
    model.record_layer = 2
    model.fill(extra_tokens=4)
    for _ in range(3):
        model.decode_step()
    assert model._filled is not None
    kept = model.history_for(2, 1)
    model._filled = None  # the other way: generated again from the fill's generator
    again = model.history_for(2, 1)
    for a, b in zip(kept[:3], again[:3], strict=True):
        assert torch.equal(a, b)
    assert kept[3] == again[3]


# -- a filled cache copied (the finalists' re-timing: attnbench.tuning.interleave) ----------------------
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_copied_fill_steps_as_a_fresh_fill_bit_for_bit(dtype: str) -> None:
    """``cpu_decode`` with other KV splits and another prefetch distance, its cache copied from a model
    filled (and stepped) for the first config, decodes the same bits as one filled for its own config."""
    from backends.cpu_decode import CpuDecodeBackend

    workload = Workload(load_shape("tiny-gqa"), (40, 75), dtype)
    source = SyntheticModel(
        CpuDecodeBackend(),
        workload,
        config={"page_size": 32, "kv_splits": "auto", "prefetch": 0},
        num_layers=3,
    )
    source.fill(extra_tokens=6)
    for _ in range(2):  # the warm-up of the source's own instance: the copy starts from the fill
        source.decode_step()
    other = {"page_size": 32, "kv_splits": 4, "prefetch": 4}
    copied = SyntheticModel(CpuDecodeBackend(), workload, config=other, num_layers=3)
    copied.fill_like(source, extra_tokens=6)
    fresh = SyntheticModel(CpuDecodeBackend(), workload, config=other, num_layers=3, seed=source.seed)
    fresh.fill(extra_tokens=6)
    assert copied.cache is not None and copied.cache.seq_lens == (40, 75)
    assert copied.cache.pages.data_ptr() != source.cache.pages.data_ptr()  # type: ignore[union-attr]
    for _ in range(3):
        assert torch.equal(copied.decode_step(), fresh.decode_step())


def test_a_fill_is_copied_only_between_configs_that_differ_in_cache_neutral_tunables() -> None:
    source = SyntheticModel(Walker(), WORKLOAD, config={"layout": 0}, num_layers=2)
    source.fill(extra_tokens=3)
    with pytest.raises(ValueError, match="cache_neutral tunables \\['walk'\\]"):
        SyntheticModel(Walker(), WORKLOAD, config={"layout": 1}, num_layers=2).fill_like(
            source, extra_tokens=3
        )
    with pytest.raises(ValueError, match="room for"):
        SyntheticModel(Walker(), WORKLOAD, config={"walk": 2}, num_layers=2).fill_like(source, extra_tokens=9)
    plain = SyntheticModel(NaiveBackend(), WORKLOAD, num_layers=2)
    plain.fill(extra_tokens=3)
    with pytest.raises(ValueError, match="cannot stand for"):
        SyntheticModel(NaiveBackend(), WORKLOAD, num_layers=2).fill_like(plain, extra_tokens=3)


def test_the_retiming_fills_one_cache_per_layout(fills: list[dict[str, Any]]) -> None:
    """Three finalists over two layouts, two instances each: two caches filled, four copied, all timed."""
    from attnbench.core.workload import workload_to_dict
    from attnbench.tuning.interleave import run_interleaved

    ref = f"{Walker.__module__}:Walker"
    configs = {"a": {"walk": 0, "layout": 0}, "b": {"walk": 1, "layout": 0}, "c": {"walk": 2, "layout": 1}}
    task = {
        "workload": workload_to_dict(WORKLOAD),
        "samples": 3,
        "warmup": 1,
        "num_layers": 2,
        "instances": 2,
        "candidates": [{"label": k, "backend_ref": ref, "config": c} for k, c in configs.items()],
    }
    out = run_interleaved(task)
    assert out["attrs"]["failed"] == {}
    assert sorted(out["attrs"]["samples_ms"]) == ["a", "b", "c"]
    assert [c["layout"] for c in fills] == [0, 1]
