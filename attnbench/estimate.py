"""Latency estimator: generation latency ``TTFT + N · ITL`` from the roofline.

A decode step reads every weight once and the whole KV cache once, and does little arithmetic per
byte, so its time is bounded below by bytes over memory bandwidth; a prefill is bounded by its FLOPs.
Per GPU of a tensor-parallel group::

    step_s  = max((weight_bytes + kv_bytes) / (bandwidth · achievable),
                  flops / (peak_flops · achievable))
    TTFT    = max(prefill_flops / (peak · achievable), prefill_bytes / (bandwidth · achievable))
    e2e     = TTFT + N · ITL          (ITL: the mean step time over the N generated tokens)

What is counted (docs/latency-model.md has the derivation and worked examples):

- **weights**: the transformer blocks' parameters (MoE: the activated ones, see ``moe``) in the
  weight dtype, plus the LM head (``vocab · hidden``, kept in bf16 as fp8 checkpoints do), plus the
  ``batch`` rows of the input embedding a step looks up (not the whole table). Embeddings are taken
  as untied (true for every preset). All of it is split evenly over ``tp`` GPUs.
- **KV cache**: ``batch · (context + 1)`` tokens (the cached ones and the new one) of
  :meth:`ModelShape.kv_bytes_per_token` with ``form="auto"``: expanded per-head K and V for GQA, the
  latent ``kv_lora_rank + qk_rope_head_dim`` row for MLA. Under tensor parallelism the KV heads are
  split over GPUs; with ``kv_heads < tp`` each GPU holds one KV head (replicated ``tp / kv_heads``
  times, as vLLM does), and MLA's single latent head is replicated on every GPU. fp8 KV counts one
  byte per value (per-tensor scales are negligible).
- **FLOPs**: ``2 · params`` per token for the matmuls (block weights at the weight dtype's peak, fp8
  only where the GPU has fp8 tensor cores; the LM head in bf16) and ``2 · Hq · (Dk + Dv)`` per cached
  token per layer for attention (bf16 peak; MLA decode in the absorbed latent form, ``Dk = 576``,
  ``Dv = 512``; MLA prefill in the expanded form).

Not modelled (stated, not hidden): tensor-parallel all-reduces (two per layer: a few µs each on
NVLink, a few percent of a 70B step), kernel-launch and scheduling gaps, activations' memory
traffic, and speculative decoding. ``achievable`` stands for all of it.

Example::

    >>> est = estimate("llama-3.3-70b", gpu="h100", tp=2, batch=1, context=8192, new_tokens=250)
    >>> round(est.step.weight_bytes / 1e9, 1)    # per GPU
    69.5
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from typing import Any

import torch
import yaml

from attnbench.shapes import ModelShape, dtype_bytes, load_shape

__all__ = [
    "Estimate",
    "GPUSpec",
    "MoERouting",
    "PhaseCost",
    "attention_decode_flops",
    "attention_only_step",
    "estimate",
    "kv_bytes_per_token_per_gpu",
    "list_gpus",
    "load_gpu",
    "measured_gpu",
    "weight_bytes_per_gpu",
]

#: Dtypes the estimator accepts for weights and the KV cache.
WEIGHT_DTYPES = ("bf16", "fp8")
KV_DTYPES = ("bf16", "fp8")
#: The dtype of the embedding and LM head, and of attention arithmetic.
_HIGH = "bf16"


# --------------------------------------------------------------------------------------------------
# GPUs
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GPUSpec:
    """One GPU: peak memory bandwidth and dense FLOP/s by dtype, and the achievable fraction of both."""

    name: str
    label: str
    memory_bandwidth: float  # bytes/s
    memory_bytes: float  # bytes of device memory
    flops: dict[str, float]  # dense FLOP/s by dtype
    achievable: float
    source: str
    measured: bool = False

    def __post_init__(self) -> None:
        for f in ("memory_bandwidth", "memory_bytes"):
            value = getattr(self, f)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"GPU {self.name!r}: field '{f}' = {value!r} must be a number > 0")
        if _HIGH not in self.flops:
            raise ValueError(
                f"GPU {self.name!r}: field 'flops' needs a '{_HIGH}' entry; got {sorted(self.flops)}"
            )
        for dt, value in self.flops.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"GPU {self.name!r}: flops[{dt!r}] = {value!r} must be a number > 0")
        _check_fraction(self.achievable, field="achievable")

    def peak_flops(self, dtype: str) -> tuple[float, str]:
        """Dense FLOP/s for matmuls in ``dtype`` and the dtype actually used (bf16 if unsupported)."""
        if dtype in self.flops:
            return self.flops[dtype], dtype
        return self.flops[_HIGH], _HIGH

    def with_achievable(self, achievable: float | None) -> GPUSpec:
        return self if achievable is None else replace(self, achievable=_check_fraction(achievable))


def _check_fraction(value: Any, *, field: str = "--achievable") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"{field} = {value!r} must be a fraction in (0, 1]")
    return float(value)


def _gpu_table() -> dict[str, Any]:
    return yaml.safe_load(resources.files("attnbench").joinpath("gpus.yaml").read_text())


def list_gpus() -> list[str]:
    """Preset names accepted by :func:`load_gpu` (plus ``"this"``, the measured current device)."""
    return list(_gpu_table())


def load_gpu(name: str | GPUSpec, *, achievable: float | None = None) -> GPUSpec:
    """A preset by name or alias (``"h100"``), or ``"this"`` for the measured current device."""
    if isinstance(name, GPUSpec):
        return name.with_achievable(achievable)
    key = str(name).strip().lower()
    if key == "this":
        return measured_gpu().with_achievable(achievable)
    table = _gpu_table()
    for preset, data in table.items():
        if key == preset or key in (data.get("aliases") or []):
            fields = {k: v for k, v in data.items() if k != "aliases"}
            spec = GPUSpec(name=preset, **fields)
            return spec.with_achievable(achievable)
    raise LookupError(
        f"unknown GPU {name!r}; presets: {', '.join(table)}, this (the measured current device)"
    )


def _matmul_flops(device: torch.device, dtype: torch.dtype) -> float:
    """Dense FLOP/s of one square matmul (median of a few), the FLOP roofline of ``--gpu this``."""
    from attnbench.timing import measure

    n = 4096 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    t = measure(lambda i: torch.mm(a, b), device=device, warmup=2, repeats=7)
    return 2 * n**3 / t.median_s


def measured_gpu(device: str | torch.device | None = None, *, remeasure: bool = False) -> GPUSpec:
    """The current device as a :class:`GPUSpec`: measured, so ``achievable`` is 1.

    Bandwidth: :func:`attnbench.device.load_profile`'s measured copy bandwidth. FLOP/s: a square
    bf16 matmul (and fp32, recorded) timed once per device fingerprint and cached next to the
    profile. There is no fp8 matmul to time on CPU: fp8 weights then use the bf16 figure.
    """
    from attnbench.device import cache_dir, load_profile

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    profile = load_profile(dev, remeasure=remeasure)
    path = cache_dir() / "device" / f"{profile.id}-matmul.json"
    flops: dict[str, float] = {}
    if path.exists() and not remeasure:
        try:
            flops = {str(k): float(v) for k, v in json.loads(path.read_text()).items()}
        except (ValueError, AttributeError):
            flops = {}
    if _HIGH not in flops:
        flops = {"bf16": _matmul_flops(dev, torch.bfloat16), "fp32": _matmul_flops(dev, torch.float32)}
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as tmp:
            json.dump(flops, tmp)
        os.replace(tmp.name, path)
    if dev.type == "cuda":
        memory = float(torch.cuda.get_device_properties(dev).total_memory)
    else:
        memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return GPUSpec(
        name="this",
        label=f"{profile.name} (measured, profile {profile.id})",
        memory_bandwidth=profile.bandwidth,
        memory_bytes=memory,
        flops=flops,
        achievable=1.0,
        source=f"measured: copy bandwidth at {profile.measured_at}, bf16 matmul once per fingerprint",
        measured=True,
    )


# --------------------------------------------------------------------------------------------------
# What a step reads and computes
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MoERouting:
    """Routed experts of a MoE model: ``num_experts`` per layer, ``top_k`` chosen per token.

    With uniform, independent routing a step over ``t`` tokens touches on average
    ``E · (1 − (1 − k/E)^t)`` experts per layer, so weight reads grow with batch; each routed
    expert's parameters (over all layers) are ``(num_params − active_params) / (E − k)``.
    """

    num_experts: int
    top_k: int

    def __post_init__(self) -> None:
        if not (isinstance(self.num_experts, int) and isinstance(self.top_k, int)):
            raise ValueError(
                f"MoE routing: experts {self.num_experts!r} and top-k {self.top_k!r} must be integers"
            )
        if not 0 < self.top_k < self.num_experts:
            raise ValueError(
                f"MoE routing: top-k {self.top_k} must be in 1..{self.num_experts - 1} (experts {self.num_experts})"
            )

    def experts_touched(self, tokens: int) -> float:
        e, k = self.num_experts, self.top_k
        return e * (1.0 - (1.0 - k / e) ** tokens)


def _embedding_params(shape: ModelShape) -> int:
    return shape.vocab_size * shape.hidden_size


def _block_params(shape: ModelShape, *, tokens: int, moe: MoERouting | None) -> float:
    """Transformer-block parameters read by a step over ``tokens`` tokens (embeddings excluded)."""
    emb = 2 * _embedding_params(shape)  # input embedding + LM head (untied)
    active = shape.params_read_per_token - emb
    if shape.active_params is None or moe is None:
        return float(active)
    per_expert = (shape.num_params - shape.active_params) / (moe.num_experts - moe.top_k)
    return active + (moe.experts_touched(tokens) - moe.top_k) * per_expert


def _check_tp(shape: ModelShape, tp: int) -> None:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"--tp = {tp!r} must be an integer ≥ 1")
    if shape.num_heads % tp:
        raise ValueError(f"--tp {tp} does not divide num_heads {shape.num_heads} of {shape.name!r}")
    kv = shape.num_kv_heads
    if not shape.is_mla and kv % tp and tp % kv:
        raise ValueError(
            f"--tp {tp} and num_kv_heads {kv} of {shape.name!r}: one must divide the other "
            "(KV heads are split over GPUs, or replicated when fewer than tp)"
        )


def kv_bytes_per_token_per_gpu(shape: ModelShape, *, kv_dtype: str = "bf16", tp: int = 1) -> int:
    """Bytes one cached token occupies on one GPU, over all layers.

    GQA: ``layers · 2 · ceil(kv_heads / tp) · head_dim · bytes`` (``kv_heads < tp``: one head per GPU,
    replicated). MLA: the latent row ``layers · (kv_lora_rank + qk_rope_head_dim) · bytes``, replicated
    on every GPU (it is one shared head).
    """
    _check_tp(shape, tp)
    full = shape.kv_bytes_per_token(kv_dtype, "auto")
    if shape.is_mla:
        return full
    return full // shape.num_kv_heads * math.ceil(shape.num_kv_heads / tp)


def weight_bytes_per_gpu(
    shape: ModelShape,
    *,
    weight_dtype: str = "bf16",
    batch: int = 1,
    tp: int = 1,
    moe: MoERouting | None = None,
) -> float:
    """Weight bytes one decode step reads on one GPU (see the module docstring for what is counted)."""
    _check_tp(shape, tp)
    emb = _embedding_params(shape)
    block = _block_params(shape, tokens=batch, moe=moe) * dtype_bytes(weight_dtype)
    lm_head = emb * dtype_bytes(_HIGH)
    lookups = batch * shape.hidden_size * dtype_bytes(_HIGH)
    return (block + lm_head + lookups) / tp


def attention_decode_flops(
    shape: ModelShape,
    *,
    batch: int,
    context: int,
    tp: int = 1,
    form: str = "auto",
    num_layers: int | None = None,
) -> float:
    """FLOPs of the attention of one decode step on one GPU: ``QKᵀ`` and ``PV`` over ``context + 1`` tokens."""
    if form == "auto":
        form = "latent" if shape.is_mla else "expanded"
    g = shape.geometry(form)  # type: ignore[arg-type]
    layers = num_layers or shape.num_layers
    return 2.0 * layers * batch * (context + 1) * (shape.num_heads / tp) * (g.qk_head_dim + g.v_head_dim)


def attention_only_step(
    model: str | ModelShape,
    *,
    gpu: str | GPUSpec,
    batch: int,
    context: int,
    dtype: str = "bf16",
    kv_dtype: str | None = None,
    form: str = "auto",
    num_layers: int | None = None,
) -> PhaseCost:
    """The roofline of one decode step of an attention-only model (no weights): what
    :func:`attnbench.bench.measure_decode` times, for checking the estimator against measurements.

    ``kv_bytes = layers · batch · (context + 1) · kv values per token-layer · bytes``;
    ``time = max(kv_bytes / bandwidth, attention FLOPs / peak[dtype])`` (both times ``achievable``).
    ``form`` is the cache layout the backend keeps (``expanded`` or ``latent``); ``kv_dtype`` the
    cache's dtype when it differs from the compute ``dtype`` (an fp8 cache: scales not counted).
    """
    shape = load_shape(model)
    spec = load_gpu(gpu)
    layers = num_layers or shape.num_layers
    per_token = shape.kv_values_per_token_layer(form) * dtype_bytes(kv_dtype or dtype)  # type: ignore[arg-type]
    kv = float(layers * batch * (context + 1) * per_token)
    flops = attention_decode_flops(shape, batch=batch, context=context, form=form, num_layers=layers)
    peak = spec.flops.get(dtype, spec.flops[_HIGH]) * spec.achievable
    bw = spec.memory_bandwidth * spec.achievable
    return PhaseCost(
        weight_bytes=0.0, kv_bytes=kv, flops=flops, weight_s=0.0, kv_s=kv / bw, flop_s=flops / peak
    )


# --------------------------------------------------------------------------------------------------
# The estimate
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PhaseCost:
    """Bytes and FLOPs of one phase (a decode step, or the prefill) on one GPU, and its time."""

    weight_bytes: float
    kv_bytes: float
    flops: float
    weight_s: float
    kv_s: float
    flop_s: float

    @property
    def memory_s(self) -> float:
        return self.weight_s + self.kv_s

    @property
    def time_s(self) -> float:
        return max(self.memory_s, self.flop_s)

    @property
    def bound(self) -> str:
        return "compute" if self.flop_s > self.memory_s else "memory"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"memory_s": self.memory_s, "time_s": self.time_s, "bound": self.bound}


@dataclass(frozen=True)
class Estimate:
    """The estimate for one deployment; every byte and FLOP figure is per GPU."""

    model: str
    gpu: GPUSpec
    tp: int
    batch: int
    context: int
    prompt_len: int
    new_tokens: int
    kv_dtype: str
    weight_dtype: str
    moe: MoERouting | None
    step: PhaseCost  # the decode step at `context`
    prefill: PhaseCost
    itl_mean_s: float  # mean step time over the N generated tokens (contexts context .. context+N-1)
    crossover_tokens: float  # batch · (context + 1) at which KV reads equal weight reads, at this batch
    kv_bytes_per_token: int  # per GPU, over all layers
    memory_needed_bytes: float  # weights + KV for context + N tokens, per GPU (no activations)
    notes: list[str] = field(default_factory=list)

    @property
    def ttft_s(self) -> float:
        return self.prefill.time_s

    @property
    def itl_s(self) -> float:
        return self.step.time_s

    @property
    def e2e_s(self) -> float:
        return self.ttft_s + self.new_tokens * self.itl_mean_s

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput of the whole batch (tokens/s over all sequences) at the mean ITL."""
        return self.batch / self.itl_mean_s

    @property
    def tokens_per_s_per_sequence(self) -> float:
        return 1.0 / self.itl_mean_s

    @property
    def crossover_context(self) -> float:
        """The context at which, at this batch, KV reads overtake weight reads."""
        return self.crossover_tokens / self.batch - 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "gpu": asdict(self.gpu),
            "tp": self.tp,
            "batch": self.batch,
            "context": self.context,
            "prompt_len": self.prompt_len,
            "new_tokens": self.new_tokens,
            "kv_dtype": self.kv_dtype,
            "weight_dtype": self.weight_dtype,
            "moe_routing": asdict(self.moe) if self.moe else None,
            "per_gpu": True,
            "step": self.step.as_dict(),
            "prefill": self.prefill.as_dict(),
            "ttft_s": self.ttft_s,
            "itl_s": self.itl_s,
            "itl_mean_s": self.itl_mean_s,
            "e2e_s": self.e2e_s,
            "tokens_per_s": self.tokens_per_s,
            "tokens_per_s_per_sequence": self.tokens_per_s_per_sequence,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "crossover_tokens": self.crossover_tokens,
            "crossover_context": self.crossover_context,
            "memory_needed_bytes": self.memory_needed_bytes,
            "notes": list(self.notes),
        }


