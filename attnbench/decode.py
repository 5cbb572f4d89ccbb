"""The decode loop (gpt-fast shaped) and the synthetic attention-only model it can drive.

A model the loop can drive satisfies :class:`DecodeModel`: ``setup()`` allocates, ``prefill()`` runs
the prompt, ``decode_step()`` runs one token per sequence. :func:`generate` times them::

    model = SyntheticModel(backend, Workload.uniform("llama-3.1-8b", batch=1, context=1024))
    run = generate(model, prompt_len=512, new_tokens=32)
    run.ttft_s, run.itl.median_s, run.e2e_s        # e2e ≈ TTFT + (new_tokens - 1) · ITL (mean)

Two kinds of model plug in:

- :class:`SyntheticModel` — attention only. Any preset shape (even llama-3.1-405b): per layer it
  materialises the attention inputs (``q``/``k``/``v`` of one token, prepared before any timer) and
  the KV cache, nothing else, so a step costs what the backend costs. Caches of all layers rarely fit
  in host memory at long context, so it materialises ``layers_materialised`` distinct layer caches —
  together several times the size of the last-level cache, or all layers when they fit the budget —
  and runs every one of ``num_layers`` decode calls per step, cycling over them (layer ``l`` uses cache
  ``l % layers_materialised``). Each call therefore still reads its cache from DRAM, and a step does
  ``num_layers`` calls, exactly as the real model would.
- real decoders (``attnbench.models``) that compute logits from token ids.

The loop's own work per step is one ``plan()``, the layer calls and one ``commit()``; ``plan()`` is
host work and may allocate, the per-layer ``decode()`` calls are capturable.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from attnbench.backend import Backend, KVCache
from attnbench.device import last_level_cache_bytes
from attnbench.gate import random_step_inputs
from attnbench.timing import Timing, synchronize
from attnbench.workload import Workload

__all__ = [
    "DecodeModel",
    "GenerationResult",
    "SyntheticModel",
    "generate",
    "materialised_layers",
]

#: Fill the cache in chunks of this many tokens so filling never needs a full-size temporary.
_FILL_CHUNK = 2048


@runtime_checkable
class DecodeModel(Protocol):
    """What :func:`generate` drives (the shape of gpt-fast's ``prefill`` / ``decode_one_token``).

    Attributes:
        batch: sequences decoded together (``B``).
        device: where the model runs.
        vocab_size: size of the logits' last dimension, or ``None`` for a model without a
            vocabulary (the synthetic model), in which case the loop feeds token 0.

    Methods (all tensors on ``device``):
        ``setup(prompt_len, new_tokens)``: allocate everything a run needs (caches, prepared
            inputs); untimed. Called again before each run; it also empties the cache.
        ``prefill(tokens)``: ``tokens [B, T]`` int64 → logits ``[B, V]`` of the last position. Runs
            on an empty cache and leaves ``T`` tokens in it.
        ``decode_step(tokens)``: ``tokens [B]`` int64 → logits ``[B, V]`` for the next position;
            appends one token per sequence (one ``plan()``, every layer, one ``commit()``).
        ``kv_bytes_per_step()``: KV-cache bytes the next ``decode_step`` reads over all layers.
    """

    batch: int
    device: torch.device
    vocab_size: int | None

    def setup(self, prompt_len: int, new_tokens: int) -> None: ...

    def prefill(self, tokens: torch.Tensor) -> torch.Tensor: ...

    def decode_step(self, tokens: torch.Tensor) -> torch.Tensor: ...

    def kv_bytes_per_step(self) -> int: ...


# ---------------------------------------------------------------------------------------------------
# how many layer caches to materialise
# ---------------------------------------------------------------------------------------------------
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
    ) -> None:
        reasons = backend.supports(workload)
        if reasons:
            why = "; ".join(reasons)
            raise ValueError(f"backend {backend.name!r} cannot run {workload.describe()}: {why}")
        if num_layers is not None and num_layers <= 0:
            raise ValueError(f"num_layers = {num_layers} must be > 0")
        if input_sets <= 0:
            raise ValueError(f"input_sets = {input_sets} must be > 0")
        self.backend = backend
        self.workload = workload
        self.config = backend.resolve_config(config)
        self.num_layers = num_layers or workload.shape.num_layers
        self.batch = workload.batch
        self.device = torch.device(workload.device)
        self.form = backend.kv_form
        self.geometry = workload.geometry(self.form)
        self.materialise_bytes = materialise_bytes
        self.input_sets = input_sets
        self.seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
        self.generator = torch.Generator().manual_seed(self.seed)
        self.cache: KVCache | None = None
        self.layers_materialised = 0
        self._decode_inputs: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = []
        self._prefill_inputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._step = 0
        self._last_max_seq_len = 0

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
        self._prefill_inputs = [self._random(prompt_len) for _ in range(sets)]

    def fill(self, *, extra_tokens: int) -> None:
        """Allocate and fill the cache to the workload's context lengths with random K/V (untimed).

        Room is left for ``extra_tokens`` decode steps. Filling goes through ``backend.append`` in
        chunks, so the backend lays out its own cache.
        """
        lens = list(self.workload.context_lens)
        self._allocate(max(lens) + max(extra_tokens, 1))
        assert self.cache is not None
        done = [0] * self.batch
        while any(d < n for d, n in zip(done, lens, strict=True)):
            num_new = [min(_FILL_CHUNK, n - d) for d, n in zip(done, lens, strict=True)]
            plan = self.backend.plan(self.cache, num_new=num_new)
            for layer in range(self.layers_materialised):
                _, k, v = self._random(max(num_new), q=False)
                self.backend.append(self.cache, plan, layer=layer, k=k, v=v)
            self.cache.commit(plan)
            done = [d + n for d, n in zip(done, num_new, strict=True)]

    def _allocate(self, max_seq_len: int) -> None:
        self.cache = None  # free the old cache before allocating the new one
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
        self._decode_inputs = [
            [tuple(t[:, 0] for t in self._random(1)) for _ in range(self.num_layers)]  # type: ignore[misc]
            for _ in range(self.input_sets)
        ]
        self._step = 0

    def _random(self, tokens: int, *, q: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
            generator=self.generator,
        )

    # -- the model ---------------------------------------------------------------------------------
    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        """Run the prompt's attention through ``backend.prefill`` on every layer; returns the last layer's
        output at the last position, ``[B, Hq, Dv]`` (there are no logits)."""
        cache = self._require_cache()
        t = tokens.shape[1]
        if not self._prefill_inputs or self._prefill_inputs[0][0].shape[1] != t:
            raise ValueError(f"prefill: prompt of {t} tokens but setup() prepared {self._prefill_len()}")
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
        self._step += 1
        plan = self.backend.plan(cache, num_new=[1] * self.batch)
        out = None
        m = self.layers_materialised
        for layer in range(self.num_layers):
            q, k, v = inputs[layer]
            out = self.backend.decode(cache, plan, layer=layer % m, q=q, k=k, v=v)
        cache.commit(plan)
        assert out is not None
        return out

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

    def _require_cache(self) -> KVCache:
        if self.cache is None:
            raise RuntimeError("SyntheticModel: call setup() or fill() before prefill()/decode_step()")
        return self.cache

    def _prefill_len(self) -> int:
        return int(self._prefill_inputs[0][0].shape[1]) if self._prefill_inputs else 0


# ---------------------------------------------------------------------------------------------------
# the loop
# ---------------------------------------------------------------------------------------------------
def _timing(samples: list[float]) -> Timing:
    s = sorted(samples)
    if not s:
        return Timing(math.nan, math.nan, math.nan, 0, 0)
    if len(s) == 1:
        return Timing(s[0], s[0], s[0], 1, 0)
    q = statistics.quantiles(s, n=10, method="inclusive")
    return Timing(statistics.median(s), q[0], q[8], len(s), 0)


@dataclass
class GenerationResult:
    """What one :func:`generate` run measured. ``tokens [B, new_tokens]``; times in seconds.

    ``itl`` summarises the ``new_tokens - 1`` decode steps (the first new token comes from prefill),
    so ``e2e_s ≈ ttft_s + (new_tokens - 1) · itl``; :attr:`e2e_check` is that sum with the mean ITL.
    """

    batch: int
    prompt_len: int
    new_tokens: int
    tokens: torch.Tensor
    ttft_s: float
    itl_samples_s: list[float]
    e2e_s: float
    kv_bytes_per_step: int  # mean over the decode steps
    logits: list[torch.Tensor] = field(default_factory=list, repr=False)  # when keep_logits=True

    @property
    def itl(self) -> Timing:
        return _timing(self.itl_samples_s)

    @property
    def decode_steps(self) -> int:
        return len(self.itl_samples_s)

    @property
    def itl_mean_s(self) -> float:
        return statistics.fmean(self.itl_samples_s) if self.itl_samples_s else 0.0

    @property
    def e2e_check(self) -> float:
        """``TTFT + (new_tokens - 1) · ITL`` with the mean ITL — what e2e is if the loop adds nothing
        between the timed calls (the usual definition: ITL = (e2e - TTFT) / (N - 1))."""
        return self.ttft_s + self.decode_steps * self.itl_mean_s

    @property
    def e2e_ratio(self) -> float:
        """``e2e / (TTFT + (N-1)·ITL mean)``; within 0.9..1.1 when the loop's own cost is small."""
        return self.e2e_s / self.e2e_check if self.e2e_check > 0 else math.nan

    @property
    def e2e_ratio_p50(self) -> float:
        """``e2e / (TTFT + (N-1)·ITL p50)``: also near 1 on a quiet machine; slow outlier steps (a
        shared, noisy machine) push it above 1 even when the loop adds nothing."""
        check = self.ttft_s + self.decode_steps * (self.itl.median_s if self.decode_steps else 0.0)
        return self.e2e_s / check if check > 0 else math.nan

    def gbps(self) -> float:
        """KV-cache GB/s achieved by a median decode step."""
        med = self.itl.median_s
        return self.kv_bytes_per_step / med / 1e9 if self.decode_steps and med > 0 else math.nan

    def as_dict(self, *, bandwidth: float | None = None) -> dict[str, Any]:
        itl = self.itl
        gbps = self.gbps()
        return {
            "batch": self.batch,
            "prompt_len": self.prompt_len,
            "new_tokens": self.new_tokens,
            "decode_steps": self.decode_steps,
            "ttft_s": self.ttft_s,
            "itl_p50_s": itl.median_s,
            "itl_p90_s": itl.p90_s,
            "itl_mean_s": self.itl_mean_s,
            "e2e_s": self.e2e_s,
            "e2e_check_s": self.e2e_check,
            "e2e_ratio": self.e2e_ratio,
            "e2e_ratio_p50": self.e2e_ratio_p50,
            "kv_bytes_per_step": self.kv_bytes_per_step,
            "gbps": gbps,
            "pct_of_bandwidth": 100 * gbps * 1e9 / bandwidth if bandwidth and not math.isnan(gbps) else None,
        }


def generate(
    model: DecodeModel,
    *,
    prompt: torch.Tensor | None = None,
    prompt_len: int | None = None,
    new_tokens: int,
    keep_logits: bool = False,
) -> GenerationResult:
    """Greedy decoding: prefill the prompt, then ``new_tokens - 1`` decode steps.

    ``prompt [B, T]`` int64 token ids, or ``prompt_len`` for a model without a vocabulary (token ids
    are then zeros). Returns the ``new_tokens`` generated ids per sequence and the timings: TTFT is the
    prefill (it yields the first new token), each ITL sample one ``decode_step``, e2e the whole run,
    every time taken after a device sync. ``setup()`` runs first, outside every timer.
    """
    if new_tokens < 1:
        raise ValueError(f"new_tokens = {new_tokens} must be ≥ 1")
    if prompt is None:
        if prompt_len is None or prompt_len < 1:
            raise ValueError(f"prompt_len = {prompt_len!r}: give a prompt tensor or a prompt_len ≥ 1")
        prompt = torch.zeros(model.batch, prompt_len, dtype=torch.long, device=model.device)
    if prompt.dim() != 2 or prompt.shape[0] != model.batch:
        shape = tuple(prompt.shape)
        raise ValueError(f"prompt has shape {shape}; expected [batch={model.batch}, prompt_len]")
    prompt = prompt.to(model.device)
    model.setup(prompt.shape[1], new_tokens)

    def pick(logits: torch.Tensor) -> torch.Tensor:
        if model.vocab_size is None:
            return torch.zeros(model.batch, dtype=torch.long, device=model.device)
        return logits.argmax(dim=-1)

    kept: list[torch.Tensor] = []
    generated: list[torch.Tensor] = []
    itl: list[float] = []
    kv_bytes: list[int] = []
    synchronize(model.device)
    start = time.perf_counter()
    logits = model.prefill(prompt)
    token = pick(logits)
    synchronize(model.device)
    ttft = time.perf_counter() - start
    generated.append(token)
    if keep_logits:
        kept.append(logits)
    for _ in range(new_tokens - 1):
        kv_bytes.append(model.kv_bytes_per_step())
        t0 = time.perf_counter()
        logits = model.decode_step(token)
        token = pick(logits)
        synchronize(model.device)
        itl.append(time.perf_counter() - t0)
        generated.append(token)
        if keep_logits:
            kept.append(logits)
    e2e = time.perf_counter() - start
    return GenerationResult(
        batch=model.batch,
        prompt_len=int(prompt.shape[1]),
        new_tokens=new_tokens,
        tokens=torch.stack(generated, dim=1),
        ttft_s=ttft,
        itl_samples_s=itl,
        e2e_s=e2e,
        kv_bytes_per_step=int(statistics.fmean(kv_bytes)) if kv_bytes else 0,
        logits=kept,
    )
