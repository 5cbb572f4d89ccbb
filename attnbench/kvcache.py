"""KV caches shared by several backends. A backend with its own layout keeps its cache in its file."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from attnbench.backend import KVCache, StepPlan
from attnbench.shapes import AttentionGeometry
from attnbench.workload import Workload

__all__ = ["ContiguousKVCache"]


class ContiguousKVCache(KVCache):
    """One slab per layer, ``max_seq_len`` slots per sequence.

    ``heads_first=True``: ``k: [L, B, Hkv, S, Dk]`` (each head's rows contiguous: BLAS- and
    SDPA-friendly); ``heads_first=False``: ``k: [L, B, S, Hkv, Dk]`` (flash-attn's layout).
    """

    def __init__(
        self,
        *,
        workload: Workload,
        geometry: AttentionGeometry,
        config: Mapping[str, Any],
        num_layers: int,
        max_seq_len: int,
        heads_first: bool = True,
    ) -> None:
        super().__init__(
            workload=workload,
            geometry=geometry,
            config=config,
            num_layers=num_layers,
            max_seq_len=max_seq_len,
        )
        g, b = geometry, workload.batch
        self.heads_first = heads_first
        dims = (b, g.num_kv_heads, max_seq_len) if heads_first else (b, max_seq_len, g.num_kv_heads)
        kw = {"dtype": self.dtype, "device": self.device}
        # zeros, not empty: masked slots are multiplied by a zero weight, and 0 * NaN garbage is NaN
        self.k = torch.zeros(num_layers, *dims, g.qk_head_dim, **kw)
        self.v = torch.zeros(num_layers, *dims, g.v_head_dim, **kw)

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def write(self, plan: StepPlan, *, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k [B, T, Hkv, Dk]``, ``v [B, T, Hkv, Dv]`` at ``plan.positions``."""
        kc, vc = self.k[layer], self.v[layer]
        if plan.max_new == 1:  # decode: one vectorised scatter, no host loop
            rows = torch.arange(self.batch, device=self.device)
            pos = plan.device_positions
            if self.heads_first:
                kc[rows, :, pos] = k[:, 0]
                vc[rows, :, pos] = v[:, 0]
            else:
                kc[rows, pos] = k[:, 0]
                vc[rows, pos] = v[:, 0]
            return
        for i, (p, n) in enumerate(zip(plan.positions, plan.num_new, strict=True)):
            if self.heads_first:
                kc[i, :, p : p + n] = k[i, :n].transpose(0, 1)
                vc[i, :, p : p + n] = v[i, :n].transpose(0, 1)
            else:
                kc[i, p : p + n] = k[i, :n]
                vc[i, p : p + n] = v[i, :n]
