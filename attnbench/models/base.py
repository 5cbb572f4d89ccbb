"""What every real decoder shares: weights, RMSNorm, RoPE, the MLP, the backend-owned KV cache.

A real decoder computes embeddings, norms, RoPE, projections, the MLP and the LM head in plain
torch from loaded weights, and hands attention to an attnbench :class:`~attnbench.Backend`; the
backend owns the KV cache. Subclasses (:mod:`attnbench.models.deepseek`) implement one layer's
attention around the backend call.

A decoder is a :class:`attnbench.measure.decode.DecodeModel`, so :func:`attnbench.measure.decode.generate` drives
and times it (gpt-fast shaped)::

    model.setup(prompt_len, new_tokens)          # allocates the cache and the RoPE table (batch = model.batch)
    logits = model.prefill(input_ids)            # [B, T] -> [B, V] at the last prompt position; empties the cache
    logits = model.decode_step(next_ids)         # [B] -> [B, V], one token per sequence
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from attnbench.core.backend import Backend, KVCache, StepPlan
from attnbench.core.shapes import ModelShape
from attnbench.core.workload import Workload

__all__ = [
    "Decoder",
    "LayerInputs",
    "RopeSpec",
    "UnsupportedModelError",
    "Weights",
    "config_field",
    "open_weights",
    "rms_norm",
]


class UnsupportedModelError(ValueError):
    """A model, or one of its features, that attnbench's real decoders do not implement.

    Raised instead of running a model whose results would silently differ from the original.
    """


_ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def activation(name: str, *, model: str) -> Any:
    if name not in _ACTIVATIONS:
        raise UnsupportedModelError(
            f"{model}: hidden_act {name!r} is not supported; supported: {', '.join(_ACTIVATIONS)}"
        )
    return _ACTIVATIONS[name]


def config_field(config: Mapping[str, Any], key: str, *, model: str) -> Any:
    """``config[key]``, or an error naming the missing field."""
    if config.get(key) is None:
        raise UnsupportedModelError(f"{model}: config field {key!r} is missing (required)")
    return config[key]


def open_weights(
    config: Mapping[str, Any],
    weights: Mapping[str, torch.Tensor],
    *,
    family: tuple[str, ...],
    model: str,
    dtype: torch.dtype | None,
    device: torch.device | str,
) -> Weights:
    """Check the config's ``model_type`` against ``family`` and refuse quantised checkpoints; wrap the
    weights in ``dtype`` (default: the embedding's) on ``device``."""
    model_type = config.get("model_type", "")
    if model_type not in family:
        raise UnsupportedModelError(
            f"{model}: model_type {model_type!r} is not supported by this decoder; supported: {', '.join(family)}"
        )
    if config.get("quantization_config"):
        raise UnsupportedModelError(f"{model}: quantized checkpoints (quantization_config) are not supported")
    emb = weights.get("model.embed_tokens.weight")
    if emb is None:
        raise UnsupportedModelError(
            f"{model}: weight 'model.embed_tokens.weight' is missing from the checkpoint"
        )
    return Weights(weights, model=model, dtype=dtype or emb.dtype, device=torch.device(device))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as transformers computes it: statistics in fp32, scale in the input dtype."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding parameters: ``default``, ``linear`` or ``llama3`` frequency scaling.

    Read from a config's ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling``
    (older config.json files). Any other scaling (yarn, dynamic, longrope, ...) is refused.
    """

    theta: float
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    mscale_all_dim: float = 0.0

    SUPPORTED: ClassVar[tuple[str, ...]] = ("default", "linear", "llama3")

    @classmethod
    def from_config(cls, config: Mapping[str, Any], *, model: str) -> RopeSpec:
        params = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if not isinstance(params, Mapping) or any(isinstance(v, Mapping) for v in params.values()):
            raise UnsupportedModelError(f"{model}: per-layer-type rope_parameters are not supported")
        theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in cls.SUPPORTED:
            raise UnsupportedModelError(
                f"{model}: rope scaling type {kind!r} is not supported; supported: {', '.join(cls.SUPPORTED)}"
            )
        partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor")) or 1.0
        if partial != 1.0:
            raise UnsupportedModelError(
                f"{model}: partial_rotary_factor = {partial} is not supported (only 1.0)"
            )

        def field(key: str) -> float:
            if params.get(key) is None:
                raise UnsupportedModelError(f"{model}: {kind} rope scaling needs field {key!r}")
            return float(params[key])

        extra: dict[str, Any] = {}
        if kind in ("linear", "llama3"):
            extra["factor"] = field("factor")
        if kind == "llama3":
            extra["low_freq_factor"] = field("low_freq_factor")
            extra["high_freq_factor"] = field("high_freq_factor")
            extra["original_max_position_embeddings"] = int(field("original_max_position_embeddings"))
        mscale_all_dim = float(params.get("mscale_all_dim") or 0.0)
        return cls(theta=float(theta), kind=kind, mscale_all_dim=mscale_all_dim, **extra)

    def inv_freq(self, dim: int) -> torch.Tensor:
        """``[dim / 2]`` fp32 inverse frequencies, computed as transformers does."""
        inv = 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        if self.kind == "linear":
            return inv / self.factor
        if self.kind == "llama3":
            old = self.original_max_position_embeddings
            low_wavelen, high_wavelen = old / self.low_freq_factor, old / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
            return torch.where(medium, smoothed, scaled)
        return inv

    def table(self, dim: int, max_seq_len: int, *, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``cos, sin: [max_seq_len, dim]`` (the half-angles repeated, ``cat(f, f)``)."""
        freqs = torch.arange(max_seq_len, dtype=torch.float32)[:, None] * self.inv_freq(dim)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(device), emb.sin().to(device)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False
) -> torch.Tensor:
    """Rotate ``x [B, T, H, D]`` by ``cos, sin [B, T, D]`` (already in ``x``'s dtype).

    ``interleaved`` pairs dims ``(0, 1), (2, 3), ...`` and returns them de-interleaved (evens then
    odds), as transformers' DeepSeek-V3 does; queries and keys get the same permutation.
    """
    cos, sin = cos[:, :, None], sin[:, :, None]
    if interleaved:
        half = cos.shape[-1] // 2
        c, s = cos[..., :half], sin[..., :half]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return x * cos + rotate_half(x) * sin


