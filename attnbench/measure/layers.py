"""How many layers the synthetic model makes and times: distinct layer caches enough that cycling
over them reads past the last-level cache (:func:`materialised_layers`), and the layers a tuner's
timed step runs, one per distinct cache (:func:`timed_layers`)."""

from __future__ import annotations

import math
import os

import torch

from attnbench.core.device import last_level_cache_bytes
from attnbench.core.workload import Workload

__all__ = ["materialised_layers", "timed_layers"]


def materialised_layers(
    *,
    per_layer_bytes: int,
    num_layers: int,
    device: torch.device | str = "cpu",
    budget_bytes: int | None = None,
) -> int:
    """How many distinct layer caches to allocate.

    Enough that cycling over them reads at least ``budget_bytes`` (default: 4 × the last-level
    cache, at least 256 MiB, at most 2 GiB on CPU; on CUDA all layers within half the free memory),
    never more than ``num_layers`` and never fewer than one. ``ATTNBENCH_MATERIALISE_BYTES`` overrides
    the default budget.
    """
    dev = torch.device(device)
    if budget_bytes is None:
        env = os.environ.get("ATTNBENCH_MATERIALISE_BYTES")
        if env:
            budget_bytes = int(env)
        elif dev.type == "cuda":
            budget_bytes = int(torch.cuda.mem_get_info(dev)[0] * 0.5)
        else:
            budget_bytes = min(max(4 * last_level_cache_bytes(dev), 256 * 2**20), 2 * 2**30)
    return max(1, min(num_layers, math.ceil(budget_bytes / max(per_layer_bytes, 1))))


def timed_layers(workload: Workload, *, budget_bytes: int | None = None) -> int:
    """Layers a tuner's decode step runs at ``workload``: as many as :func:`materialised_layers` makes
    distinct caches for the smallest cache any backend keeps of it (the latent form of an MLA model,
    else K and V; one byte a value, as fp8), at least 2 and at most the model's.

    A step of the model's layers cycles over those caches, which together pass the budget: the layers
    beyond them read again, from memory, caches the step already read, and change the per-layer time
    by nothing but their count. With a 256-MiB budget (a 32-MiB last-level cache) that is 2 layers of
    Llama-3.1-8B's 32 at batch 8 × 32k (1 GiB of bf16 K/V a layer), 16 at 1 × 8k and all 32 at 1 × 1k.
    A tuner times this many and reports ``step × model layers / this`` (the model's step)."""
    shape = workload.shape
    g = workload.geometry("latent" if shape.is_mla else "expanded")
    values = g.qk_head_dim if shape.is_mla else g.num_kv_heads * (g.qk_head_dim + g.v_head_dim)
    per_layer = values * workload.batch * workload.context
    distinct = materialised_layers(
        per_layer_bytes=per_layer,
        num_layers=shape.num_layers,
        device=workload.device,
        budget_bytes=budget_bytes,
    )
    return min(shape.num_layers, max(distinct, 2))
