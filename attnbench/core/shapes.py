"""Model shapes: what attention sees of a model.

A :class:`ModelShape` holds the attention geometry (layers, heads, head dims, and for MLA models the
latent dims) plus the parameter count the latency estimator needs. Presets live in ``presets.yaml``;
:func:`load_shape` also reads a Hugging Face ``config.json`` or a YAML file of the preset form.

Example::

    >>> shape = load_shape("llama-3.1-8b")
    >>> shape.kv_bytes_per_token("bf16")
    131072
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import torch
import yaml

__all__ = [
    "AttentionGeometry",
    "KVForm",
    "ModelShape",
    "ShapeError",
    "dtype_bytes",
    "list_presets",
    "load_shape",
    "parse_dtype",
]

DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "fp8": torch.float8_e4m3fn,
}
_DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}
#: the form of a KV cache: per-head K/V, or MLA's absorbed latent (one shared KV head)
KVForm = Literal["expanded", "latent"]


class ShapeError(ValueError):
    """A model shape (preset, YAML or config.json) is malformed; the message names the field."""


def parse_dtype(value: str | torch.dtype, *, field: str = "dtype") -> torch.dtype:
    """``"bf16"`` → ``torch.bfloat16``; a clear error lists the accepted names."""
    if isinstance(value, torch.dtype):
        return value
    key = _DTYPE_ALIASES.get(str(value).lower(), str(value).lower())
    if key not in DTYPES:
        raise ValueError(f"{field} {value!r} is not a known dtype; accepted: {', '.join(DTYPES)}")
    return DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return next((name for name, dt in DTYPES.items() if dt == dtype), str(dtype).removeprefix("torch."))


def dtype_bytes(dtype: str | torch.dtype) -> int:
    return torch.empty((), dtype=parse_dtype(dtype)).element_size()


@dataclass(frozen=True)
class AttentionGeometry:
    """The tensors one attention call sees: ``q: [B, num_q_heads, qk_head_dim]``,
    ``k: [B, S, num_kv_heads, qk_head_dim]``, ``v: [B, S, num_kv_heads, v_head_dim]``."""

    num_q_heads: int
    num_kv_heads: int
    qk_head_dim: int
    v_head_dim: int
    scale: float

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads


_INT_FIELDS = (
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "hidden_size",
    "intermediate_size",
    "vocab_size",
    "num_params",
    "active_params",
)
_MLA_FIELDS = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
_OPTIONAL_INT = ("q_lora_rank", *_MLA_FIELDS)


@dataclass(frozen=True)
class ModelShape:
    """Attention-relevant shape of a decoder. MLA fields are all set or all ``None``."""

    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_params: int
    active_params: int | None = None
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    qk_nope_head_dim: int | None = None
    v_head_dim: int | None = None
    source: str = ""

    def __post_init__(self) -> None:
        self._validate()

    # -- validation -------------------------------------------------------------------------------
    def _fail(self, field: str, value: Any, rule: str) -> ShapeError:
        return ShapeError(f"model shape {self.name!r}: field '{field}' = {value!r}: {rule}")

    def _validate(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ShapeError(f"model shape: field 'name' = {self.name!r}: must be a non-empty string")
        for f in _INT_FIELDS + _OPTIONAL_INT:
            value = getattr(self, f)
            if value is None and (f in _OPTIONAL_INT or f == "active_params"):
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise self._fail(f, value, f"must be an integer, got {type(value).__name__}")
            if value <= 0:
                raise self._fail(f, value, "must be > 0")
        if self.num_heads % self.num_kv_heads:
            raise self._fail(
                "num_kv_heads",
                self.num_kv_heads,
                f"num_heads ({self.num_heads}) must be divisible by num_kv_heads",
            )
        mla = [f for f in _MLA_FIELDS if getattr(self, f) is not None]
        if mla and len(mla) != len(_MLA_FIELDS):
            missing = [f for f in _MLA_FIELDS if getattr(self, f) is None]
            raise self._fail(missing[0], None, f"MLA shapes need all of {', '.join(_MLA_FIELDS)}")
        if self.qk_nope_head_dim is not None and self.qk_rope_head_dim is not None:  # MLA
            want = self.qk_nope_head_dim + self.qk_rope_head_dim
            if self.head_dim != want:
                raise self._fail(
                    "head_dim",
                    self.head_dim,
                    f"for MLA must equal qk_nope_head_dim + qk_rope_head_dim ({want})",
                )
        if self.active_params is not None and self.active_params > self.num_params:
            raise self._fail("active_params", self.active_params, f"must be ≤ num_params ({self.num_params})")

    # -- derived ----------------------------------------------------------------------------------
    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def params_read_per_token(self) -> int:
        """Parameters a decode step reads at batch 1 (MoE: the activated ones)."""
        return self.active_params or self.num_params

    def geometry(self, form: KVForm = "expanded") -> AttentionGeometry:
        """The attention geometry a backend sees.

        ``expanded`` is per-head K/V (for MLA: decompressed ``nope+rope`` keys and ``v_head_dim``
        values, as transformers caches them). ``latent`` is MLA's absorbed form: one shared KV head
        of ``kv_lora_rank + qk_rope_head_dim`` for keys and ``kv_lora_rank`` for values.
        """
        if form == "latent":
            rank, rope = self.kv_lora_rank, self.qk_rope_head_dim  # both set or neither (__post_init__)
            if rank is None or rope is None:
                raise ValueError(f"model shape {self.name!r} is not MLA; the latent form needs kv_lora_rank")
            return AttentionGeometry(
                num_q_heads=self.num_heads,
                num_kv_heads=1,
                qk_head_dim=rank + rope,
                v_head_dim=rank,
                scale=1.0 / math.sqrt(self.head_dim),
            )
        if form != "expanded":
            raise ValueError(f"geometry form {form!r} not in ('expanded', 'latent')")
        return AttentionGeometry(
            num_q_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            qk_head_dim=self.head_dim,
            v_head_dim=self.head_dim if self.v_head_dim is None else self.v_head_dim,  # set for MLA only
            scale=1.0 / math.sqrt(self.head_dim),
        )

    def kv_values_per_token_layer(self, form: Literal["expanded", "latent", "auto"] = "auto") -> int:
        """Cached values per token per layer. ``auto``: latent for MLA, expanded otherwise."""
        if form == "auto":
            form = "latent" if self.is_mla else "expanded"
        g = self.geometry(form)
        if form == "latent":
            return g.qk_head_dim  # the value latent is a prefix of the key row; stored once
        return g.num_kv_heads * (g.qk_head_dim + g.v_head_dim)

    def kv_bytes_per_token(
        self, dtype: str | torch.dtype, form: Literal["expanded", "latent", "auto"] = "auto"
    ) -> int:
        """Exact KV-cache bytes per token over all layers (no scales; fp8 backends add theirs)."""
        return self.num_layers * self.kv_values_per_token_layer(form) * dtype_bytes(dtype)

    def weight_bytes(self, dtype: str | torch.dtype) -> int:
        """Bytes of weights a decode step reads at batch 1."""
        return self.params_read_per_token * dtype_bytes(dtype)

    def fields(self) -> dict[str, Any]:
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None
        }

    def fingerprint(self) -> str:
        """Short hash of every field but the name and source (tuning keys use name + this)."""
        body = {k: v for k, v in self.fields().items() if k not in ("name", "source")}
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:12]

    # -- construction -----------------------------------------------------------------------------
    @classmethod
    def attention_only(
        cls,
        name: str,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        num_layers: int = 2,
        source: str = "",
    ) -> ModelShape:
        """A test geometry: only the attention fields matter; the rest are filled plausibly."""
        hidden = num_heads * head_dim
        return cls(
            name=name,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            hidden_size=hidden,
            intermediate_size=4 * hidden,
            vocab_size=256,
            num_params=1_000_000,
            source=source or "attnbench test geometry",
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, name: str, origin: str = "") -> ModelShape:
        where = f" ({origin})" if origin else ""
        if not isinstance(data, dict):
            raise ShapeError(
                f"model shape {name!r}{where}: expected a mapping of fields, got {type(data).__name__}"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        for key in data:
            if key not in known:
                raise ShapeError(
                    f"model shape {name!r}{where}: unknown field {key!r}; accepted: {', '.join(sorted(known))}"
                )
        required = [
            f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING and f.name != "name"
        ]
        for key in required:
            if key not in data:
                raise ShapeError(f"model shape {name!r}{where}: field '{key}' is missing (required)")
        try:
            return cls(**{"name": name, **data})
        except ShapeError as err:
            raise ShapeError(f"{err}{where}") from None

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], *, name: str) -> ModelShape:
        """Read a Hugging Face ``config.json`` (Llama, Mistral, Qwen2, DeepSeek-V2/V3 families)."""

        def need(key: str, default: Any = None) -> Any:
            """``config[key]`` (or ``default`` when absent/null), which must be a positive integer."""
            value = config.get(key)
            if value is None:
                if default is None:
                    raise ShapeError(f"config.json {name!r}: field '{key}' is missing (required)")
                return default
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ShapeError(
                    f"config.json {name!r}: field '{key}' = {value!r}: must be a positive integer"
                )
            return value

        heads = need("num_attention_heads")
        hidden = need("hidden_size")
        data: dict[str, Any] = {
            "num_layers": need("num_hidden_layers"),
            "num_heads": heads,
            "num_kv_heads": need("num_key_value_heads", heads),
            "hidden_size": hidden,
            "intermediate_size": need("intermediate_size"),
            "vocab_size": need("vocab_size"),
            "source": f"config.json ({config.get('model_type', 'unknown model_type')})",
        }
        if config.get("kv_lora_rank"):
            for key in _MLA_FIELDS:
                data[key] = need(key)
            if config.get("q_lora_rank"):
                data["q_lora_rank"] = need("q_lora_rank")
            data["head_dim"] = data["qk_nope_head_dim"] + data["qk_rope_head_dim"]
        else:
            data["head_dim"] = need("head_dim", hidden // heads)
        total, active = _estimate_params(config, data)
        data["num_params"] = total
        if active != total:
            data["active_params"] = active
        return cls.from_dict(data, name=name, origin="config.json")


def _estimate_params(config: dict[str, Any], d: dict[str, Any]) -> tuple[int, int]:
    """Parameter count from a config (total, activated per token); used when no published count exists."""
    h, layers, vocab = d["hidden_size"], d["num_layers"], d["vocab_size"]
    if d.get("kv_lora_rank"):
        qk = d["qk_nope_head_dim"] + d["qk_rope_head_dim"]
        q_rank = d.get("q_lora_rank")
        q_proj = (h * q_rank + q_rank * d["num_heads"] * qk) if q_rank else h * d["num_heads"] * qk
        kv = h * (d["kv_lora_rank"] + d["qk_rope_head_dim"])
        kv += d["kv_lora_rank"] * d["num_heads"] * (d["qk_nope_head_dim"] + d["v_head_dim"])
        attn = q_proj + kv + d["num_heads"] * d["v_head_dim"] * h
    else:
        attn = (
            h * d["head_dim"] * (d["num_heads"] + 2 * d["num_kv_heads"]) + d["num_heads"] * d["head_dim"] * h
        )
    dense_mlp = 3 * h * d["intermediate_size"]
    experts = config.get("n_routed_experts")
    if experts:
        moe_i = config.get("moe_intermediate_size", d["intermediate_size"])
        first_dense = config.get("first_k_dense_replace", 0)
        shared = config.get("n_shared_experts", 0) or 0
        per_expert = 3 * h * moe_i
        moe_layers = layers - first_dense
        total_mlp = first_dense * dense_mlp + moe_layers * per_expert * (experts + shared)
        active_mlp = first_dense * dense_mlp + moe_layers * per_expert * (
            config.get("num_experts_per_tok", 1) + shared
        )
    else:
        total_mlp = active_mlp = layers * dense_mlp
    embed = vocab * h * (1 if config.get("tie_word_embeddings") else 2)
    base = embed + layers * attn
    return base + total_mlp, base + active_mlp


def _presets() -> dict[str, Any]:
    text = resources.files("attnbench.core").joinpath("presets.yaml").read_text()
    return yaml.safe_load(text)


def list_presets() -> list[str]:
    return list(_presets())


def load_shape(model: str | Path | ModelShape) -> ModelShape:
    """A preset name, a checkpoint directory or a path to its ``config.json``, or a YAML shape file.

    A YAML file holds either one shape's fields (its name is the file's stem) or a mapping of
    ``name: fields`` with exactly one entry.
    """
    if isinstance(model, ModelShape):
        return model
    text = str(model)
    presets = _presets()
    if text in presets:
        return ModelShape.from_dict(presets[text], name=text, origin="presets.yaml")
    path = Path(text)
    if not path.exists():
        raise ShapeError(
            f"model {text!r} is neither a preset nor an existing file; presets: {', '.join(presets)}"
        )
    if path.is_dir():  # a checkpoint directory: its config.json
        if not (path / "config.json").is_file():
            raise ShapeError(
                f"model {text!r}: directory has no config.json (expected a checkpoint: config.json + safetensors)"
            )
        path = path / "config.json"
    if path.suffix == ".json":
        try:
            config = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ShapeError(f"{path.name}: not valid JSON ({err})") from None
        name = path.parent.name if path.name == "config.json" else path.stem
        if not isinstance(config, dict):
            raise ShapeError(
                f"{path.name}: expected a JSON object of config fields, got {type(config).__name__}"
            )
        return ModelShape.from_hf_config(config, name=name or "model")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ShapeError(f"{path.name}: not valid YAML ({str(err).splitlines()[0]})") from None
    if isinstance(data, dict) and len(data) == 1 and isinstance(next(iter(data.values())), dict):
        ((name, fields),) = data.items()
        return ModelShape.from_dict(fields, name=str(name), origin=path.name)
    return ModelShape.from_dict(data, name=path.stem, origin=path.name)
