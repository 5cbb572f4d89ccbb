"""The decode loop and the synthetic attention-only model (small shapes; fresh random inputs)."""

from __future__ import annotations

import math

import pytest
import torch

from attnbench.backends.naive import NaiveBackend
from attnbench.core.backend import KVCache, StepPlan
from attnbench.core.shapes import ModelShape
from attnbench.core.workload import Workload
from attnbench.correctness.reference import compare, reference_decode
from attnbench.measure.decode import DecodeModel, SyntheticModel, generate, materialised_layers


def _shape(layers: int = 6) -> ModelShape:
    return ModelShape(
        name="loop-test",
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        hidden_size=64,
        intermediate_size=128,
        vocab_size=256,
        num_params=100_000,
    )


class SpyBackend(NaiveBackend):
    """Naive, recording every call the loop makes."""

    name = "spy"

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def plan(self, cache: KVCache, *, num_new):  # type: ignore[override]
        self.calls.append(("plan", -1))
        plan = super().plan(cache, num_new=num_new)
        orig_commit = cache.commit

        def commit(p: StepPlan) -> None:
            self.calls.append(("commit", -1))
            orig_commit(p)

        cache.commit = commit  # type: ignore[method-assign]
        return plan

    def decode(self, cache, plan, *, layer, q, k, v):  # type: ignore[override]
        self.calls.append(("decode", layer))
        return super().decode(cache, plan, layer=layer, q=q, k=k, v=v)


def test_step_is_one_plan_every_layer_one_commit_cycling_over_materialised_caches() -> None:
    backend = SpyBackend()
    workload = Workload(_shape(layers=7), (40, 40), torch.float32)
    per_layer = 2 * 2 * 16 * 4 * 45 * 2  # Hkv · (Dk + Dv) · 4 bytes · slots · batch
    model = SyntheticModel(backend, workload, materialise_bytes=3 * per_layer)
    model.fill(extra_tokens=5)
    assert model.layers_materialised == 3
    assert model.cache is not None and model.cache.seq_lens == (40, 40)
    backend.calls.clear()
    model.decode_step()
    assert backend.calls[0] == ("plan", -1) and backend.calls[-1] == ("commit", -1)
    assert [layer for kind, layer in backend.calls if kind == "decode"] == [0, 1, 2, 0, 1, 2, 0]
    assert model.cache.seq_lens == (41, 41)


def test_decode_step_output_matches_reference_of_last_layer() -> None:
    """The loop feeds each layer its own prepared inputs: the last call's output is exact attention."""
    workload = Workload(_shape(layers=2), (24, 24), torch.float32)
    model = SyntheticModel(NaiveBackend(), workload, input_sets=1)
    model.fill(extra_tokens=2)
    cache = model.cache
    assert cache is not None
    out = model.decode_step()
    q, _, _ = model._decode_inputs[0][-1]
    layer = (model.num_layers - 1) % model.layers_materialised
    k = cache.k[layer].transpose(1, 2)[:, :25]  # [B, S, Hkv, D]
    v = cache.v[layer].transpose(1, 2)[:, :25]
    ref = reference_decode(q, k, v, [25, 25], scale=cache.geometry.scale)
    assert compare(out, ref).rel_l2 < 1e-5


def test_kv_bytes_per_step_matches_workload_after_fill() -> None:
    workload = Workload(_shape(), (30, 50), torch.bfloat16)
    model = SyntheticModel(NaiveBackend(), workload)
    model.fill(extra_tokens=3)
    assert model.kv_bytes_per_step() == workload.kv_bytes_per_step("expanded")
    before = model.kv_bytes_per_step()
    model.decode_step()
    assert model.kv_bytes_per_step() - before == model.kv_bytes_per_step_growth()


def test_materialised_layers_bounds() -> None:
    assert materialised_layers(per_layer_bytes=100, num_layers=32, budget_bytes=1000) == 10
    assert materialised_layers(per_layer_bytes=100, num_layers=4, budget_bytes=10**9) == 4
    assert materialised_layers(per_layer_bytes=10**9, num_layers=32, budget_bytes=1000) == 1
    # default budget: several times the last-level cache, never zero layers
    assert 1 <= materialised_layers(per_layer_bytes=2**20, num_layers=126) <= 126


def test_synthetic_model_is_a_decode_model() -> None:
    model = SyntheticModel(NaiveBackend(), Workload(_shape(), (8,), torch.float32))
    assert isinstance(model, DecodeModel)
    assert model.vocab_size is None


