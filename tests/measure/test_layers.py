"""The layers a tuner's timed step runs: one per distinct layer cache, each step reading past the budget."""

from __future__ import annotations

from attnbench.core.workload import Workload
from attnbench.measure.layers import materialised_layers, timed_layers


def _llama(batch: int, context: int) -> Workload:
    return Workload.uniform("llama-3.1-8b", batch=batch, context=context, dtype="bf16")


def test_timed_layers_read_each_distinct_cache_once_and_no_fewer_than_the_budget() -> None:
    budget = 256 * 2**20
    # 1 GiB of bf16 K/V a layer at batch 8 x 32k: two layers; 4 MiB a layer at batch 1 x 1k: all 32
    assert timed_layers(_llama(8, 32768), budget_bytes=budget) == 2
    assert timed_layers(_llama(1, 1024), budget_bytes=budget) == 32
    counts = [timed_layers(_llama(b, c), budget_bytes=budget) for b, c in ((1, 1024), (1, 8192), (8, 8192))]
    assert counts == sorted(counts, reverse=True)  # the larger a layer's cache, the fewer layers
    for b, c in ((1, 8192), (8, 1024), (1, 32768), (3, 16384)):
        w = _llama(b, c)
        n = timed_layers(w, budget_bytes=budget)
        per_layer_fp8 = w.shape.num_kv_heads * 2 * w.shape.head_dim * b * c  # the smallest cache: 1 B a value
        assert n * per_layer_fp8 >= budget or n == w.shape.num_layers  # a step reads past the budget
        # as many as the synthetic model makes distinct caches of that smallest form, never fewer than 2
        distinct = materialised_layers(per_layer_bytes=per_layer_fp8, num_layers=32, budget_bytes=budget)
        assert n == min(32, max(2, distinct))


def test_an_mla_models_timed_layers_count_its_latent_cache() -> None:
    """DeepSeek-V3 keeps a 576-value latent row a token (its expanded K and V: 40,960 values): at batch
    1 × 8k the latent layers are 4.5 MiB, so 57 of them pass a 256-MiB budget, not the expanded form's 2."""
    budget = 256 * 2**20
    w = Workload.uniform("deepseek-v3", batch=1, context=8192, dtype="bf16")
    latent = w.geometry("latent").qk_head_dim * 8192
    assert timed_layers(w, budget_bytes=budget) == min(w.shape.num_layers, -(-budget // latent)) == 57
