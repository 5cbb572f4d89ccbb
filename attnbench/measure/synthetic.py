"""The synthetic attention-only model: any shape's decode step, with nothing but attention and its cache.

Per layer it materialises the attention inputs (``q``/``k``/``v`` of one token, prepared before any
timer) and the KV cache, nothing else, so a step costs what the backend costs. Caches of all layers
rarely fit in host memory at long context, so it materialises ``layers_materialised`` distinct layer
caches — together several times the size of the last-level cache, or all layers when they fit the
budget — and runs every one of ``num_layers`` decode calls per step, cycling over them (layer ``l``
uses cache ``l % layers_materialised``). Each call therefore still reads its cache from DRAM, and a
step does ``num_layers`` calls, exactly as the real model would.

Every input comes from a generator seeded per purpose (the decode inputs, the caches' fill: one random
chunk for all layer caches, each taking its own window of it, shifted and its dims rotated by its
slot, and built as sums of fewer draws), so :meth:`SyntheticModel.history_for` can rebuild exactly what any decode call saw — the
timed run is checked against float64 afterwards (:mod:`attnbench.measure.bench`) without keeping a copy of the
history while it is timed.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping
from typing import Any

import torch

from attnbench.core.backend import Backend, KVCache, Resolution
from attnbench.core.timing import synchronize
from attnbench.core.workload import Workload
from attnbench.correctness.gate import random_step_inputs
from attnbench.measure.layers import materialised_layers

__all__ = ["SyntheticModel"]

#: Fill the cache in chunks of this many tokens so filling never needs a full-size temporary.
_FILL_CHUNK = 2048
#: A fill's random vectors: each the sum of one of its sequence's ``_FILL_PERIOD`` and one the batch
#: shares per ``_FILL_PERIOD`` tokens (:meth:`SyntheticModel._fill_pool`), each scaled to variance 1/2
_FILL_PERIOD = 64
_HALF_SCALE = 0.5**0.5


# ---------------------------------------------------------------------------------------------------
# the synthetic attention-only model
# ---------------------------------------------------------------------------------------------------
class SyntheticModel:
    """Attention only: ``num_layers`` decode calls per step through ``backend``, nothing else.

    ``workload`` gives the shape, batch, dtype, device and (for :meth:`fill`) the context lengths.
    ``materialise_bytes`` bounds the distinct layer caches (see :func:`materialised_layers`);
    ``input_sets`` copies of every layer's ``q``/``k``/``v`` are prepared and rotated, one per step.
    Inputs are fresh ``N(0, 1)`` values (never zeros). Allocation happens in ``setup()``/``fill()``
    only; ``decode_step()`` allocates only what the backend's ``plan()`` and ``decode()`` allocate.
    """

    vocab_size: int | None = None

    def __init__(
        self,
        backend: Backend,
        workload: Workload,
        *,
        config: Mapping[str, Any] | None = None,
        num_layers: int | None = None,
        materialise_bytes: int | None = None,
        input_sets: int = 2,
        seed: int | None = None,
        resolution: Resolution | None = None,
    ) -> None:
        if resolution is None or not resolution.matches(workload, config):
            resolution = backend.resolve(workload, config)
        resolution.require()
        if num_layers is not None and num_layers <= 0:
            raise ValueError(f"num_layers = {num_layers} must be > 0")
        if input_sets <= 0:
            raise ValueError(f"input_sets = {input_sets} must be > 0")
        self.backend = backend
        self.workload = workload
        self.resolution = resolution
        self.config = dict(resolution.config)
        self.num_layers = num_layers or workload.shape.num_layers
        self.batch = workload.batch
        self.device = torch.device(workload.device)
        self.form = backend.kv_form
        self.geometry = workload.geometry(self.form)
        self.materialise_bytes = materialise_bytes
        self.input_sets = input_sets
        self.seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
        self.generator = self._generator("decode")
        self.record_layer: int | None = None  # decode_step keeps this layer's output of every step
        self.recorded: list[tuple[int, torch.Tensor]] = []
        self.cache: KVCache | None = None
        self.layers_materialised = 0
        self._decode_inputs: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = []
        self._prefill_inputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._step = 0
        self._last_max_seq_len = 0
        #: the fill's K/V of the recorded layer's cache slot, as generated ([B, S, Hkv, D]), so that
        #: :meth:`history_for` need not generate them again (at batch 8 × 32k: 5 s of a 10-s check)
        self._filled: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def _generator(self, purpose: str, slot: int = 0) -> torch.Generator:
        """A generator of its own per purpose (and layer cache), so one can be replayed alone."""
        offset = {"decode": 0, "prefill": 1, "fill": 2}[purpose]
        return torch.Generator().manual_seed((self.seed * 7919 + offset * 104729 + slot) % 2**63)

    # -- sizes -------------------------------------------------------------------------------------
    def per_layer_bytes(self, max_seq_len: int) -> int:
        """Bytes of one layer's cache for ``max_seq_len`` slots (as the base protocol counts them)."""
        g = self.geometry
        values = g.qk_head_dim if self.form == "latent" else g.num_kv_heads * (g.qk_head_dim + g.v_head_dim)
        return values * self.workload.dtype.itemsize * max_seq_len * self.batch

    def kv_bytes_per_step(self) -> int:
        """KV bytes the next decode step reads: every layer, every cached token plus the new one."""
        if self.cache is None:
            raise RuntimeError("SyntheticModel: call setup() or fill() first")
        per_token_layer = self.cache.bytes_per_token() // self.cache.num_layers
        return per_token_layer * self.num_layers * sum(n + 1 for n in self.cache.seq_lens)

    def kv_bytes_per_step_growth(self) -> int:
        """How much :meth:`kv_bytes_per_step` grows with each committed step (one token per sequence)."""
        cache = self._require_cache()
        return cache.bytes_per_token() // cache.num_layers * self.num_layers * self.batch

    # -- allocation (untimed) ----------------------------------------------------------------------
    def setup(self, prompt_len: int, new_tokens: int) -> None:
        """Allocate the cache for ``prompt_len + new_tokens`` tokens and prepare every input."""
        if prompt_len < 0 or new_tokens < 0:
            raise ValueError(f"prompt_len = {prompt_len}, new_tokens = {new_tokens}: both must be ≥ 0")
        self._allocate(max(1, prompt_len + new_tokens))
        # prompt inputs per layer, cycled like the caches and bounded by the same budget
        g = self.geometry
        per_set = (g.num_q_heads + g.num_kv_heads) * g.qk_head_dim + g.num_kv_heads * g.v_head_dim
        per_set *= self.workload.dtype.itemsize * self.batch * prompt_len
        sets = materialised_layers(
            per_layer_bytes=per_set,
            num_layers=self.layers_materialised,
            device=self.device,
            budget_bytes=self.materialise_bytes,
        )
        gen = self._generator("prefill")
        self._prefill_inputs = [self._random(prompt_len, generator=gen) for _ in range(sets)]

    def fill(self, *, extra_tokens: int) -> None:
        """Allocate and fill the cache to the workload's context lengths with random K/V (untimed).

        Room is left for ``extra_tokens`` decode steps. Filling goes through ``backend.append`` in
        chunks, so the backend lays out its own cache.
        """
        lens = list(self.workload.context_lens)
        self._allocate(max(lens) + max(extra_tokens, 1))
        assert self.cache is not None
        gen = self._generator("fill")
        kept = self.record_layer % self.layers_materialised if self.record_layer is not None else None
        hk, hv = self._history_buffers(max(lens)) if kept is not None else (None, None)
        done = [0] * self.batch
        for num_new in self._fill_chunks():
            plan = self.backend.plan(self.cache, num_new=num_new)
            pool = self._fill_pool(max(num_new), generator=gen)
            for slot in range(self.layers_materialised):
                k, v = self._fill_window(pool, slot, max(num_new))
                if slot == kept and hk is not None and hv is not None:  # before the backend sees them
                    self._copy_rows(hk, hv, k, v, done, num_new)
                self.backend.append(self.cache, plan, layer=slot, k=k, v=v)
            self.cache.commit(plan)
            done = [d + n for d, n in zip(done, num_new, strict=True)]
        self._filled = (kept, hk, hv) if kept is not None and hk is not None and hv is not None else None

    def fill_like(self, source: SyntheticModel, *, extra_tokens: int) -> None:
        """What :meth:`fill` gives, copied from ``source`` instead of generated and written again (at
        batch 8 × 32k tokens, 1 GiB: 1.4 s against 7.1 s, measured). ``source``: a filled model of the
        same backend class, workload and sizes, filled for as many ``extra_tokens``, whose config differs
        from this one's only in the backend's ``cache_neutral`` tunables, so that its cache holds the
        same bytes in the same places (stepped or not: the lengths go back to the fill's, as
        :meth:`rewind` does). The copy is memory of its own (its own placement), with the source's seed
        (the same inputs)."""
        neutral = set(self.backend.cache_neutral)
        differ = {k for k in {*self.config, *source.config} if self.config.get(k) != source.config.get(k)}
        if (
            source.cache is None
            or type(source.backend) is not type(self.backend)
            or source.workload != self.workload
            or (source.num_layers, source.materialise_bytes) != (self.num_layers, self.materialise_bytes)
            or not neutral
            or not differ <= neutral
        ):
            raise ValueError(
                f"fill_like: {type(source.backend).__name__} {source.config} cannot stand for "
                f"{type(self.backend).__name__} {self.config} (a filled model of the same backend, workload "
                f"and sizes, differing only in the cache_neutral tunables {sorted(neutral)}, is needed)"
            )
        self.seed = source.seed
        self._allocate(source._last_max_seq_len)
        if self._last_max_seq_len != max(self.workload.context_lens) + max(extra_tokens, 1):
            raise ValueError(
                f"fill_like: the source has room for {source._last_max_seq_len} tokens, this fill for "
                f"{max(self.workload.context_lens) + max(extra_tokens, 1)}"
            )
        cache = self._require_cache()
        _copy_cache(source._require_cache(), cache)
        cache.seq_lens = tuple(self.workload.context_lens)
        self._filled = source._filled

    def rewind(self) -> None:
        """Back to the state :meth:`fill` left, without filling again: the lengths back to the workload's
        context, the step count to 0, nothing recorded. The next steps write their tokens at the same
        positions as the first run's (overwriting them), so :meth:`history_for` holds; valid for a
        backend whose cache's state is its lengths and what was written at each position (one that
        declares ``cache_neutral``)."""
        cache = self._require_cache()
        cache.seq_lens = tuple(self.workload.context_lens)
        self._step = 0
        self.recorded = []

    def _fill_pool(self, tokens: int, *, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """One fill chunk's random K/V ``[B, T, Hkv, D]`` for every layer cache at once: ``tokens`` plus
        one more token per further layer cache (generating each layer's own would cost
        ``layers_materialised`` times the random numbers).

        Each vector is the sum of two ``N(0, 1/2)`` draws, so ``N(0, 1)`` as a plain draw is: one of a
        sequence's :data:`_FILL_PERIOD` (its token's position modulo the period) and one shared by the
        batch (its token's position divided by the period). Every (sequence, token) pair still holds a
        vector of its own — a backend that reads another sequence's or another token's K/V reads other
        values and fails the timed step's check — for ``B·P + T/P`` random vectors instead of ``B·T``:
        generating normal numbers was two thirds of a fill's time (batch 8 × 32k tokens: 4.2 of 6.7 s)."""
        n = tokens + self.layers_materialised - 1
        g, period = self.geometry, _FILL_PERIOD
        rows = -(-n // period)

        def draw(dim: int) -> torch.Tensor:
            kw: dict[str, Any] = {"device": self.device, "dtype": self.workload.dtype}
            own = torch.randn(self.batch, 1, period, g.num_kv_heads, dim, generator=generator)
            shared = torch.randn(1, rows, 1, g.num_kv_heads, dim, generator=generator)
            whole = own.mul_(_HALF_SCALE).to(**kw) + shared.mul_(_HALF_SCALE).to(**kw)
            return whole.view(self.batch, rows * period, g.num_kv_heads, dim)[:, :n]

        k = draw(g.qk_head_dim)
        return k, (k[..., : g.v_head_dim] if self.form == "latent" else draw(g.v_head_dim))

    def _fill_window(
        self, pool: tuple[torch.Tensor, torch.Tensor], slot: int, tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer cache ``slot``'s K/V of a chunk: the pool's ``tokens`` starting at token ``slot``, each
        vector's dims rotated by ``slot`` (a copy: a fraction of generating it), so that every key of
        every layer cache differs from the others' and a backend reading the wrong layer fails the timed
        step's check. The latent form keeps ``v`` the first columns of its ``k``."""
        k = pool[0][:, slot : slot + tokens]
        k = k.roll(slot % k.shape[-1], dims=-1) if slot % k.shape[-1] else k
        if self.form == "latent":
            return k, k[..., : pool[1].shape[-1]]
        v = pool[1][:, slot : slot + tokens]
        return k, v.roll(slot % v.shape[-1], dims=-1) if slot % v.shape[-1] else v

    def _fill_chunks(self) -> list[list[int]]:
        lens = list(self.workload.context_lens)
        done, chunks = [0] * self.batch, []
        while any(d < n for d, n in zip(done, lens, strict=True)):
            num_new = [min(_FILL_CHUNK, n - d) for d, n in zip(done, lens, strict=True)]
            chunks.append(num_new)
            done = [d + n for d, n in zip(done, num_new, strict=True)]
        return chunks

    def history_for(
        self, layer: int, step: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, ...]]:
        """What decode call ``layer`` of step ``step`` (counted from :meth:`fill`) attended over.

        Returns ``q [B, Hq, Dk]``, the history ``k [B, S, Hkv, Dk]`` and ``v [B, S, Hkv, Dv]`` and each
        sequence's length after the call, rebuilt from the generators: the cache's fill, then each
        earlier step's token as the last layer that shares this cache wrote it, then the call's own.
        """
        m = self.layers_materialised
        slot = layer % m
        lens = list(self.workload.context_lens)
        hk, hv = self._history_buffers(max(lens) + step + 1)
        if self._filled is not None and self._filled[0] == slot:  # kept from the fill: copied
            n = max(lens)
            hk[:, :n] = self._filled[1]
            if self.form != "latent":
                hv[:, :n] = self._filled[2]
        else:  # generated again from the fill's generator
            gen, done = self._generator("fill"), [0] * self.batch
            for num_new in self._fill_chunks():
                k, v = self._fill_window(self._fill_pool(max(num_new), generator=gen), slot, max(num_new))
                self._copy_rows(hk, hv, k, v, done, num_new)
                done = [d + n for d, n in zip(done, num_new, strict=True)]
        last = max(x for x in range(slot, self.num_layers, m))  # the layer whose write survives a step
        for j in range(step + 1):
            writer = layer if j == step else last
            _, k, v = self._decode_inputs[j % self.input_sets][writer]
            for i, n in enumerate(lens):
                hk[i, n + j] = k[i]
                if self.form != "latent":
                    hv[i, n + j] = v[i]
        q, after = self.call_query(layer, step)
        return q, hk, hv, after

    def call_query(self, layer: int, step: int) -> tuple[torch.Tensor, tuple[int, ...]]:
        """Decode call ``layer`` of step ``step``'s query ``[B, Hq, Dk]`` and each sequence's length after it."""
        q = self._decode_inputs[step % self.input_sets][layer][0]
        return q, tuple(n + step + 1 for n in self.workload.context_lens)

    def history_key(self, layer: int, step: int) -> tuple[Any, ...]:
        """What decode call ``layer`` of step ``step``'s inputs (:meth:`history_for`) are a function of:
        two models, of any backend or config, with equal keys saw the same query and history there.

        Besides the seed and sizes it holds the float64 sums of the decode inputs the call's query and
        history take (the fill is regenerated or copied before a backend sees it): a backend that wrote
        into the inputs it was handed changes the key instead of sharing a stale one."""
        w, m = self.workload, self.layers_materialised
        last = max(x for x in range(layer % m, self.num_layers, m))
        used = [self._decode_inputs[step % self.input_sets][layer][0]]
        for j in range(step + 1):
            _, k, v = self._decode_inputs[j % self.input_sets][layer if j == step else last]
            used += [k, v]
        sums = tuple(float(t.sum(dtype=torch.float64)) for t in used)
        return (
            self.seed, w.describe(), tuple(w.context_lens), w.dtype_name, self.form,
            self.num_layers, m, self.input_sets, layer, step, sums,
        )  # fmt: skip

    def _history_buffers(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed ``[B, tokens, Hkv, D]`` K and V histories (V a view of K's first columns for the latent form)."""
        g = self.geometry
        kw: dict[str, Any] = {"dtype": self.workload.dtype, "device": self.device}
        hk = torch.zeros(self.batch, tokens, g.num_kv_heads, g.qk_head_dim, **kw)
        if self.form == "latent":
            return hk, hk[..., : g.v_head_dim]
        return hk, torch.zeros(self.batch, tokens, g.num_kv_heads, g.v_head_dim, **kw)

    def _copy_rows(
        self,
        hk: torch.Tensor,
        hv: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        done: list[int],
        num_new: list[int],
    ) -> None:
        """A fill chunk's K/V into the histories, each sequence's ``num_new`` tokens after its ``done``."""
        for i, n in enumerate(num_new):
            hk[i, done[i] : done[i] + n] = k[i, :n]
            if self.form != "latent":
                hv[i, done[i] : done[i] + n] = v[i, :n]

    def _allocate(self, max_seq_len: int) -> None:
        self.cache, self._filled = None, None  # free the old cache before allocating the new one
        self.layers_materialised = materialised_layers(
            per_layer_bytes=self.per_layer_bytes(max_seq_len),
            num_layers=self.num_layers,
            device=self.device,
            budget_bytes=self.materialise_bytes,
        )
        self.cache = self.backend.create_cache(
            self.workload, config=self.config, num_layers=self.layers_materialised, max_seq_len=max_seq_len
        )
        self._last_max_seq_len = max_seq_len
        # one (q, k, v) per layer and input set: [B, Hq, Dk], [B, Hkv, Dk], [B, Hkv, Dv]
        gen = self._generator("decode")
        self._decode_inputs = [
            [
                (q[:, 0], k[:, 0], v[:, 0])
                for q, k, v in (self._random(1, generator=gen) for _ in range(self.num_layers))
            ]
            for _ in range(self.input_sets)
        ]
        self._step = 0

    def _random(
        self, tokens: int, *, q: bool = True, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = self.geometry
        if not q:  # skip generating the (large) query of a fill chunk
            g = dataclasses.replace(g, num_q_heads=g.num_kv_heads)
        return random_step_inputs(
            g,
            self.form,
            batch=self.batch,
            tokens=tokens,
            dtype=self.workload.dtype,
            device=self.device,
            generator=generator,
        )

    # -- the model ---------------------------------------------------------------------------------
    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        """Run the prompt's attention through ``backend.prefill`` on every layer; returns the last layer's
        output at the last position, ``[B, Hq, Dv]`` (there are no logits)."""
        cache = self._require_cache()
        t = tokens.shape[1]
        prepared = int(self._prefill_inputs[0][0].shape[1]) if self._prefill_inputs else 0
        if not self._prefill_inputs or prepared != t:
            raise ValueError(f"prefill: prompt of {t} tokens but setup() prepared {prepared}")
        cache.reset()
        plan = self.backend.plan(cache, num_new=[t] * self.batch)
        out = None
        for layer in range(self.num_layers):
            slot = layer % self.layers_materialised
            q, k, v = self._prefill_inputs[layer % len(self._prefill_inputs)]
            out = self.backend.prefill(cache, plan, layer=slot, q=q, k=k, v=v)
        cache.commit(plan)
        assert out is not None
        return out[:, -1]

    def decode_step(self, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """One token per sequence through every layer: ``plan()``, ``num_layers`` × ``decode()``,
        ``commit()``. Returns the last layer's output ``[B, Hq, Dv]``; ``tokens`` are ignored."""
        cache = self._require_cache()
        inputs = self._decode_inputs[self._step % self.input_sets]
        step, self._step = self._step, self._step + 1
        plan = self.backend.plan(cache, num_new=[1] * self.batch)
        out = None
        m = self.layers_materialised
        for layer in range(self.num_layers):
            q, k, v = inputs[layer]
            out = self.backend.decode(cache, plan, layer=layer % m, q=q, k=k, v=v)
            if layer == self.record_layer:  # one small copy per step, for the check after timing
                self.recorded.append((step, out.clone()))
        cache.commit(plan)
        assert out is not None
        return out

    def step_inputs(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The ``(q, k, v)`` of every layer that decode step ``step`` uses (the prepared tensors themselves)."""
        return self._decode_inputs[step % self.input_sets]

    def decode_step_call_times(self) -> tuple[float, list[float]]:
        """One decode step with each backend call timed on its own (device-synced around each).

        Returns ``(plan seconds, [decode seconds per layer])`` — the backend's own cost of a step,
        which the loop-overhead benchmark compares with the step's time.
        """
        cache = self._require_cache()
        inputs = self._decode_inputs[self._step % self.input_sets]
        self._step += 1
        m = self.layers_materialised
        synchronize(self.device)
        t0 = time.perf_counter()
        plan = self.backend.plan(cache, num_new=[1] * self.batch)
        synchronize(self.device)
        plan_s = time.perf_counter() - t0
        layer_s = []
        for layer in range(self.num_layers):
            q, k, v = inputs[layer]
            t0 = time.perf_counter()
            self.backend.decode(cache, plan, layer=layer % m, q=q, k=k, v=v)
            synchronize(self.device)
            layer_s.append(time.perf_counter() - t0)
        cache.commit(plan)
        return plan_s, layer_s

    def release(self) -> None:
        """Free the cache and the prepared inputs (``setup()``/``fill()`` allocate them again)."""
        self.cache = None
        self._decode_inputs = []
        self._prefill_inputs = []
        self.recorded = []
        self._filled = None

    def _require_cache(self) -> KVCache:
        if self.cache is None:
            raise RuntimeError("SyntheticModel: call setup() or fill() before prefill()/decode_step()")
        return self.cache


def _copy_cache(source: KVCache, target: KVCache) -> None:
    """Copy every tensor of ``source``, a cache of the same class and sizes, into ``target``'s (in place:
    its memory stays its own). A field whose shape or dtype differs is an error that names it. Valid
    where a cache's state is its tensors and lengths (a backend that declares ``cache_neutral``)."""
    if type(source) is not type(target):
        raise ValueError(f"fill_like: a {type(source).__name__} into a {type(target).__name__}")
    for name, mine in vars(target).items():
        if not isinstance(mine, torch.Tensor):
            continue
        theirs = getattr(source, name, None)
        if not isinstance(theirs, torch.Tensor) or (theirs.shape, theirs.dtype) != (mine.shape, mine.dtype):
            got = (tuple(theirs.shape), theirs.dtype) if isinstance(theirs, torch.Tensor) else theirs
            raise ValueError(
                f"fill_like: field {name!r} is {got} in the source, {(tuple(mine.shape), mine.dtype)} here"
            )
        mine.copy_(theirs)
