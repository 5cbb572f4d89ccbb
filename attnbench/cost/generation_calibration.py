"""Calibrating the generation cost model (:mod:`attnbench.cost.generation`) by measuring this device.

:func:`calibrate_generation` is the entry point (the terms it measures: :mod:`attnbench.cost.generation`'s
docstring).
:func:`time_linears` times each distinct linear layer of a model alone; :class:`Frame` is the model's
transformers class at its widths with every linear layer returning zeros, and :func:`calibrate_path`
times its decode steps and prompts through one generation path and fits them. Everything here may
allocate; nothing is captured. Needs transformers (imported here).
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import transformers

from attnbench.core.device import fingerprint, last_level_cache_bytes
from attnbench.core.registry import load_registry
from attnbench.core.shapes import dtype_bytes, dtype_name, parse_dtype
from attnbench.core.timing import measure, synchronize
from attnbench.cost.fit import nonnegative_lstsq
from attnbench.cost.generation import (
    DECODE_CONTEXTS,
    FRAME_LAYERS,
    PREFILL_LENGTHS,
    PREFILL_ROWS,
    DecodeFit,
    FramePoint,
    GenerationCalibration,
    LinearTime,
    ModelCost,
    PathCalibration,
    PrefillFit,
)
from attnbench.integrations.transformers import cache_kwarg, use_backend
from attnbench.measure.e2e import STOCK_PATHS, GenerationPath, parse_path

__all__ = [
    "FRAME_VOCAB",
    "Frame",
    "calibrate_generation",
    "calibrate_path",
    "measure_generation",
    "time_linears",
]

#: The frame's vocabulary: its embedding and LM head are stand-ins (the real LM head is a timed linear).
FRAME_VOCAB = 256
Say = Callable[[str], None]


def _once(fn: Callable[[], object], device: str) -> float:
    """Seconds of one call of ``fn`` (device synced before and after)."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def time_linears(
    model: ModelCost, *, dtype: torch.dtype, device: str, batches: Sequence[int], rows: Sequence[int],
    cap: Callable[[], float], say: Say,
) -> list[LinearTime]:  # fmt: skip
    """Each distinct linear layer of one decoder layer, and the LM head, timed with ``F.linear``.

    At ``batches`` rows (a decode step's GEMVs) the weights cycle over copies worth twice the
    last-level cache, so every call reads them from memory as a step of the real model does; the
    median of the timed calls, which stop after ``cap()`` seconds. At ``rows`` rows (prefill GEMMs,
    seconds each) the median of 3 calls after one warm-up call at the same shape: a GEMM's first call
    at a new shape builds its kernel (oneDNN), which a prompt of the real model pays once, not per
    layer. The LM head includes the loop's ``argmax``.
    """
    llc = last_level_cache_bytes(device)
    distinct = {(x.in_features, x.out_features, x.bias): x for x in reversed(model.layer_linears())}
    out: list[LinearTime] = []
    for layer, head in [*((x, False) for x in distinct.values()), (model.lm_head, True)]:
        copies = max(1, min(64, math.ceil(2 * llc / (layer.params * dtype_bytes(dtype)))))
        w = [
            torch.empty(layer.out_features, layer.in_features, dtype=dtype, device=device).uniform_(
                -0.05, 0.05
            )
            for _ in range(copies)
        ]
        b = torch.rand(layer.out_features, dtype=dtype, device=device) if layer.bias else None

        def call(i: int, x: torch.Tensor, w: list[torch.Tensor] = w, b: Any = b, head: bool = head) -> Any:
            y = F.linear(x, w[i], b)
            return y.float().argmax(-1) if head else y

        for r in [*batches, *(() if head else rows)]:
            x = torch.randn(r, layer.in_features, dtype=dtype, device=device)
            if r in batches:
                timing = measure(
                    functools.partial(call, x=x), device=device, warmup=copies, repeats=max(5, copies),
                    rotate=copies, max_seconds=cap(),
                )  # fmt: skip
                seconds = timing.median_s
            else:  # a warm-up at this very shape (its first call builds the GEMM's kernel), then 3 calls
                call(0, x)
                seconds = float(np.median([_once(functools.partial(call, 0, x), device) for _ in range(3)]))
            out.append(LinearTime(layer.name, layer.in_features, layer.out_features, layer.bias, r, seconds))
        mine = ", ".join(f"{t.rows} rows {t.seconds * 1e3:.3g} ms" for t in out if t.name == layer.name)
        say(f"linear {layer.name} {layer.in_features}→{layer.out_features}: {mine}")
    return out