def _positive_int(value: Any, *, field: str, minimum: int = 1) -> int:
    if isinstance(value, str):  # "8k" → 8192, as on the command line
        from attnbench.workload import parse_tokens

        value = parse_tokens(value, field=field)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{field} = {value!r} must be an integer ≥ {minimum}")
    return value


def _choice(value: str, *, field: str, accepted: tuple[str, ...]) -> str:
    if value not in accepted:
        raise ValueError(f"{field} {value!r} not accepted; accepted: {', '.join(accepted)}")
    return value


def _mean_of_max_linear(a0: float, a1: float, b0: float, b1: float, lo: int, n: int) -> float:
    """Mean of ``max(a0 + a1·c, b0 + b1·c)`` over integers ``c = lo .. lo+n-1`` (exact)."""
    total = 0.0
    c = lo
    end = lo + n
    # the max of two lines switches at most once; find the switch and sum each linear piece exactly
    split = end
    if a1 != b1:
        x = (b0 - a0) / (a1 - b1)
        if lo < x < end:
            split = math.ceil(x)
    for start, stop in ((c, split), (split, end)):
        if stop <= start:
            continue
        mid = (start + stop - 1) / 2
        total += (stop - start) * max(a0 + a1 * mid, b0 + b1 * mid)
    return total / n


