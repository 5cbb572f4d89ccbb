"""A real decoder's TTFT and ITL per generation path on this device, predicted from micro-measurements.

A *path* is how a Hugging Face decoder generates, named as ``attnbench e2e`` names it
(:func:`attnbench.measure.e2e.parse_path`): ``sdpa`` (transformers' SDPA with its ``DynamicCache``,
grown by ``torch.cat`` every step), ``sdpa-static`` (a ``StaticCache`` of ``max_cache_len`` slots,
attended through a mask), ``flash_attention_2`` (CUDA), or ``<backend>`` / ``<backend>[key=value,...]``
(attention through an attnbench backend via ``use_backend``, e.g. ``cpu_decode[page_size=32]``).

For ``L`` layers, batch ``B``, prompt ``T``, ``N`` new tokens and ``n`` tokens attended per step::

    TTFT = L · Σ t_lin(B·T rows) + t_head(B)              prefill_matmul_s
         + L · B · p2 · T²                                prefill_attention_s
         + s0 + L · (p0 + B · p1 · T)                     prefill_other_s
    ITL  = L · Σ t_lin(B rows) + t_head(B)                weights_s
         + L · b · n                                      kv_s     (n = T + N/2; sdpa-static: max_cache_len)
         + s0 + L · a                                     fixed_s  (s0, a, b fitted per batch)
    e2e  = TTFT + (N − 1) · ITL

What calibrates which term (:func:`attnbench.cost.generation_calibration.calibrate_generation`):

- ``t_lin``, ``t_head`` — each distinct linear layer of the model (in/out features, bias) timed alone
  with ``F.linear``: at ``B`` rows for every calibrated batch (decode; the weights cycled over copies
  worth twice the last-level cache, so they come from memory as in a step of the real model) and at
  :data:`PREFILL_ROWS` rows (prefill GEMMs, interpolated to ``B·T`` rows, per row beyond the largest);
  the LM head with the loop's ``argmax`` at ``B`` rows (logits of the last position only).
- ``s0, a, b`` and ``p0, p1, p2`` — the *frame*: the model's own transformers class at its widths, with
  every linear layer returning zeros from one shared buffer (no matmul runs). A step of it is all a
  step costs but the matmuls: the framework's Python, norms, RoPE, residuals, the mask, the cache
  update, the attention kernel, the attnbench integration and plan. Per path and batch, decode steps
  of a 1-layer frame at a short context and of a :data:`FRAME_LAYERS`-layer frame at
  :data:`DECODE_CONTEXTS` (caches filled through their own update API, the last-level cache evicted
  before each step) fit ``s0 + L·(a + b·n)``; one prompt per :data:`PREFILL_LENGTHS` at batch 1 fits
  ``p0 + p1·T + p2·T²`` per layer (``p2``: causal attention; the step part ``s0`` taken from decode).

Why the validation points are not the calibration points: nothing here runs the model being
predicted. Linear layers are timed alone; the frame has 1 or 3 layers and no matmul, at contexts and
prompt lengths other than the e2e runs' (128, 1k, 8k, 32k); prefill is measured at batch 1 only; the
per-layer terms are multiplied out to ``L`` layers and the quadratic and per-token terms extrapolated.
An e2e run that agrees therefore checks the decomposition, not a replay of itself.

Not modelled: sliding windows (frames attend to the whole context), MoE, tensor parallelism, CUDA
graphs and ``torch.compile``, left-padded batches; a per-step cost that grows with context (the static
mask) is counted per layer; prefill at batch ``B`` is ``B`` × batch 1 per token; batches between the
calibrated ones are interpolated, others refused; a larger batch or row count is never cheaper (times
are made non-decreasing in it). Measurements share the machine with whatever else runs: the record
keeps the load average. Needs transformers (imported on use).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any

import numpy as np
import torch

from attnbench.core.shapes import ModelShape, dtype_bytes
from attnbench.core.traffic import kv_bytes_per_step, shape_kv_bytes_per_token
from attnbench.measure.e2e import STOCK_PATHS

__all__ = [
    "DECODE_CONTEXTS", "FRAME_LAYERS", "PREFILL_LENGTHS", "PREFILL_ROWS", "DecodeFit", "FramePoint",
    "GenerationCalibration", "GenerationPrediction", "Linear", "LinearTime", "ModelCost",
    "PathCalibration", "PrefillFit", "predict_generation",
]  # fmt: skip

FORMAT = 1
#: Contexts of the frame's decode steps (tokens cached); the first also runs on the 1-layer frame.
DECODE_CONTEXTS = (64, 1536, 6144)
#: Prompt lengths of the frame's prefills (batch 1).
PREFILL_LENGTHS = (192, 640, 1536, 4096)
#: Rows at which the prefill GEMMs are timed (decode GEMVs: at each calibrated batch).
PREFILL_ROWS = (320, 1280)
#: Layers of the deeper frame (the other has one).
FRAME_LAYERS = 3

# model_type → (q/k/v bias, o bias, MLP bias, q/k norms), as transformers builds the layers
_LAYOUT: dict[str, Callable[[Callable[[str], Any]], tuple[bool, bool, bool, bool]]] = {
    "llama": lambda get: (bool(get("attention_bias")), bool(get("attention_bias")), bool(get("mlp_bias")), False),
    "mistral": lambda get: (False, False, False, False),
    "qwen2": lambda get: (True, False, False, False),
    "qwen3": lambda get: (bool(get("attention_bias")), bool(get("attention_bias")), False, True),
}  # fmt: skip
_POSITIVE = (
    "num_layers",
    "hidden_size",
    "intermediate_size",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "vocab_size",
)


def _fields(cls: type, data: Any, where: str) -> Mapping[str, Any]:
    """``data`` when it holds ``cls``'s fields; else an error naming the missing, the unknown, the accepted."""
    accepted = [f.name for f in fields(cls)]
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: expected a mapping of {', '.join(accepted)}; got {type(data).__name__}")
    unknown = sorted(set(data) - set(accepted))
    missing = [f.name for f in fields(cls) if f.name not in data and f.default is MISSING]
    if unknown or missing:
        raise ValueError(f"{where}: missing {missing}, unknown {unknown}; accepted: {', '.join(accepted)}")
    return data