class Frame:
    """``model``'s transformers class at its widths with ``layers`` layers, each linear layer returning
    zeros (a view of one shared buffer, so no matmul and no allocation): a step of it costs what a
    step of the model costs but the matmuls — the framework, norms, RoPE, residuals, the mask, the
    cache and the attention."""

    def __init__(
        self, model: ModelCost, *, layers: int, dtype: torch.dtype, device: str, positions: int, rows: int
    ) -> None:
        config = transformers.AutoConfig.for_model(
            model.model_type, vocab_size=FRAME_VOCAB, hidden_size=model.hidden_size,
            intermediate_size=model.intermediate_size, num_hidden_layers=layers,
            num_attention_heads=model.num_heads, num_key_value_heads=model.num_kv_heads, head_dim=model.head_dim,
            max_position_embeddings=positions, tie_word_embeddings=False, sliding_window=None,
            use_sliding_window=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        )  # fmt: skip
        hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
        self.hf = hf.to(device).eval()
        self.model, self.layers, self.dtype, self.device = model, layers, dtype, device
        self.kwarg = cache_kwarg(self.hf)
        widest = max(
            model.intermediate_size, model.num_heads * model.head_dim, model.hidden_size, FRAME_VOCAB
        )
        self.zeros = torch.zeros(rows * widest, dtype=dtype, device=device)
        for m in self.hf.modules():
            if isinstance(m, torch.nn.Linear):
                m.forward = self._zero_linear(m.out_features)  # type: ignore[method-assign,assignment]  # no matmul

    def _zero_linear(self, out: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def forward(x: torch.Tensor) -> torch.Tensor:
            n = x.numel() // x.shape[-1] * out
            return (self.zeros[:n] if n <= self.zeros.numel() else x.new_zeros(n)).view(*x.shape[:-1], out)

        return forward

    def check(self) -> None:
        """Raise if anything wrote into the shared zeros (then a linear's output was not all zeros)."""
        if bool(self.zeros.any()):
            raise RuntimeError(
                "frame: the model wrote into a linear layer's output in place; its timings are void"
            )

    def cache(self, path: GenerationPath, *, batch: int, tokens: int, room: int) -> tuple[Any, str]:
        """The path's cache holding ``tokens`` random tokens per sequence, written through its own API
        (``Cache.update``; a backend's ``plan``/``append``/``commit``), with room for ``room`` more; and
        what runs."""
        m, cache = self.model, None  # type: tuple[ModelCost, Any]
        k = torch.randn(batch, m.num_kv_heads, tokens, m.head_dim, dtype=self.dtype, device=self.device)
        if not path.stock:
            config = path.config_dict
            cache = use_backend(self.hf, path.backend, config=config, batch=batch, max_seq_len=tokens + room)
            what = f"{path.backend}: {cache.backend.resolve(cache.kv.workload, config).implementation}"
            if tokens:
                plan = cache.backend.plan(cache.kv, num_new=[tokens] * batch)
                for layer in range(self.layers):  # [B, T, Hkv, D]
                    cache.backend.append(
                        cache.kv, plan, layer=layer, k=k.transpose(1, 2), v=k.transpose(1, 2)
                    )
                cache.kv.commit(plan)
                cache.seen_tokens = tokens
            return cache, what
        implementation, kind = STOCK_PATHS[path.name]
        self.hf.set_attn_implementation(implementation)
        if kind == "static":
            cache = transformers.StaticCache(config=self.hf.config, max_cache_len=tokens + room)
        else:
            cache = transformers.DynamicCache(config=self.hf.config)
        what = f"transformers {implementation} + {type(cache).__name__}"
        for layer in range(self.layers if tokens else 0):
            cache.update(k, k, layer)
        return cache, what

    def forward(self, ids: torch.Tensor, cache: Any, _index: int = 0) -> torch.Tensor:
        """One call as the e2e loop makes it: logits of the last position only, then ``argmax``
        (``_index``: :func:`~attnbench.core.timing.measure`'s input index, unused)."""
        out = self.hf(input_ids=ids, use_cache=True, logits_to_keep=1, **{self.kwarg: cache})
        return out.logits[:, -1].float().argmax(-1)


def fit(rows: list[list[float]], seconds: list[float]) -> tuple[list[float], float]:
    """Non-negative ``coef`` with ``rows @ coef ≈ seconds`` in relative error, and that error's rms."""
    a, t = np.array(rows, dtype=float), np.maximum(np.array(seconds, dtype=float), 1e-9)
    scale = np.where(a.max(axis=0) > 0, a.max(axis=0), 1.0)
    coef = nonnegative_lstsq(a / scale / t[:, None], np.ones_like(t)) / scale
    return [float(c) for c in coef], float(np.sqrt(np.mean((a @ coef / t - 1) ** 2)))


def calibrate_path(
    path: GenerationPath, frames: dict[int, Frame], *, batches: Sequence[int], contexts: Sequence[int],
    lengths: Sequence[int], cap: Callable[[], float], say: Say,
) -> PathCalibration:  # fmt: skip
    """Time ``path`` through the frames and fit its terms.

    Decode, per batch: the 1-layer frame at ``contexts[0]`` and the deep frame at every context, the
    last-level cache evicted before each timed step → ``step_s + L·(layer_s + token_s·n)``. Prefill, at
    batch 1: the deep frame once per prompt length, less the step part → ``L·(p0 + p1·T + p2·T²)``.
    """
    deep = frames[FRAME_LAYERS]
    dev = deep.device
    static = STOCK_PATHS.get(path.name, ("", ""))[1] == "static"  # attends to its whole length
    scratch = torch.ones(2 * last_level_cache_bytes(dev) // 4, dtype=torch.float32, device=dev)
    points: list[FramePoint] = []
    fits: list[DecodeFit] = []
    what = ""
    for b in batches:
        mine = []
        ids = torch.randint(FRAME_VOCAB, (b, 1), device=dev)
        for frame, ctx in [(frames[1], contexts[0]), *((deep, c) for c in contexts)]:
            warmup, repeats = 2, 6
            cache, what = frame.cache(path, batch=b, tokens=ctx, room=warmup + repeats + 1)
            t = measure(
                functools.partial(frame.forward, ids, cache), device=dev, warmup=warmup, repeats=repeats,
                before=lambda i: scratch.add_(1.0), max_seconds=cap(),
            )  # fmt: skip
            # tokens attended by the mean timed step (sdpa-static: always its whole length)
            n = ctx + warmup + repeats + 1 if static else ctx + 1 + t.warmup + (t.repeats - 1) / 2
            mine.append(FramePoint("decode", b, frame.layers, float(n), t.median_s))
            del cache
        (step, layer, token), err = fit(
            [[1, p.layers, p.layers * p.tokens] for p in mine], [p.seconds for p in mine]
        )
        fits.append(DecodeFit(b, step, layer, token, err))
        points += mine
    step_s = min(fits, key=lambda f: f.batch).step_s
    deep.forward(
        torch.randint(FRAME_VOCAB, (1, 16), device=dev), deep.cache(path, batch=1, tokens=0, room=17)[0]
    )
    for n in lengths:
        cache, _ = deep.cache(path, batch=1, tokens=0, room=n + 1)
        ids = torch.randint(FRAME_VOCAB, (1, n), device=dev)
        seconds = _once(functools.partial(deep.forward, ids, cache), dev)
        points.append(FramePoint("prefill", 1, deep.layers, float(n), seconds))
        del cache
    prompts = [p for p in points if p.phase == "prefill"]
    coef, err = fit(
        [[p.layers, p.layers * p.tokens, p.layers * p.tokens**2] for p in prompts],
        [max(p.seconds - step_s, 0.1 * p.seconds) for p in prompts],  # the step part is not per layer
    )
    decode = ", ".join(
        f"b={f.batch} {f.step_s * 1e3:.3g} ms + L·({f.layer_s * 1e3:.3g} ms + n·{f.token_s * 1e9:.3g} ns)"
        for f in fits
    )
    say(
        f"{path.name}: decode {decode}; prefill per layer {coef[0] * 1e3:.3g} ms + T·{coef[1] * 1e6:.3g} µs "
        f"+ T²·{coef[2] * 1e9:.3g} ns"
    )
    return PathCalibration(
        path.name, what, tuple(fits), PrefillFit(coef[0], coef[1], coef[2], err), tuple(points)
    )


def measure_generation(
    model: ModelCost, paths: Sequence[GenerationPath], *, dtype: torch.dtype, batches: Sequence[int], device: str,
    max_seconds: float, say: Say, contexts: Sequence[int], lengths: Sequence[int], rows: Sequence[int],
) -> GenerationCalibration:  # fmt: skip
    """The linear layers, then every path through a 1-layer and a :data:`FRAME_LAYERS`-layer frame."""
    start = time.perf_counter()

    def cap() -> float:  # the timed repeats of one measurement: a share of the time left
        return max(0.05, (start + max_seconds - time.perf_counter()) / 40)

    with torch.inference_mode():
        linears = time_linears(
            model, dtype=dtype, device=device, batches=batches, rows=rows, cap=cap, say=say
        )
        positions = max(*contexts, *lengths) + 64
        frames = {
            n: Frame(
                model, layers=n, dtype=dtype, device=device, positions=positions, rows=max(*lengths, *batches)
            )
            for n in (1, FRAME_LAYERS)
        }
        calibrated = tuple(
            calibrate_path(p, frames, batches=batches, contexts=contexts, lengths=lengths, cap=cap, say=say)
            for p in paths
        )
        for frame in frames.values():
            frame.check()
    return GenerationCalibration(
        model=model, dtype=dtype_name(dtype), device=str(device), fingerprint=fingerprint(device),
        linears=tuple(linears), paths=calibrated,
        measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        load_avg=tuple(os.getloadavg()), seconds=time.perf_counter() - start,
    )  # fmt: skip


def calibrate_generation(
    model: ModelCost,
    *,
    paths: Sequence[str],
    dtype: torch.dtype,
    batch_sizes: Sequence[int],
    device: str = "cpu",
    max_seconds: float = 90,
    progress: Callable[[str], None] | None = None,
    decode_contexts: Sequence[int] = DECODE_CONTEXTS,
    prefill_lengths: Sequence[int] = PREFILL_LENGTHS,
    prefill_rows: Sequence[int] = PREFILL_ROWS,
) -> GenerationCalibration:
    """Measure this device for ``model``'s widths: its linear layers, and each path's frame (see the
    module docstring). ``max_seconds`` bounds the timed repeats (the fixed work runs regardless); nothing
    is printed, ``progress`` receives one line per stage. Needs transformers."""
    parsed = [parse_path(p, backends=load_registry().names()) for p in paths]
    batches = sorted(set(batch_sizes))
    for name, values, least in (("batch_sizes", batches, 1), ("decode_contexts", decode_contexts, 2),
                                ("prefill_lengths", prefill_lengths, 3), ("prefill_rows", prefill_rows, 1)):  # fmt: skip
        if len(values) < least or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
            raise ValueError(f"calibrate_generation: {name} = {list(values)!r}: need ≥ {least} integers ≥ 1")
    return measure_generation(
        model, parsed, dtype=parse_dtype(dtype), batches=batches, device=device, max_seconds=max_seconds,
        say=progress or (lambda line: None), contexts=decode_contexts, lengths=prefill_lengths, rows=prefill_rows,
    )  # fmt: skip