def estimate(
    model: str | ModelShape,
    *,
    gpu: str | GPUSpec,
    batch: int,
    context: int | str,
    new_tokens: int | str,
    tp: int = 1,
    prompt_len: int | str | None = None,
    kv_dtype: str = "bf16",
    weight_dtype: str = "bf16",
    achievable: float | None = None,
    moe: MoERouting | None = None,
) -> Estimate:
    """Estimate TTFT, ITL and end-to-end latency of generating ``new_tokens`` per sequence.

    ``context`` is the number of tokens cached when decoding starts (the breakdown is for the step
    at that context); ``prompt_len`` (default: ``context``) is how many of them the prefill computes
    — fewer means the rest was already cached (a shared prefix).
    """
    shape = load_shape(model)
    spec = load_gpu(gpu, achievable=achievable)
    batch = _positive_int(batch, field="--batch")
    context = _positive_int(context, field="--context")
    new_tokens = _positive_int(new_tokens, field="--new-tokens")
    prompt_len = context if prompt_len is None else _positive_int(prompt_len, field="--prompt-len")
    if prompt_len > context:
        raise ValueError(
            f"--prompt-len {prompt_len} must be ≤ --context {context} (the tokens cached when decoding starts)"
        )
    kv_dtype = _choice(kv_dtype, field="--kv-dtype", accepted=KV_DTYPES)
    weight_dtype = _choice(weight_dtype, field="--weight-dtype", accepted=WEIGHT_DTYPES)
    _check_tp(shape, tp)
    if moe is not None and shape.active_params is None:
        raise ValueError(f"MoE routing given, but {shape.name!r} is dense (no active_params)")

    bw = spec.memory_bandwidth * spec.achievable
    peak_w, w_used = spec.peak_flops(weight_dtype)
    peak_w *= spec.achievable
    peak_hi = spec.flops[_HIGH] * spec.achievable
    notes: list[str] = []
    if w_used != weight_dtype:
        notes.append(f"{spec.label} has no {weight_dtype} tensor cores: matmul FLOPs use the {w_used} peak")
    if not shape.is_mla and shape.num_kv_heads < tp:
        notes.append(f"{shape.num_kv_heads} KV heads < tp {tp}: each GPU holds 1 KV head (replicated)")
    if shape.is_mla and tp > 1:
        notes.append("MLA latent cache is one shared head: replicated on every GPU, not split by tp")
    if shape.active_params is not None and moe is None:
        notes.append(
            "MoE: decode reads only the activated parameters (exact at batch 1); larger batches touch more "
            "experts — pass the routing (--moe-experts/--moe-top-k) to model it"
        )

    emb = _embedding_params(shape)
    kv_tok = kv_bytes_per_token_per_gpu(shape, kv_dtype=kv_dtype, tp=tp)
    g_dec = shape.geometry("latent" if shape.is_mla else "expanded")
    g_pre = shape.geometry("expanded")
    heads = shape.num_heads / tp

    # -- decode step at context c: linear in c --------------------------------------------------
    w_bytes = weight_bytes_per_gpu(shape, weight_dtype=weight_dtype, batch=batch, tp=tp, moe=moe)
    active_block = shape.params_read_per_token - 2 * emb  # FLOPs follow the activated params per token
    mm_flop_s = 2.0 * batch * (active_block / peak_w + emb / peak_hi) / tp
    attn_per_ctx = (
        2.0 * shape.num_layers * batch * heads * (g_dec.qk_head_dim + g_dec.v_head_dim)
    )  # per token

    def step(c: int) -> PhaseCost:
        kv = batch * (c + 1) * kv_tok
        flops = 2.0 * batch * (active_block + emb) / tp + attn_per_ctx * (c + 1)
        return PhaseCost(
            weight_bytes=w_bytes,
            kv_bytes=kv,
            flops=flops,
            weight_s=w_bytes / bw,
            kv_s=kv / bw,
            flop_s=mm_flop_s + attn_per_ctx * (c + 1) / peak_hi,
        )

    # memory time = (w + batch·(c+1)·kv_tok)/bw ; flop time = mm + attn·(c+1)/peak
    itl_mean = _mean_of_max_linear(
        (w_bytes + batch * kv_tok) / bw,
        batch * kv_tok / bw,
        mm_flop_s + attn_per_ctx / peak_hi,
        attn_per_ctx / peak_hi,
        context,
        new_tokens,
    )

    # -- prefill: prompt_len tokens per sequence on top of (context - prompt_len) cached ---------
    tokens = batch * prompt_len
    if shape.active_params is not None and moe is None:
        pre_block = float(shape.num_params - 2 * emb)  # a long prompt touches every expert
    else:
        pre_block = _block_params(shape, tokens=tokens, moe=moe)
    pre_w = (
        pre_block * dtype_bytes(weight_dtype) + emb * dtype_bytes(_HIGH) + tokens * shape.hidden_size * 2
    ) / tp
    cached = context - prompt_len
    pre_kv = batch * (cached + prompt_len) * kv_tok  # read the cached prefix, write the prompt's K/V
    attended = prompt_len * (2 * cached + prompt_len + 1) / 2  # Σ over prompt positions of tokens attended
    pre_attn = 2.0 * shape.num_layers * batch * heads * (g_pre.qk_head_dim + g_pre.v_head_dim) * attended
    pre_mm = 2.0 * (tokens * active_block + batch * emb) / tp  # the LM head runs on each last token only
    prefill = PhaseCost(
        weight_bytes=pre_w,
        kv_bytes=pre_kv,
        flops=pre_mm + pre_attn,
        weight_s=pre_w / bw,
        kv_s=pre_kv / bw,
        flop_s=2.0 * (tokens * active_block / peak_w + batch * emb / peak_hi) / tp + pre_attn / peak_hi,
    )

    all_w = (
        (shape.num_params - 2 * emb) * dtype_bytes(weight_dtype) + 2 * emb * dtype_bytes(_HIGH)
    ) / tp  # every weight resides in memory, MoE experts included
    need = all_w + batch * (context + new_tokens) * kv_tok
    if need > spec.memory_bytes:
        notes.append(
            f"does not fit: weights + KV need {need / 1e9:.1f} GB per GPU, {spec.label} has "
            f"{spec.memory_bytes / 1e9:.0f} GB (raise --tp or lower batch/context)"
        )
    return Estimate(
        model=shape.name,
        gpu=spec,
        tp=tp,
        batch=batch,
        context=context,
        prompt_len=prompt_len,
        new_tokens=new_tokens,
        kv_dtype=kv_dtype,
        weight_dtype=weight_dtype,
        moe=moe,
        step=step(context),
        prefill=prefill,
        itl_mean_s=itl_mean,
        crossover_tokens=w_bytes / kv_tok,
        kv_bytes_per_token=kv_tok,
        memory_needed_bytes=need,
        notes=notes,
    )