@dataclass(frozen=True)
class Linear:
    """One linear layer: ``x [rows, in_features]`` → ``[rows, out_features]`` (+ bias)."""

    name: str
    in_features: int
    out_features: int
    bias: bool

    @property
    def params(self) -> int:
        return self.in_features * self.out_features + (self.out_features if self.bias else 0)


@dataclass(frozen=True)
class ModelCost:
    """What the cost model needs of a Llama/Mistral/Qwen2/Qwen3-style decoder (dense, RMSNorm, SwiGLU)."""

    name: str
    model_type: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False

    def __post_init__(self) -> None:
        if self.model_type not in _LAYOUT:
            raise ValueError(
                f"model cost {self.name!r}: field 'model_type' = {self.model_type!r}; accepted: {', '.join(_LAYOUT)}"
            )
        for f in _POSITIVE:
            value = getattr(self, f)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"model cost {self.name!r}: field {f!r} = {value!r} must be an integer > 0")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model cost {self.name!r}: field 'num_kv_heads' = {self.num_kv_heads} must divide num_heads {self.num_heads}"
            )

    @classmethod
    def from_hf_config(cls, config: Any, *, name: str | None = None) -> ModelCost:
        """From a transformers config (or a ``config.json`` mapping): tied or untied embeddings, biases."""
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config

        def get(key: str) -> Any:
            return text.get(key) if isinstance(text, Mapping) else getattr(text, key, None)

        model_type, heads, hidden = str(get("model_type")), get("num_attention_heads"), get("hidden_size")
        qkv, o, mlp, qk_norm = _LAYOUT.get(model_type, _LAYOUT["mistral"])(get)  # unknown: refused below
        return cls(
            name=name or str(get("name_or_path") or get("_name_or_path") or model_type), model_type=model_type,
            num_layers=get("num_hidden_layers"), hidden_size=hidden, intermediate_size=get("intermediate_size"),
            num_heads=heads, num_kv_heads=get("num_key_value_heads") or heads,
            head_dim=get("head_dim") or (hidden // heads if heads and hidden else 0),
            vocab_size=get("vocab_size"), tie_word_embeddings=bool(get("tie_word_embeddings")),
            qkv_bias=qkv, o_bias=o, mlp_bias=mlp, qk_norm=qk_norm,
        )  # fmt: skip

    def layer_linears(self) -> tuple[Linear, ...]:
        """The linear layers of one decoder layer, in call order."""
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return (
            Linear("q_proj", h, q, self.qkv_bias), Linear("k_proj", h, kv, self.qkv_bias),
            Linear("v_proj", h, kv, self.qkv_bias), Linear("o_proj", q, h, self.o_bias),
            Linear("gate_proj", h, i, self.mlp_bias), Linear("up_proj", h, i, self.mlp_bias),
            Linear("down_proj", i, h, self.mlp_bias),
        )  # fmt: skip

    @property
    def lm_head(self) -> Linear:
        return Linear("lm_head", self.hidden_size, self.vocab_size, False)

    @property
    def num_params(self) -> int:
        """Parameters as ``sum(p.numel() for p in model.parameters())`` counts them (tied: once)."""
        norms = 2 * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)
        layer = sum(x.params for x in self.layer_linears()) + norms
        embed = self.vocab_size * self.hidden_size
        return self.num_layers * layer + embed * (1 if self.tie_word_embeddings else 2) + self.hidden_size

    def weight_bytes(self, dtype: str | torch.dtype) -> int:
        """Weight bytes a decode step reads: every layer, the final norm, the LM head (the embedding
        matrix when tied); not the ``B`` rows of the input embedding it looks up."""
        unread = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return (self.num_params - unread) * dtype_bytes(dtype)

    def shape(self) -> ModelShape:
        """The attention shape, for :mod:`attnbench.core.traffic`."""
        return ModelShape(
            name=self.name, num_layers=self.num_layers, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size, num_params=self.num_params, source="ModelCost",
        )  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelCost:
        return cls(**_fields(cls, data, "model cost"))


