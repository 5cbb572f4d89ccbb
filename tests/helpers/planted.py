"""Planted wrong backends: the bugs the correctness gate exists to catch, each one line from right.

Every class here is :class:`Precise` — attention over a contiguous cache computed as the calibration
reference computes it (scores, softmax and P·V in float32, one rounding of the output), which the gate
passes at every dtype and context — with one bug planted. The gate must fail each of them in bf16,
fp16 and fp32 at any context (``tests/correctness/test_gate_planted.py``; the table in docs/correctness.md)::

    from helpers.planted import PLANTED
    check(PLANTED["newest-dropped"](), workload).passed   # False

They are test fixtures (``scripts/gate_matrix.py`` imports them from here too); none is registered as
a backend.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from attnbench.backends.naive import NaiveBackend
from attnbench.core.backend import DEFAULT_ERROR_MULTIPLE, StepPlan
from attnbench.core.kvcache import ContiguousKVCache
from attnbench.core.shapes import ModelShape
from attnbench.core.workload import Workload

__all__ = ["GATE_SMALL", "PLANTED", "PLANTED_LATENT", "Precise"]

#: The small geometry the gate matrix uses where llama-3.1-8b's would not fit a CI run (2 layers, 8
#: query heads over 2 KV heads of 32): enough for a wrong GQA mapping to show.
GATE_SMALL = ModelShape(
    name="gate-small",
    num_layers=2,
    num_heads=8,
    num_kv_heads=2,
    head_dim=32,
    hidden_size=256,
    intermediate_size=512,
    vocab_size=256,
    num_params=1_000_000,
    source="attnbench gate matrix",
)


def _pv(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """P·V summed pairwise (torch's reduction), not by a matrix-vector product.

    A float32 matrix-vector product adds the tokens one after another into one accumulator: over
    128k tokens with a needle holding most of the weight, each of the many small additions loses
    ``eps · |acc|``, ~1e-2 in all — more than an fp16 output rounding. A careful kernel tiles the sum.
    """
    return (probs[:, None] * values).sum(dim=0)


class Precise(NaiveBackend):
    """Exact attention over a contiguous cache, rounded as carefully as the dtype allows (no bug).

    ``naive``'s cache, plan, append and decode; its own attention, at the default error multiple."""

    name = "precise"
    description = "float32 scores, softmax and P·V over a contiguous cache (a test fixture)"
    kv_form: ClassVar[str] = "expanded"

    def implementation(self, workload: Workload) -> str:
        return type(self).__qualname__

    def error_multiple(self, dtype: torch.dtype, *, config: Mapping[str, Any] | None = None) -> float:
        return DEFAULT_ERROR_MULTIPLE

    def attend(
        self, cache: ContiguousKVCache, plan: StepPlan, *, layer: int, q: torch.Tensor
    ) -> torch.Tensor:
        g = cache.geometry
        out = torch.empty(q.shape[0], g.num_q_heads, g.v_head_dim, dtype=torch.float32, device=q.device)
        for i, n in enumerate(plan.seq_lens_after):
            rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            for qh in range(g.num_q_heads):
                kh = self.kv_head(qh, g.group_size, g.num_kv_heads)
                if kh not in rows:  # [n, Dk], [n, Dv] in float32, once per KV head
                    rows[kh] = self.history(
                        cache.k[layer, i, kh, :n].float(), cache.v[layer, i, kh, :n].float(), n=n
                    )
                keys, values = rows[kh]
                scores = self.scores(q[i, qh].float(), keys, scale=g.scale, dv=g.v_head_dim)  # [n]
                out[i, qh] = self.mix(scores, values)
        return self.finish(out).to(q.dtype)

    # -- the pieces a planted bug replaces --------------------------------------------------------
    def kv_head(self, q_head: int, group: int, num_kv_heads: int) -> int:
        return q_head // group

    def history(
        self, keys: torch.Tensor, values: torch.Tensor, *, n: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return keys, values

    def scores(self, q: torch.Tensor, keys: torch.Tensor, *, scale: float, dv: int) -> torch.Tensor:
        return (keys @ q) * scale

    def mix(self, scores: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return _pv(torch.softmax(scores, dim=-1), values)

    def finish(self, out: torch.Tensor) -> torch.Tensor:
        return out


class NewestDropped(Precise):
    """Attends to every token but the one this step appended (an off-by-one length)."""

    def history(self, keys, values, *, n):
        return keys[: n - 1], values[: n - 1]


class OldestDropped(Precise):
    """Skips the first token (a window or sink mistake)."""

    def history(self, keys, values, *, n):
        return keys[1:], values[1:]


class OutputScaled(Precise):
    """Output 1 % too large."""

    def finish(self, out):
        return out * 1.01


class SoftmaxScaleOff(Precise):
    """Softmax scale 1 % too large (e.g. a head_dim rounded when the scale was computed)."""

    def scores(self, q, keys, *, scale, dv):
        return (keys @ q) * (scale * 1.01)


class WrongGQAMapping(Precise):
    """Query head ``h`` reads KV head ``h % Hkv`` instead of ``h // G``."""

    def kv_head(self, q_head, group, num_kv_heads):
        return q_head % num_kv_heads


class StalePage(Precise):
    """Reads the page that holds the previous step's token as it was before that step.

    The page (16 tokens) was copied before the previous step wrote into it, so the token written then
    is missing (the cache slot still holds its zero fill); the rest of the page is unchanged.
    """

    def history(self, keys, values, *, n):
        if n < 2:
            return keys, values
        keys, values = keys.clone(), values.clone()
        keys[n - 2] = 0.0
        values[n - 2] = 0.0
        return keys, values


class WrongSplitMerge(Precise):
    """Splits the context in two and averages the halves' outputs instead of weighting them by their
    softmax mass (the log-sum-exp merge)."""

    def mix(self, scores, values):
        half = max(1, scores.shape[0] // 2)
        if half >= scores.shape[0]:
            return super().mix(scores, values)
        a = _pv(torch.softmax(scores[:half], dim=-1), values[:half])
        b = _pv(torch.softmax(scores[half:], dim=-1), values[half:])
        return (a + b) / 2


class PVAccumulatedInBF16(Precise):
    """Accumulates P·V over 16-token tiles in a bf16 accumulator (each tile's partial sum in float32)."""

    def mix(self, scores, values):
        probs = torch.softmax(scores, dim=-1)
        n, tile = probs.shape[0], 16
        pad = -n % tile
        probs = torch.nn.functional.pad(probs, (0, pad)).view(-1, tile)  # [tiles, 16]
        values = torch.nn.functional.pad(values, (0, 0, 0, pad)).view(-1, tile, values.shape[-1])
        parts = torch.einsum("tn,tnd->td", probs, values)  # each tile's partial sum, float32
        acc = torch.zeros(values.shape[-1], dtype=torch.bfloat16)
        for part in parts:
            acc = (acc.float() + part).to(torch.bfloat16)
        return acc.float()


class PreciseLatent(Precise):
    """The latent (MLA absorbed) form of :class:`Precise`: one shared KV head, the value is the latent."""

    name = "precise_latent"
    kv_form = "latent"


class RopeLatentSplitWrong(PreciseLatent):
    """Latent form whose scores use only the latent columns: the rope part of the key is dropped."""

    def scores(self, q, keys, *, scale, dv):
        return (keys[:, :dv] @ q[:dv]) * scale


#: The planted bugs of the expanded form, by the name the docs' table uses.
PLANTED: dict[str, type[Precise]] = {
    "newest-dropped": NewestDropped,
    "oldest-dropped": OldestDropped,
    "output-x1.01": OutputScaled,
    "softmax-scale-x1.01": SoftmaxScaleOff,
    "wrong-gqa-mapping": WrongGQAMapping,
    "stale-page": StalePage,
    "wrong-split-merge": WrongSplitMerge,
    "pv-accumulated-bf16": PVAccumulatedInBF16,
}

#: The planted bugs of the latent (MLA) form.
PLANTED_LATENT: dict[str, type[Precise]] = {"rope-latent-split-wrong": RopeLatentSplitWrong}
