"""A DeepSeek-V3-style MLA decoder (all-dense layers) in the absorbed latent form, attention through a backend.

Multi-head latent attention, as transformers' ``DeepseekV3Attention`` computes it: the query comes
from ``q_proj`` (or the low-rank ``q_a_proj → RMSNorm → q_b_proj``), split into ``q_nope`` and
``q_pe``; the hidden state is compressed to a latent ``c = RMSNorm(kv_a_proj[:kv_lora_rank])`` plus one
shared RoPE key ``k_pe``. RoPE is interleaved or not (``rope_interleave``). The cache holds the
latent (backends with ``kv_form = "latent"``, e.g. ``mla``): absorbed, ``q = [q_nope @ W_UK | q_pe]`` per
head, one shared KV head ``k = [c | k_pe]``, ``v = c``; the output latent is projected by ``W_UV`` per
head, then ``o_proj``. transformers' own module cannot express this form (it decompresses the latent
to per-head K/V before attention), which is why this decoder exists; the expanded form runs through
transformers' module itself with :func:`attnbench.integrations.transformers.use_backend`.

The softmax scale is the model's ``1 / sqrt(qk_nope + qk_rope)``. Refused with
:class:`UnsupportedModelError`: MoE layers (``first_k_dense_replace < num_hidden_layers``), yarn and
other rope scalings, an mscale that changes the softmax scale, ``num_key_value_heads != num_attention_heads``,
and backends with the expanded cache form.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from attnbench.core.backend import Backend
from attnbench.core.shapes import ModelShape, ShapeError
from attnbench.models.base import (
    Decoder,
    LayerInputs,
    RopeSpec,
    UnsupportedModelError,
    activation,
    apply_rope,
    config_field,
    open_weights,
    rms_norm,
)
from attnbench.models.mla import expand_output, latent_query, split_kv_b

__all__ = ["DEEPSEEK_FAMILY", "DeepseekDecoder"]

#: ``model_type`` values this decoder implements.
DEEPSEEK_FAMILY = ("deepseek_v3",)


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class DeepseekDecoder(Decoder):
    """DeepSeek-V3 MLA decoder with dense MLPs only; see the module docstring."""

    family = "deepseek"
    interleaved: bool  # rope_interleave: RoPE pairs dims (0, 1), (2, 3), ...

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
    ) -> DeepseekDecoder:
        """Build from a Hugging Face config dict and a transformers-named state dict."""
        model_type = config.get("model_type", "")
        model = name or f"{model_type or 'model'} checkpoint"
        w = open_weights(config, weights, family=DEEPSEEK_FAMILY, model=model, dtype=dtype, device=device)
        layers = int(config_field(config, "num_hidden_layers", model=model))
        dense = int(config.get("first_k_dense_replace", 3) or 0)  # 3: transformers' default
        if dense < layers:  # as transformers builds it: layer i >= first_k_dense_replace is MoE
            raise UnsupportedModelError(
                f"{model}: MoE layers are not supported: layers {dense}..{layers - 1} of {layers} are "
                f"mixture-of-experts (first_k_dense_replace = {dense}); only all-dense models "
                "(first_k_dense_replace = num_hidden_layers) run"
            )
        rope = RopeSpec.from_config(config, model=model)
        nope = int(config_field(config, "qk_nope_head_dim", model=model))
        rope_dim = int(config_field(config, "qk_rope_head_dim", model=model))
        qk_dim = nope + rope_dim
        model_scale = qk_dim**-0.5
        if rope.kind != "default" and rope.mscale_all_dim:
            model_scale *= _yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
        if not math.isclose(model_scale, qk_dim**-0.5, rel_tol=1e-12):
            raise UnsupportedModelError(
                f"{model}: rope scaling mscale (mscale_all_dim = {rope.mscale_all_dim}, factor = {rope.factor}) "
                f"makes the softmax scale {model_scale:.6g}; attnbench's geometry uses 1/sqrt({qk_dim}) = "
                f"{qk_dim**-0.5:.6g}"
            )
        heads = int(config_field(config, "num_attention_heads", model=model))
        kv_heads = int(config.get("num_key_value_heads") or heads)
        if kv_heads != heads:
            raise UnsupportedModelError(
                f"{model}: num_key_value_heads = {kv_heads} != num_attention_heads = {heads}; MLA expands the "
                "latent to one K/V per query head"
            )
        try:  # the one reader of Hugging Face configs (as for --model config.json); the count from the weights
            shape = ModelShape.from_hf_config(dict(config), name=model)
        except ShapeError as err:
            raise UnsupportedModelError(str(err)) from None
        if not shape.is_mla:
            raise UnsupportedModelError(f"{model}: config field 'kv_lora_rank' is missing (required)")
        shape = dataclasses.replace(
            shape, num_params=w.num_params(), active_params=None, source=f"weights ({model_type})"
        )
        hidden, inter, q_rank = shape.hidden_size, shape.intermediate_size, shape.q_lora_rank
        rank, v_dim = shape.kv_lora_rank, shape.v_head_dim
        assert rank is not None and v_dim is not None

        self = cls(
            backend=backend, backend_config=backend_config, dtype=w.dtype, device=w.device, batch=batch
        )
        self.shape = shape
        self.eps = float(config.get("rms_norm_eps", 1e-6))
        self.rope = rope
        self.rope_dim = rope_dim
        self.interleaved = bool(config.get("rope_interleave", True))
        act = activation(config.get("hidden_act", "silu"), model=model)

        self._load_embeddings(w, config)
        for i in range(layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            layer: dict[str, Any] = {"act": act}
            layer["input_norm"] = w.get(p + "input_layernorm.weight", shape=(hidden,))
            layer["post_norm"] = w.get(p + "post_attention_layernorm.weight", shape=(hidden,))
            if q_rank:
                layer["q_a_proj"] = w.get(a + "q_a_proj.weight", shape=(q_rank, hidden))
                layer["q_a_proj_bias"] = w.optional(a + "q_a_proj.bias", shape=(q_rank,))
                layer["q_a_norm"] = w.get(a + "q_a_layernorm.weight", shape=(q_rank,))
                layer["q_b_proj"] = w.get(a + "q_b_proj.weight", shape=(heads * qk_dim, q_rank))
            else:
                layer["q_proj"] = w.get(a + "q_proj.weight", shape=(heads * qk_dim, hidden))
            layer["kv_a_proj"] = w.get(a + "kv_a_proj_with_mqa.weight", shape=(rank + rope_dim, hidden))
            layer["kv_a_proj_bias"] = w.optional(a + "kv_a_proj_with_mqa.bias", shape=(rank + rope_dim,))
            layer["kv_a_norm"] = w.get(a + "kv_a_layernorm.weight", shape=(rank,))
            kv_b = w.get(a + "kv_b_proj.weight", shape=(heads * (nope + v_dim), rank))
            w_uk, w_uv = split_kv_b(kv_b, num_heads=heads, qk_nope_head_dim=nope, v_head_dim=v_dim)
            layer["w_uk"] = w_uk.contiguous()  # [H, nope, rank]: absorbed into the query
            layer["w_uv"] = w_uv.contiguous()  # [H, v_dim, rank]: applied to the output latent
            layer["o_proj"] = w.get(a + "o_proj.weight", shape=(hidden, heads * v_dim))
            layer["o_proj_bias"] = w.optional(a + "o_proj.bias", shape=(hidden,))
            for proj, dims in (
                ("gate_proj", (inter, hidden)),
                ("up_proj", (inter, hidden)),
                ("down_proj", (hidden, inter)),
            ):
                layer[proj] = w.get(f"{p}mlp.{proj}.weight", shape=dims)
            self.layers.append(layer)
        # multi-token-prediction modules are stored as extra layers past num_hidden_layers; plain decoding skips them
        w.ignore(lambda n: n.startswith("model.layers.") and int(n.split(".")[2]) >= layers)
        w.ignore(lambda n: n.endswith("rotary_emb.inv_freq"))
        w.check_all_used()
        return self

    def unsupported(self, *, batch: int | None = None, max_seq_len: int) -> list[str]:
        if self.backend.kv_form != "latent":
            return [
                f"backend {self.backend.name!r} keeps the expanded per-head cache; this decoder runs DeepSeek's "
                "absorbed latent form only (latent backends, e.g. 'mla'); run the expanded form through "
                "transformers' own module with attnbench.integrations.transformers.use_backend"
            ]
        return super().unsupported(batch=batch, max_seq_len=max_seq_len)

    def _attention(
        self, layer: dict[str, Any], index: int, h: torch.Tensor, step: LayerInputs
    ) -> torch.Tensor:
        b, t, _ = h.shape
        s = self.shape
        heads, nope, rank = s.num_heads, s.qk_nope_head_dim, s.kv_lora_rank
        assert nope is not None and rank is not None and s.v_head_dim is not None
        if "q_proj" in layer:
            q = F.linear(h, layer["q_proj"])
        else:
            qa = F.linear(h, layer["q_a_proj"], layer["q_a_proj_bias"])
            q = F.linear(rms_norm(qa, layer["q_a_norm"], self.eps), layer["q_b_proj"])
        q = q.view(b, t, heads, s.head_dim)
        q_nope, q_pe = q[..., :nope], q[..., nope:]
        ckv = F.linear(h, layer["kv_a_proj"], layer["kv_a_proj_bias"])  # [B, T, rank + rope]
        c = rms_norm(ckv[..., :rank], layer["kv_a_norm"], self.eps)  # [B, T, rank]
        k_pe = ckv[..., rank:].view(b, t, 1, self.rope_dim)
        q_pe = apply_rope(q_pe, step.cos, step.sin, interleaved=self.interleaved)
        k_pe = apply_rope(k_pe, step.cos, step.sin, interleaved=self.interleaved)

        q = latent_query(q_nope, q_pe, layer["w_uk"])  # [B, T, H, rank + rope]
        k = torch.cat((c[:, :, None], k_pe), dim=-1)  # [B, T, 1, rank + rope]
        out_lat = self._attend(index, q, k, k[..., :rank], step)  # [B, T, H, rank]
        out = expand_output(out_lat, layer["w_uv"])  # [B, T, H, v_dim]
        return F.linear(out.reshape(b, t, -1), layer["o_proj"], layer["o_proj_bias"])