@dataclass(frozen=True)
class LinearTime:
    """``F.linear`` at one linear layer's shape and ``rows`` rows: ``seconds`` a call (median)."""

    name: str
    in_features: int
    out_features: int
    bias: bool
    rows: int
    seconds: float


@dataclass(frozen=True)
class FramePoint:
    """One frame measurement: a decode step (``tokens`` attended per sequence, mean of the timed steps)
    or a prompt of ``tokens`` tokens, through ``layers`` layers at ``batch``."""

    phase: str
    batch: int
    layers: int
    tokens: float
    seconds: float


@dataclass(frozen=True)
class DecodeFit:
    """The frame's decode step at ``batch``: ``step_s + layers · (layer_s + token_s · n)``."""

    batch: int
    step_s: float
    layer_s: float
    token_s: float
    rms_rel_error: float


@dataclass(frozen=True)
class PrefillFit:
    """The frame's prompt, per layer and sequence: ``layer_s + token_s · T + token2_s · T²``."""

    layer_s: float
    token_s: float
    token2_s: float
    rms_rel_error: float


def _rising(values: Sequence[float]) -> list[float]:
    """The running maximum: a larger batch or row count never costs less than a smaller one."""
    return [float(v) for v in np.maximum.accumulate(np.asarray(values, dtype=float))]