def test_generate_reports_consistent_numbers() -> None:
    workload = Workload(_shape(layers=4), (64,) * 2, torch.float32)
    model = SyntheticModel(NaiveBackend(), workload)
    run = generate(model, prompt_len=48, new_tokens=9)
    assert run.tokens.shape == (2, 9)
    assert run.decode_steps == 8 and len(run.itl_samples_s) == 8
    assert run.ttft_s > 0 and all(s > 0 for s in run.itl_samples_s)
    # e2e covers prefill and every step, each timed inside it
    assert run.e2e_s >= run.ttft_s + sum(run.itl_samples_s)
    itl = run.itl
    assert itl.p10_s <= itl.median_s <= itl.p90_s
    # mean bytes over steps: context 48 → 56, each step reads all cached tokens plus the new one
    per_token = workload.shape.kv_bytes_per_token("fp32", "expanded")
    assert run.kv_bytes_per_step == int(per_token * 2 * (49 + 56) / 2)
    d = run.as_dict(bandwidth=1e10)
    assert d["e2e_check_s"] == pytest.approx(run.ttft_s + 8 * run.itl_mean_s)
    assert d["pct_of_bandwidth"] == pytest.approx(100 * run.gbps() * 1e9 / 1e10)
    assert model.cache is not None and model.cache.seq_lens == (56, 56)


def test_e2e_is_ttft_plus_steps_times_itl() -> None:
    """e2e ≈ TTFT + (N-1)·ITL (mean): the loop adds little of its own between the timed calls."""
    workload = Workload(_shape(layers=4), (512,), torch.float32)
    model = SyntheticModel(NaiveBackend(), workload)
    run = generate(model, prompt_len=256, new_tokens=17)
    assert run.e2e_check == pytest.approx(run.ttft_s + sum(run.itl_samples_s))
    assert abs(run.e2e_ratio - 1) <= 0.10, run.as_dict()
    assert run.e2e_ratio_p50 > 0


class CountingLM:
    """A model with a vocabulary whose greedy next token is the previous token + 1 (mod V)."""

    vocab_size = 11

    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.device = torch.device("cpu")
        self.len = 0

    def setup(self, prompt_len: int, new_tokens: int) -> None:
        self.len = 0

    def _logits(self, last: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.one_hot((last + 1) % self.vocab_size, self.vocab_size).float()

    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        self.len = tokens.shape[1]
        return self._logits(tokens[:, -1])

    def decode_step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.len += 1
        return self._logits(tokens)

    def kv_bytes_per_step(self) -> int:
        return self.len * 10


def test_generate_feeds_greedy_tokens_back() -> None:
    model = CountingLM(batch=2)
    assert isinstance(model, DecodeModel)
    prompt = torch.tensor([[1, 2, 3], [7, 8, 9]])
    run = generate(model, prompt=prompt, new_tokens=5, keep_logits=True)
    assert run.tokens.tolist() == [[4, 5, 6, 7, 8], [10, 0, 1, 2, 3]]
    assert len(run.logits) == 5
    assert run.kv_bytes_per_step == int(sum(10 * n for n in range(3, 7)) / 4)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"new_tokens": 0, "prompt_len": 4}, "new_tokens = 0"),
        ({"new_tokens": 3}, "prompt_len = None"),
        ({"new_tokens": 3, "prompt": torch.zeros(3, 4, dtype=torch.long)}, r"expected \[batch=2"),
    ],
)
def test_generate_bad_input(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        generate(CountingLM(batch=2), **kwargs)


def test_synthetic_model_bad_input() -> None:
    workload = Workload(_shape(), (8,), torch.float32)
    with pytest.raises(ValueError, match="num_layers = 0"):
        SyntheticModel(NaiveBackend(), workload, num_layers=0)
    with pytest.raises(RuntimeError, match="call setup"):
        SyntheticModel(NaiveBackend(), workload).decode_step()
    from attnbench.backends.flash import FlashBackend
    from attnbench.core.shapes import load_shape

    mla = Workload(load_shape("tiny-mla"), (8,), torch.float32)
    with pytest.raises(ValueError, match="cannot run .*key head_dim 24 != value head_dim 16"):
        SyntheticModel(FlashBackend(), mla)
    model = SyntheticModel(NaiveBackend(), workload)
    model.setup(4, 2)
    with pytest.raises(ValueError, match="prompt of 5 tokens but setup"):
        model.prefill(torch.zeros(1, 5, dtype=torch.long))
    assert not math.isnan(model.per_layer_bytes(8))


def test_fill_gives_every_layer_sequence_token_and_head_a_vector_of_its_own() -> None:
    """The fill builds its K/V from fewer random draws (a vector per sequence and period position plus
    one per period shared by the batch): every (layer cache, sequence, token, head) must still hold
    distinct K and V vectors — else a backend reading the wrong one passes the timed step's check —
    distributed as N(0, 1)."""
    workload = Workload(_shape(layers=3), (2100, 2100, 700), torch.float32)  # two fill chunks
    model = SyntheticModel(
        NaiveBackend(), workload, seed=1
    )  # the sample mean moves by up to ~0.06 between seeds
    model.fill(extra_tokens=1)
    cache = model.cache
    assert cache is not None and model.layers_materialised == 3
    for name in ("k", "v"):
        kept = [
            getattr(cache, name)[layer][row, :, :n].reshape(-1, 16)
            for layer in range(3)
            for row, n in enumerate(workload.context_lens)
        ]
        vectors = torch.cat(kept)
        assert torch.unique(vectors, dim=0).shape[0] == vectors.shape[0]
        assert abs(float(vectors.mean())) < 0.05 and abs(float(vectors.std()) - 1) < 0.05
