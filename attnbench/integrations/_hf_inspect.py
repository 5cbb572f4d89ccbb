"""What a transformers model's attention looks like, and what of it a backend cannot express.

:func:`inspect_attention` runs the model once on two tokens with a recording attention function
registered in transformers' ``AttentionInterface``: every layer's call shows its head counts, head
dims, softmax scale and the extra arguments it passes (``sliding_window``, ``softcap``, ``s_aux``,
``position_bias``, ``is_causal``). :func:`refusals` turns what cannot run exactly into reasons, each
naming the feature and the layer. Nothing here depends on one model family. :func:`attention_function`
is transformers' calling convention for an attention function, written once: the probe here and
attnbench's own attention function (``attnbench.integrations.transformers``) take an :class:`AttentionCall`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface

from attnbench.core.shapes import ModelShape
from attnbench.models.base import UnsupportedModelError

__all__ = [
    "AttentionCall",
    "LayerAttention",
    "attention_function",
    "inspect_attention",
    "model_name",
    "model_shape",
    "refusals",
    "static_refusals",
]

PROBE_IMPLEMENTATION = "attnbench_probe"


@dataclass(frozen=True)
class LayerAttention:
    """One layer's attention call as the probe saw it (``q [B, Hq, T, Dk]``, ``k [B, Hkv, S, Dk]``, ``v [..., Dv]``)."""

    layer_idx: int
    num_q_heads: int
    num_kv_heads: int
    qk_head_dim: int
    v_head_dim: int
    query_len: int
    key_len: int
    scaling: float
    causal: bool
    cross_attention: bool
    sliding_window: int | None
    softcap: float | None
    sinks: bool
    position_bias: bool


@dataclass(frozen=True)
class AttentionCall:
    """One call of transformers to a registered attention function: ``query [B, Hq, T, Dk]``,
    ``key [B, Hkv, S, Dk]``, ``value [B, Hkv, S, Dv]``, the mask, the softmax scale and dropout the
    module passed, and its other keyword arguments (``sliding_window``, ``softcap``, ``s_aux``, …)."""

    module: Any
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attention_mask: torch.Tensor | None
    scaling: float | None
    dropout: float
    options: dict[str, Any]


