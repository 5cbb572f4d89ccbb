"""KV caches shared by several backends. A backend with its own layout keeps its cache in its file."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from attnbench.core.backend import Backend, KVCache, StepPlan
from attnbench.core.workload import Workload

__all__ = ["ContiguousBackend", "ContiguousKVCache"]


class ContiguousKVCache(KVCache):
    """One slab per layer, ``max_seq_len`` slots per sequence.

    ``heads_first=True``: ``k: [L, B, Hkv, S, Dk]`` (each head's rows contiguous: BLAS- and
    SDPA-friendly); ``heads_first=False``: ``k: [L, B, S, Hkv, Dk]`` (flash-attn's layout).
    """

    def __init__(self, *, heads_first: bool = True, **base: Any) -> None:
        """``base``: the arguments of :class:`~attnbench.core.backend.KVCache` (workload, geometry, …)."""
        super().__init__(**base)
        g, b, num_layers, max_seq_len = self.geometry, self.batch, self.num_layers, self.max_seq_len
        self.heads_first = heads_first
        dims = (b, g.num_kv_heads, max_seq_len) if heads_first else (b, max_seq_len, g.num_kv_heads)
        kw: dict[str, Any] = {"dtype": self.dtype, "device": self.device}
        # zeros, not empty: masked slots are multiplied by a zero weight, and 0 * NaN garbage is NaN
        self.k = torch.zeros(num_layers, *dims, g.qk_head_dim, **kw)
        self.v = torch.zeros(num_layers, *dims, g.v_head_dim, **kw)

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def _tokens_first(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s ``k [B, S, Hkv, Dk]`` and ``v [B, S, Hkv, Dv]`` in either layout (views)."""
        kc, vc = self.k[layer], self.v[layer]
        return (kc.transpose(1, 2), vc.transpose(1, 2)) if self.heads_first else (kc, vc)

    def read(self, layer: int, seq: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``k [length, Hkv, Dk]``, ``v [length, Hkv, Dv]``: sequence ``seq``'s first tokens (views)."""
        kc, vc = self._tokens_first(layer)
        return kc[seq, :length], vc[seq, :length]

    def write(self, plan: StepPlan, *, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k [B, T, Hkv, Dk]``, ``v [B, T, Hkv, Dv]`` at ``plan.positions``."""
        kc, vc = self._tokens_first(layer)
        if plan.max_new == 1:  # decode: one vectorised scatter, no host loop
            rows = torch.arange(self.batch, device=self.device)
            kc[rows, plan.device_positions] = k[:, 0]
            vc[rows, plan.device_positions] = v[:, 0]
            return
        for i, (p, n) in enumerate(zip(plan.positions, plan.num_new, strict=True)):
            kc[i, p : p + n] = k[i, :n]
            vc[i, p : p + n] = v[i, :n]


class ContiguousBackend(Backend):
    """A backend over a :class:`ContiguousKVCache`: it creates the cache (``heads_first`` as the class
    says), and its decode writes the new token, then attends with :meth:`attend`."""

    heads_first: ClassVar[bool] = True

    def create_cache(
        self, workload: Workload, *, config: Mapping[str, Any], num_layers: int, max_seq_len: int
    ) -> ContiguousKVCache:
        return ContiguousKVCache(
            **self.cache_fields(workload, config, num_layers, max_seq_len),
            heads_first=self.heads_first,
        )

    def decode(
        self, cache: KVCache, plan: StepPlan, *, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """``q [B, Hq, Dk]``, ``k [B, Hkv, Dk]``, ``v [B, Hkv, Dv]`` → ``[B, Hq, Dv]``."""
        assert isinstance(cache, ContiguousKVCache)
        cache.write(plan, layer=layer, k=k[:, None], v=v[:, None])
        return self.attend(cache, plan, layer=layer, q=q)

    @abstractmethod
    def attend(
        self, cache: ContiguousKVCache, plan: StepPlan, *, layer: int, q: torch.Tensor
    ) -> torch.Tensor:
        """``q [B, Hq, Dk]`` over the first ``plan.seq_lens_after[i]`` tokens of ``layer`` → ``[B, Hq, Dv]``."""
