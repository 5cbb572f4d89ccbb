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
- real models that compute logits from token ids: any Hugging Face decoder through
  :mod:`attnbench.integrations.transformers`, and DeepSeek's absorbed latent decoder in
  ``attnbench.models``.

The loop's own work per step is one ``plan()``, the layer calls and one ``commit()``; ``plan()`` is
host work and may allocate, the per-layer ``decode()`` calls are capturable.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from attnbench.core.timing import Timing, synchronize
from attnbench.measure.layers import materialised_layers
from attnbench.measure.synthetic import SyntheticModel

__all__ = [
    "DecodeModel",
    "GenerationResult",
    "SyntheticModel",
    "generate",
    "materialised_layers",
]


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