@dataclass(frozen=True)
class PathCalibration:
    """One path's frame: the fits, the points behind them, and what ran (``implementation``)."""

    path: str
    implementation: str
    decode: tuple[DecodeFit, ...]
    prefill: PrefillFit
    points: tuple[FramePoint, ...]

    def decode_at(self, batch: int) -> DecodeFit:
        """The decode fit at ``batch``, interpolated between calibrated batches (outside them: refused)."""
        fits = sorted(self.decode, key=lambda f: f.batch)
        xs = [f.batch for f in fits]
        if not xs[0] <= batch <= xs[-1]:
            raise ValueError(
                f"path {self.path!r}: batch {batch} is outside the calibrated batches {xs}; calibrate with it"
            )
        step, layer, token = (
            float(np.interp(batch, xs, _rising([getattr(f, k) for f in fits])))
            for k in ("step_s", "layer_s", "token_s")
        )
        return DecodeFit(batch, step, layer, token, max(f.rms_rel_error for f in fits))


@dataclass(frozen=True)
class GenerationCalibration:
    """Measured on one device for one model's widths, dtype and thread count (any number of layers)."""

    model: ModelCost
    dtype: str
    device: str
    fingerprint: dict[str, Any]
    linears: tuple[LinearTime, ...]
    paths: tuple[PathCalibration, ...]
    measured_at: str = ""
    load_avg: tuple[float, ...] = ()
    seconds: float = 0.0

    def path(self, path: str) -> PathCalibration:
        key = path.strip()
        for p in self.paths:
            if p.path == key:
                return p
        raise ValueError(
            f"path {key!r} was not calibrated; calibrated: {', '.join(p.path for p in self.paths)}"
        )

    def linear_s(self, layer: Linear, rows: float) -> float:
        """Seconds of ``layer`` at ``rows`` rows: interpolated between measured rows, per row beyond."""
        pts = sorted(
            (t.rows, t.seconds) for t in self.linears
            if (t.in_features, t.out_features, t.bias) == (layer.in_features, layer.out_features, layer.bias)
        )  # fmt: skip
        if not pts:
            raise ValueError(
                f"no timing of {layer.name} ({layer.in_features}→{layer.out_features}) in the calibration"
            )
        xs, ys = [float(r) for r, _ in pts], _rising([s for _, s in pts])
        return ys[-1] * rows / xs[-1] if rows > xs[-1] else float(np.interp(rows, xs, ys))

    def check(self, model: ModelCost) -> None:
        """Refuse a model whose widths differ from the calibrated ones (the layer count may differ)."""
        for f in fields(ModelCost):
            if f.name in ("name", "num_layers", "tie_word_embeddings"):
                continue
            mine, theirs = getattr(self.model, f.name), getattr(model, f.name)
            if mine != theirs:
                raise ValueError(
                    f"calibration was measured for {f.name} = {mine!r}; model {model.name!r} has {theirs!r}: "
                    "calibrate this model's widths"
                )

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, **asdict(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GenerationCalibration:
        """Inverse of :meth:`to_dict`; a wrong field raises ``ValueError`` naming it and the accepted ones."""
        if not isinstance(data, Mapping) or data.get("format") != FORMAT:
            got = data.get("format") if isinstance(data, Mapping) else type(data).__name__
            raise ValueError(f"generation calibration: field 'format' = {got!r}; accepted: {FORMAT}")
        where = "generation calibration"
        d = _fields(cls, {k: v for k, v in data.items() if k != "format"}, where)
        paths = []
        for i, raw in enumerate(d["paths"]):
            at = f"{where}: paths[{i}]"
            p = _fields(PathCalibration, raw, at)
            paths.append(PathCalibration(
                p["path"], p["implementation"],
                tuple(DecodeFit(**_fields(DecodeFit, f, f"{at}.decode")) for f in p["decode"]),
                PrefillFit(**_fields(PrefillFit, p["prefill"], f"{at}.prefill")),
                tuple(FramePoint(**_fields(FramePoint, x, f"{at}.points")) for x in p["points"]),
            ))  # fmt: skip
        return cls(
            ModelCost.from_dict(d["model"]), str(d["dtype"]), str(d["device"]), dict(d["fingerprint"]),
            tuple(LinearTime(**_fields(LinearTime, t, f"{where}: linears")) for t in d["linears"]),
            tuple(paths), str(d.get("measured_at", "")), tuple(d.get("load_avg") or ()), float(d.get("seconds", 0.0)),
        )  # fmt: skip


@dataclass(frozen=True)
class GenerationPrediction:
    """Predicted TTFT, ITL (at the mean attended length) and e2e of one path, with their parts."""

    path: str
    batch: int
    prompt_len: int
    new_tokens: int
    ttft_s: float
    itl_s: float
    e2e_s: float
    prefill_matmul_s: float  # every linear layer at B·T rows, and the LM head at B rows
    prefill_attention_s: float  # the causal attention's T² term
    prefill_other_s: float  # the framework, norms, RoPE, cache writes: per step, per layer, per token
    weights_s: float  # decode: every linear layer and the LM head at B rows
    kv_s: float  # decode: the attention's cost that grows with the tokens attended
    fixed_s: float  # decode: the rest of a step (framework, small ops, attention at no context)
    weight_bytes: int  # read by a decode step
    kv_bytes: float  # read by a decode step at the mean attended length (the cache's payload)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def predict_generation(
    model: ModelCost,
    calibration: GenerationCalibration,
    *,
    path: str,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    max_cache_len: int | None = None,
) -> GenerationPrediction:
    """TTFT, ITL and e2e of ``model`` generating ``new_tokens`` after a ``prompt_len`` prompt through
    ``path`` (``max_cache_len``: the static cache's length, default ``prompt_len + new_tokens``)."""
    for name, value in (("batch", batch), ("prompt_len", prompt_len), ("new_tokens", new_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"predict_generation: {name} = {value!r} must be an integer ≥ 1")
    cache_len = prompt_len + new_tokens if max_cache_len is None else max_cache_len
    if cache_len < prompt_len + new_tokens:
        raise ValueError(f"predict_generation: max_cache_len = {max_cache_len} < prompt_len + new_tokens")
    calibration.check(model)
    cal = calibration.path(path)
    dec, pre, layers = cal.decode_at(batch), cal.prefill, model.num_layers

    def linears(rows: float) -> float:
        return layers * sum(calibration.linear_s(x, rows) for x in model.layer_linears())

    head = calibration.linear_s(model.lm_head, batch)
    static = STOCK_PATHS.get(cal.path, ("", ""))[1] == "static"
    attended = cache_len if static else prompt_len + new_tokens / 2
    prefill_matmul = linears(batch * prompt_len) + head
    prefill_attention = layers * batch * pre.token2_s * prompt_len**2
    prefill_other = dec.step_s + layers * (pre.layer_s + batch * pre.token_s * prompt_len)
    weights, kv = linears(batch) + head, layers * dec.token_s * attended
    fixed = dec.step_s + layers * dec.layer_s
    ttft, itl = prefill_matmul + prefill_attention + prefill_other, weights + kv + fixed
    kv_tokens = batch * (prompt_len + new_tokens / 2)
    return GenerationPrediction(
        path=cal.path, batch=batch, prompt_len=prompt_len, new_tokens=new_tokens, ttft_s=ttft, itl_s=itl,
        e2e_s=ttft + (new_tokens - 1) * itl, prefill_matmul_s=prefill_matmul, prefill_attention_s=prefill_attention,
        prefill_other_s=prefill_other, weights_s=weights, kv_s=kv, fixed_s=fixed,
        weight_bytes=model.weight_bytes(calibration.dtype),
        kv_bytes=kv_bytes_per_step(shape_kv_bytes_per_token(model.shape(), dtype=calibration.dtype), tokens=kv_tokens),
    )  # fmt: skip