def attention_function(
    run: Callable[[AttentionCall], torch.Tensor],
) -> Callable[..., tuple[torch.Tensor, None]]:
    """``run`` (an :class:`AttentionCall` → the output ``[B, T, Hq, Dv]``) as the function transformers'
    ``AttentionInterface`` registers: its signature, and no attention weights returned."""

    def attention(
        module: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        return run(AttentionCall(module, query, key, value, attention_mask, scaling, dropout, kwargs)), None

    return attention


def model_name(model: Any) -> str:
    config = getattr(model, "config", None)
    return str(getattr(config, "name_or_path", "") or type(model).__name__)


def _text_config(model: Any) -> Any:
    config = model.config
    getter = getattr(config, "get_text_config", None)
    return getter(decoder=True) if callable(getter) else config


def static_refusals(model: Any) -> list[str]:
    """Features read from the config alone (before any forward): cross-attention, ALiBi, soft-capping, KV sharing."""
    config = model.config
    text = _text_config(model)
    reasons = []
    if getattr(config, "is_encoder_decoder", False) or getattr(text, "add_cross_attention", False):
        reasons.append(
            "cross-attention (an encoder-decoder or add_cross_attention model): every decoder layer"
        )
    alibi = bool(getattr(text, "alibi", False)) or getattr(text, "position_embedding_type", None) == "alibi"
    if alibi or getattr(text, "model_type", "") in ("bloom", "mpt"):
        reasons.append("ALiBi position biases: every layer")
    softcap = getattr(text, "attn_logit_softcapping", None)
    if softcap is not None:
        reasons.append(f"attention logit soft-capping (attn_logit_softcapping = {softcap}): every layer")
    shared = getattr(text, "num_kv_shared_layers", 0) or 0
    if shared:
        reasons.append(
            f"KV sharing between layers (num_kv_shared_layers = {shared}): the last {shared} layers"
        )
    return reasons


def _layer_windows(model: Any) -> dict[int, int]:
    """Sliding windows the config declares per layer (``layer_types`` or a model-wide ``sliding_window``)."""
    text = _text_config(model)
    window = getattr(text, "sliding_window", None)
    if not window:
        return {}
    layer_types = getattr(text, "layer_types", None)
    n = int(getattr(text, "num_hidden_layers", 0) or 0)
    if layer_types:
        return {i: int(window) for i, kind in enumerate(layer_types) if kind == "sliding_attention"}
    if getattr(text, "use_sliding_window", True) is False:
        return {}
    return dict.fromkeys(range(n), int(window))


def inspect_attention(model: Any) -> list[LayerAttention]:
    """Run ``model`` once on two tokens through a recording attention function; one entry per call."""

    seen: list[LayerAttention] = []

    def probe(call: AttentionCall) -> torch.Tensor:
        module, query, key, value, kwargs = call.module, call.query, call.key, call.value, call.options
        b, hq, t, dk = query.shape
        window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
        softcap = kwargs.get("softcap")
        if softcap is None:
            softcap = getattr(module, "attn_logit_softcapping", None)
        is_causal = kwargs.get("is_causal")
        index = getattr(module, "layer_idx", None)
        scaling = call.scaling
        seen.append(
            LayerAttention(
                layer_idx=-1 if index is None else int(index),
                num_q_heads=hq,
                num_kv_heads=int(key.shape[1]),
                qk_head_dim=dk,
                v_head_dim=int(value.shape[-1]),
                query_len=t,
                key_len=int(key.shape[2]),
                scaling=float(scaling if scaling is not None else getattr(module, "scaling", dk**-0.5)),
                causal=bool(getattr(module, "is_causal", True) if is_causal is None else is_causal),
                cross_attention=bool(getattr(module, "is_cross_attention", False)),
                sliding_window=int(window) if window else None,
                softcap=float(softcap) if softcap is not None else None,
                sinks=kwargs.get("s_aux") is not None or getattr(module, "sinks", None) is not None,
                position_bias=kwargs.get("position_bias") is not None,
            )
        )
        return torch.zeros(b, t, hq, value.shape[-1], dtype=query.dtype, device=query.device)

    AttentionInterface.register(PROBE_IMPLEMENTATION, attention_function(probe))
    before = model.config._attn_implementation
    try:
        model.set_attn_implementation(PROBE_IMPLEMENTATION)
        if model.config._attn_implementation != PROBE_IMPLEMENTATION:
            return []
        ids = torch.zeros(1, 2, dtype=torch.long, device=model.device)
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    finally:
        if model.config._attn_implementation != before:
            model.set_attn_implementation(before)
    return seen


def refusals(model: Any, layers: list[LayerAttention], *, max_seq_len: int) -> list[str]:
    """What of the recorded attention a backend cannot express for sequences of ``max_seq_len`` tokens."""
    text = _text_config(model)
    reasons: list[str] = []
    if not layers:
        return [
            f"{type(model).__name__} does not route attention through transformers' AttentionInterface "
            "(set_attn_implementation has no effect): every layer"
        ]
    declared = int(getattr(text, "num_hidden_layers", len(layers)) or len(layers))
    indices = [la.layer_idx for la in layers]
    if sorted(indices) != list(range(len(layers))) or len(layers) != declared:
        reasons.append(
            f"attention calls with layer_idx {indices} for {declared} layers (layers without softmax "
            "attention, or attention called more than once per layer): those layers"
        )
    windows = _layer_windows(model)
    first = layers[0]
    found: dict[str, list[int]] = {}  # feature -> the layers that have it

    def add(feature: str, layer: int) -> None:
        found.setdefault(feature, []).append(layer)

    for la in layers:
        i = la.layer_idx
        if not la.causal:
            add("non-causal (bidirectional) attention", i)
        if la.cross_attention or la.key_len != la.query_len:
            add("cross-attention (keys not from the layer's own tokens)", i)
        declared_windows = [w for w in (la.sliding_window, windows.get(i)) if w]
        window = min(declared_windows) if declared_windows else None
        if window is not None and window < max_seq_len:
            add(
                f"sliding-window attention (window {window} < the run's {max_seq_len} tokens; a window at "
                "least as long as the run equals full attention)",
                i,
            )
        if la.softcap is not None:
            add(f"attention logit soft-capping (softcap = {la.softcap})", i)
        if la.sinks:
            add("attention sinks (s_aux)", i)
        if la.position_bias:
            add("an additive position bias (ALiBi-style)", i)
        heads = (la.num_q_heads, la.num_kv_heads, la.qk_head_dim, la.v_head_dim)
        if heads != (first.num_q_heads, first.num_kv_heads, first.qk_head_dim, first.v_head_dim):
            add(
                f"per-layer different head counts (layer {first.layer_idx}: {first.num_q_heads} query / "
                f"{first.num_kv_heads} KV heads of {first.qk_head_dim}/{first.v_head_dim} dims; layer {i}: "
                f"{la.num_q_heads} / {la.num_kv_heads} of {la.qk_head_dim}/{la.v_head_dim})",
                i,
            )
        if la.num_q_heads % la.num_kv_heads:
            add(f"{la.num_q_heads} query heads not a multiple of {la.num_kv_heads} KV heads", i)
        if not math.isfinite(la.scaling) or la.scaling <= 0:
            add(f"softmax scale {la.scaling}", i)
    for feature, where in found.items():
        label = "layer" if len(where) == 1 else "layers"
        reasons.append(f"{feature}: {label} {', '.join(map(str, where))}")
    return reasons


def model_shape(model: Any, layers: list[LayerAttention], name: str) -> ModelShape:
    config = (
        model.config.get_text_config(decoder=True)
        if hasattr(model.config, "get_text_config")
        else model.config
    )
    first = layers[0]
    hidden = int(getattr(config, "hidden_size", 0) or first.num_q_heads * first.qk_head_dim)
    params: dict[int, int] = {}
    for p in model.parameters():
        params[p.data_ptr()] = p.numel()
    fields: dict[str, Any] = {}
    if first.qk_head_dim != first.v_head_dim:  # MLA (DeepSeek) in transformers' expanded form
        rope = getattr(config, "qk_rope_head_dim", None)
        rank = getattr(config, "kv_lora_rank", None)
        if not rope or not rank:
            raise UnsupportedModelError(
                f"{name}: key head dim {first.qk_head_dim} != value head dim {first.v_head_dim} outside MLA: every layer"
            )
        fields = {
            "kv_lora_rank": int(rank),
            "qk_rope_head_dim": int(rope),
            "qk_nope_head_dim": first.qk_head_dim - int(rope),
            "v_head_dim": first.v_head_dim,
            "q_lora_rank": getattr(config, "q_lora_rank", None) or None,
        }
    return ModelShape(
        name=name,
        num_layers=len(layers),
        num_heads=first.num_q_heads,
        num_kv_heads=first.num_kv_heads,
        head_dim=first.qk_head_dim,
        hidden_size=hidden,
        intermediate_size=int(getattr(config, "intermediate_size", 0) or 4 * hidden),
        vocab_size=int(getattr(config, "vocab_size", 0) or 1),
        num_params=sum(params.values()),
        source=f"transformers model ({getattr(config, 'model_type', type(model).__name__)})",
        **fields,
    )
