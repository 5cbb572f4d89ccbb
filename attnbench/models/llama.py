"""Dense Llama-family decoders (Llama, Mistral, Qwen2) with attention through an attnbench backend.

Grouped-query attention with RoPE (``default``, ``linear`` or Llama-3 ``llama3`` frequency scaling),
optional q/k/v biases (Qwen2) and o_proj/MLP biases (``attention_bias`` / ``mlp_bias``), RMSNorm,
gated MLP, tied or separate LM head. Refused with :class:`UnsupportedModelError`: other rope
scalings, partial rotary, quantised checkpoints, unknown activations, weights the decoder would not
use, and a sliding window shorter than the sequence (it would change the answer).

Example::

    model = LlamaDecoder.from_weights(config, state_dict, backend=registry.get("naive"), batch=1)
    model.setup(prompt_len=16, new_tokens=32)
    logits = model.prefill(input_ids)            # [1, 16] -> [1, V]
    logits = model.decode_step(logits.argmax(-1))
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from attnbench.backend import Backend, StepPlan
from attnbench.models.base import Decoder, RopeSpec, activation, apply_rope, config_field, open_weights
from attnbench.shapes import ModelShape

__all__ = ["LLAMA_FAMILY", "LlamaDecoder"]

#: ``model_type`` values this decoder implements.
LLAMA_FAMILY = ("llama", "mistral", "qwen2")


def _sliding_window(config: Mapping[str, Any], model_type: str) -> int | None:
    """The window a layer would use, or ``None`` when every layer attends to the full history."""
    window = config.get("sliding_window")
    if window is None:
        return None
    if model_type == "qwen2":
        layer_types = config.get("layer_types") or []
        if not config.get("use_sliding_window") and "sliding_attention" not in layer_types:
            return None
    return int(window)


class LlamaDecoder(Decoder):
    """A dense Llama-family decoder; see the module docstring for what is supported."""

    family = "llama"

    @classmethod
    def from_weights(
        cls,
        config: Mapping[str, Any],
        weights: Mapping[str, torch.Tensor],
        *,
        backend: Backend,
        backend_config: Mapping[str, Any] | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
        batch: int = 1,
        name: str | None = None,
    ) -> LlamaDecoder:
        """Build from a Hugging Face config dict and a transformers-named state dict.

        ``dtype`` defaults to the embedding weights' dtype. Raises :class:`UnsupportedModelError`
        naming the feature when the model cannot be run exactly.
        """
        model_type = config.get("model_type", "")
        model = name or f"{model_type or 'model'} checkpoint"
        w = open_weights(config, weights, family=LLAMA_FAMILY, model=model, dtype=dtype, device=device)

        hidden = int(config_field(config, "hidden_size", model=model))
        heads = int(config_field(config, "num_attention_heads", model=model))
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        layers = int(config_field(config, "num_hidden_layers", model=model))
        inter = int(config_field(config, "intermediate_size", model=model))
        vocab = int(config_field(config, "vocab_size", model=model))
        shape = ModelShape(
            name=model,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            hidden_size=hidden,
            intermediate_size=inter,
            vocab_size=vocab,
            num_params=w.num_params(),
            source=f"weights ({model_type})",
        )

        self = cls(
            backend=backend, backend_config=backend_config, dtype=w.dtype, device=w.device, batch=batch
        )
        self.shape = shape
        self.eps = float(config.get("rms_norm_eps", 1e-6))
        self.rope = RopeSpec.from_config(config, model=model)
        self.rope_dim = head_dim
        self.sliding_window = _sliding_window(config, model_type)
        act = activation(config.get("hidden_act", "silu"), model=model)

        self._load_embeddings(w, config)
        q_out, kv_out = heads * head_dim, kv_heads * head_dim
        for i in range(layers):
            p = f"model.layers.{i}."
            layer: dict[str, Any] = {"act": act}
            layer["input_norm"] = w.get(p + "input_layernorm.weight", shape=(hidden,))
            layer["post_norm"] = w.get(p + "post_attention_layernorm.weight", shape=(hidden,))
            for proj, out in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
                layer[proj] = w.get(f"{p}self_attn.{proj}.weight", shape=(out, hidden))
                layer[proj + "_bias"] = w.optional(f"{p}self_attn.{proj}.bias", shape=(out,))
            layer["o_proj"] = w.get(p + "self_attn.o_proj.weight", shape=(hidden, q_out))
            layer["o_proj_bias"] = w.optional(p + "self_attn.o_proj.bias", shape=(hidden,))
            for proj, dims in (
                ("gate_proj", (inter, hidden)),
                ("up_proj", (inter, hidden)),
                ("down_proj", (hidden, inter)),
            ):
                layer[proj] = w.get(f"{p}mlp.{proj}.weight", shape=dims)
                layer[proj + "_bias"] = w.optional(f"{p}mlp.{proj}.bias", shape=dims[:1])
            self.layers.append(layer)
        w.ignore(lambda n: n.endswith("rotary_emb.inv_freq"))  # old checkpoints saved the RoPE buffer
        w.check_all_used()
        return self

    def _attention(
        self,
        layer: dict[str, Any],
        index: int,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: StepPlan,
        *,
        decode: bool,
    ) -> torch.Tensor:
        b, t, _ = h.shape
        s = self.shape
        q = F.linear(h, layer["q_proj"], layer["q_proj_bias"]).view(b, t, s.num_heads, s.head_dim)
        k = F.linear(h, layer["k_proj"], layer["k_proj_bias"]).view(b, t, s.num_kv_heads, s.head_dim)
        v = F.linear(h, layer["v_proj"], layer["v_proj_bias"]).view(b, t, s.num_kv_heads, s.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self._attend(index, q, k, v, plan, decode=decode)  # [B, T, Hq, D]
        return F.linear(out.reshape(b, t, -1), layer["o_proj"], layer["o_proj_bias"])