class Weights:
    """A flat ``name -> tensor`` mapping that records which entries were used.

    After a model has taken what it needs, :meth:`check_all_used` refuses leftovers (an MoE expert,
    an unknown bias): weights the model would silently ignore mean its output would be wrong.
    """

    def __init__(
        self, tensors: Mapping[str, torch.Tensor], *, model: str, dtype: torch.dtype, device: torch.device
    ):
        self._tensors = dict(tensors)
        self._used: set[str] = set()
        self.model = model
        self.dtype = dtype
        self.device = device

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def get(self, name: str, *, shape: Sequence[int] | None = None) -> torch.Tensor:
        if name not in self._tensors:
            raise UnsupportedModelError(f"{self.model}: weight {name!r} is missing from the checkpoint")
        t = self._tensors[name]
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise UnsupportedModelError(
                f"{self.model}: weight {name!r} has shape {tuple(t.shape)}; the config implies {tuple(shape)}"
            )
        self._used.add(name)
        return t.detach().to(device=self.device, dtype=self.dtype).contiguous()

    def optional(self, name: str, *, shape: Sequence[int] | None = None) -> torch.Tensor | None:
        return self.get(name, shape=shape) if name in self._tensors else None

    def ignore(self, predicate: Any) -> None:
        """Mark names matching ``predicate(name)`` as deliberately unused (e.g. multi-token-prediction heads)."""
        self._used.update(n for n in self._tensors if predicate(n))

    def num_params(self) -> int:
        """Parameters in the checkpoint, each shared tensor (tied embeddings) counted once."""
        seen: dict[tuple[int, tuple[int, ...]], int] = {}
        for t in self._tensors.values():
            seen[(t.data_ptr(), tuple(t.shape))] = t.numel()
        return sum(seen.values())

    def check_all_used(self) -> None:
        left = sorted(set(self._tensors) - self._used)
        if left:
            shown = ", ".join(left[:6]) + (f", ... ({len(left)} in all)" if len(left) > 6 else "")
            raise UnsupportedModelError(
                f"{self.model}: the checkpoint has weights this decoder does not use: {shown}; "
                "refusing rather than computing without them"
            )


@dataclass(frozen=True)
class LayerInputs:
    """What every layer of one step reads besides its hidden states: the step's plan, whether it
    decodes (one token per sequence) or runs prompts, and the RoPE rows of its positions."""

    plan: StepPlan
    decode: bool
    cos: torch.Tensor  # [B, T, rope_dim]
    sin: torch.Tensor  # [B, T, rope_dim]


class Decoder:
    """Base of the real decoders: embeddings → layers → norm → LM head, attention through a backend.

    Satisfies :class:`attnbench.measure.decode.DecodeModel` (``batch``, ``device``, ``vocab_size``, ``setup``,
    ``prefill``, ``decode_step``, ``kv_bytes_per_step``). Subclasses set :attr:`shape`, the embedding,
    norm and head weights and :attr:`layers`, and implement :meth:`_attention` for one layer. All
    tensors use ``dtype`` on ``device``.
    """

    family: ClassVar[str] = ""

    shape: ModelShape
    embed: torch.Tensor  # [V, hidden]
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [V, hidden]
    eps: float
    rope: RopeSpec
    rope_dim: int

    def __init__(
        self,
        *,
        backend: Backend,
        backend_config: Mapping[str, Any] | None,
        dtype: torch.dtype,
        device: torch.device,
        batch: int = 1,
    ) -> None:
        self.backend = backend
        self.backend_config = backend.resolve_config(backend_config)
        self.dtype = dtype
        self.device = device
        self.batch = batch
        self.cache: KVCache | None = None
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None
        self.layers: list[dict[str, Any]] = []

    @property
    def num_layers(self) -> int:
        return self.shape.num_layers

    @property
    def vocab_size(self) -> int:
        return self.shape.vocab_size

    def _load_embeddings(self, w: Weights, config: Mapping[str, Any]) -> None:
        """Token embeddings, final norm and LM head (tied to the embeddings when the config says so)."""
        vocab, hidden = self.shape.vocab_size, self.shape.hidden_size
        self.embed = w.get("model.embed_tokens.weight", shape=(vocab, hidden))
        self.final_norm = w.get("model.norm.weight", shape=(hidden,))
        if "lm_head.weight" in w:
            self.lm_head = w.get("lm_head.weight", shape=(vocab, hidden))
        elif config.get("tie_word_embeddings", False):
            self.lm_head = self.embed
        else:
            raise UnsupportedModelError(
                f"{w.model}: weight 'lm_head.weight' is missing and tie_word_embeddings is false"
            )

    # -- the backend and its cache ----------------------------------------------------------------
    def workload(self, *, batch: int | None = None, max_seq_len: int) -> Workload:
        """The workload the backend is asked to run: ``batch`` sequences up to ``max_seq_len`` tokens."""
        return Workload(self.shape, (max_seq_len,) * (batch or self.batch), self.dtype, str(self.device))

    def unsupported(self, *, batch: int | None = None, max_seq_len: int) -> list[str]:
        """Reasons this model cannot run with its backend at this size (empty list: it can)."""
        reasons = []
        if self.backend.kv_form == "latent" and not self.shape.is_mla:
            reasons.append(
                f"backend {self.backend.name!r} uses the MLA latent cache; {self.shape.name} is not an MLA model"
            )
        return reasons or list(
            self.backend.resolve(self.workload(batch=batch, max_seq_len=max_seq_len)).reasons
        )

    def setup(self, prompt_len: int, new_tokens: int) -> None:
        """Allocate for ``batch`` sequences of ``prompt_len + new_tokens`` tokens (untimed; empties the cache)."""
        self.setup_caches(batch=self.batch, max_seq_len=prompt_len + new_tokens)

    def setup_caches(self, *, batch: int, max_seq_len: int) -> None:
        """Allocate the backend's cache and the RoPE table; sets :attr:`batch`. May allocate; call untimed.

        Raises :class:`UnsupportedModelError` with the reasons when the backend or the model refuses.
        """
        reasons = self.unsupported(batch=batch, max_seq_len=max_seq_len)
        if reasons:
            raise UnsupportedModelError(
                f"{self.shape.name} with backend {self.backend.name!r}: {'; '.join(reasons)}"
            )
        self.cache = None  # free the old cache first
        self.batch = batch
        self.cache = self.backend.create_cache(
            self.workload(batch=batch, max_seq_len=max_seq_len),
            config=self.backend_config,
            num_layers=self.num_layers,
            max_seq_len=max_seq_len,
        )
        cos, sin = self.rope.table(self.rope_dim, max_seq_len, device=self.device)
        self._cos, self._sin = cos.to(self.dtype), sin.to(self.dtype)

    def kv_bytes_per_step(self) -> int:
        """KV-cache bytes the next decode step reads: every layer, every cached token plus the new one."""
        cache = self._require_cache(self.batch)
        return cache.bytes_per_token() * sum(n + 1 for n in cache.seq_lens)

    def _require_cache(self, batch: int) -> KVCache:
        if self.cache is None:
            raise RuntimeError(
                f"{self.shape.name}: call setup() or setup_caches() before prefill()/decode_step()"
            )
        if batch != self.cache.batch:
            raise ValueError(f"{self.shape.name}: input batch {batch} != cache batch {self.cache.batch}")
        return self.cache

    def _rope_at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [B, T]`` int64 → ``cos, sin [B, T, rope_dim]``."""
        assert self._cos is not None and self._sin is not None
        return self._cos[positions], self._sin[positions]

    # -- the step ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(
        self, input_ids: torch.Tensor, *, lengths: Sequence[int] | None = None, all_logits: bool = False
    ) -> torch.Tensor:
        """Run prompts through an emptied cache: ``input_ids [B, T]`` → logits ``[B, V]`` at each last prompt token.

        ``lengths[i]`` (default ``T``) is sequence ``i``'s prompt length when prompts are right-padded.
        ``all_logits=True`` returns ``[B, T, V]`` (rows past ``lengths[i]`` are meaningless). Plans the
        step (allocates); not capturable.
        """
        b, t = input_ids.shape
        cache = self._require_cache(b)
        lengths = [t] * b if lengths is None else [int(n) for n in lengths]
        if len(lengths) != b or not all(1 <= n <= t for n in lengths):
            raise ValueError(f"prefill: lengths {lengths} must hold {b} values in 1..{t}")
        cache.reset()
        plan = self.backend.plan(cache, num_new=lengths)
        positions = torch.arange(t, device=self.device)[None, :].expand(b, t).clamp_max(cache.max_seq_len - 1)
        x = self._hidden(input_ids, positions, plan, decode=False)  # [B, T, hidden]
        cache.commit(plan)
        if all_logits:
            return F.linear(x, self.lm_head)
        last = torch.as_tensor(lengths, device=self.device) - 1
        return F.linear(x[torch.arange(b, device=self.device), last], self.lm_head)

    @torch.inference_mode()
    def decode_step(self, next_ids: torch.Tensor) -> torch.Tensor:
        """One token per sequence: ``next_ids [B]`` → logits ``[B, V]``. One plan, every layer, one commit."""
        cache = self._require_cache(next_ids.shape[0])
        plan = self.backend.plan(cache, num_new=[1] * cache.batch)
        x = self._hidden(next_ids[:, None], plan.device_positions[:, None], plan, decode=True)
        cache.commit(plan)
        return F.linear(x[:, 0], self.lm_head)

    def _hidden(
        self, ids: torch.Tensor, positions: torch.Tensor, plan: StepPlan, *, decode: bool
    ) -> torch.Tensor:
        """``ids [B, T]`` → final-normed hidden states ``[B, T, hidden]``."""
        x = F.embedding(ids.to(self.device), self.embed)  # [B, T, hidden]
        step = LayerInputs(plan, decode, *self._rope_at(positions))
        for index, layer in enumerate(self.layers):
            h = rms_norm(x, layer["input_norm"], self.eps)
            x = x + self._attention(layer, index, h, step)
            h = rms_norm(x, layer["post_norm"], self.eps)
            x = x + self._mlp(layer, h)
        return rms_norm(x, self.final_norm, self.eps)

    def _attend(
        self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: LayerInputs
    ) -> torch.Tensor:
        """``q [B, T, Hq, Dk]``, ``k [B, T, Hkv, Dk]``, ``v [B, T, Hkv, Dv]`` → ``[B, T, Hq, Dv]`` via the backend."""
        assert self.cache is not None
        if step.decode:
            out = self.backend.decode(self.cache, step.plan, layer=index, q=q[:, 0], k=k[:, 0], v=v[:, 0])
            return out[:, None]
        return self.backend.prefill(self.cache, step.plan, layer=index, q=q, k=k, v=v)

    def _attention(
        self, layer: dict[str, Any], index: int, h: torch.Tensor, step: LayerInputs
    ) -> torch.Tensor:
        """One layer's attention: ``h [B, T, hidden]`` (normed) → ``[B, T, hidden]``."""
        raise NotImplementedError

    def _mlp(self, layer: dict[str, Any], h: torch.Tensor) -> torch.Tensor:
        gate = F.linear(h, layer["gate_proj"], layer.get("gate_proj_bias"))
        up = F.linear(h, layer["up_proj"], layer.get("up_proj_bias"))
        return F.linear(layer["act"](gate) * up, layer["down_proj"], layer.get("down_proj_bias"))
