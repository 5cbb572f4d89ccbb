"""Any Hugging Face decoder generates through an attnbench backend.

:func:`use_backend` registers an attention function in transformers' ``AttentionInterface``, switches
the model to it (``model.set_attn_implementation``) and returns a :class:`BackendCache` — a
transformers ``Cache`` backed by the backend's own KV cache. Pass that cache to ``generate``::

    import attnbench
    from attnbench.integrations.transformers import shape_of, use_backend

    workload = attnbench.Workload.uniform(shape_of(hf_model), batch=2, context=4096, dtype="bf16")
    choice = attnbench.select(workload)
    cache = use_backend(hf_model, choice, batch=2, max_seq_len=4096)
    out = hf_model.generate(input_ids, attention_mask=mask, past_key_values=cache,
                            max_new_tokens=32, do_sample=False)

How a step runs: the model calls ``cache.update(k, v, layer_idx)``, which stores nothing (the
backend's ``prefill``/``decode`` write K/V into its own cache, once) and hands the new K/V to the
attention call. The first layer's call plans the step (one ``plan()`` shared by every layer), the last
layer's call commits it. Left-padded batches (transformers' batched generation) are mapped onto the
backend's ragged per-sequence lengths: at prefill the pad positions, read from the attention mask,
are stripped; position ids come from the model. A prompt passed to a cache that already holds
tokens (a chat's next turn) is appended: it attends to each sequence's cached tokens and to itself. Beam search, assisted decoding and cache cropping are
not supported (the backend's cache cannot be reordered or cut).

A model whose attention the backend cannot express exactly raises
:class:`~attnbench.models.UnsupportedModelError` naming the feature, the layer and the backend (sliding
windows shorter than the run, logit soft-capping, attention sinks, ALiBi, non-causal layers,
cross-attention, per-layer different head counts, the MLA latent form). A softmax scale other than
``1/sqrt(head_dim)`` (Granite, Gemma) is folded into the query.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache

from attnbench.core.backend import Backend, KVCache, StepPlan
from attnbench.core.registry import load_registry
from attnbench.core.shapes import ModelShape
from attnbench.core.workload import Workload
from attnbench.integrations._hf_inspect import (
    AttentionCall,
    LayerAttention,
    attention_function,
    inspect_attention,
    model_name,
    model_shape,
    refusals,
    static_refusals,
)
from attnbench.integrations._hf_layout import left_to_right, prompt_lengths, right_to_left
from attnbench.models.base import UnsupportedModelError

try:  # transformers ≥ 4.56: per-layer cache objects and a registrable mask builder
    from transformers.cache_utils import CacheLayerMixin
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as err:  # pragma: no cover - older transformers
    raise ImportError(
        f"attnbench.integrations.transformers needs transformers >= 4.56 ({err}); "
        'pip install -e ".[transformers]"'
    ) from None

__all__ = [
    "ATTENTION_IMPLEMENTATION",
    "BackendCache",
    "TransformersDecodeModel",
    "bind_cache",
    "cache_kwarg",
    "greedy_reference",
    "register_attention",
    "shape_of",
    "use_backend",
]

#: The name the attention function is registered under (``model.config._attn_implementation``).
ATTENTION_IMPLEMENTATION = "attnbench"
_BINDING = "_attnbench_cache"  # attribute set on each attention module: the cache it runs through


def _attention(call: AttentionCall) -> torch.Tensor:
    """The registered attention function: ``q [B, Hq, T, Dk]`` → ``[B, T, Hq, Dv]`` through the bound cache."""
    module = call.module
    cache = getattr(module, _BINDING, None)
    if cache is None:
        raise RuntimeError(
            f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) runs attn_implementation "
            f"{ATTENTION_IMPLEMENTATION!r} but no attnbench cache is bound to it; call use_backend() first"
        )
    if call.dropout and getattr(module, "training", False):
        raise ValueError(
            f"attention dropout {call.dropout} in training mode is not supported; call model.eval()"
        )
    return cache.attend(call)


_REGISTERED: list[bool] = []


def register_attention() -> None:
    """Register the ``"attnbench"`` attention and mask functions with transformers, once (a timer
    that wraps the registered function, as ``attnbench e2e`` installs, stays in place)."""
    if _REGISTERED:
        return
    AttentionInterface.register(ATTENTION_IMPLEMENTATION, attention_function(_attention))
    # the padding mask at prefill as SDPA gets it: boolean, or None when nothing is padded
    AttentionMaskInterface.register(ATTENTION_IMPLEMENTATION, sdpa_mask)
    _REGISTERED.append(True)


class _BackendLayer(CacheLayerMixin):
    """transformers' view of one layer: it stores nothing; the backend's cache holds the tokens."""

    is_compileable = False
    is_sliding = False
    supports_early_init = False

    def __init__(self, owner: BackendCache) -> None:
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple:
        return key_states, value_states

    def get_seq_length(self, *args: Any) -> int:
        return self.owner.seen_tokens

    def get_mask_sizes(self, query: Any, *args: Any) -> tuple[int, int]:
        return self.owner.get_mask_sizes(query, 0)

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:
        return -1

    def reset(self) -> None:
        pass


class BackendCache(Cache):
    """A transformers ``Cache`` whose tokens live in an attnbench backend's KV cache.

    ``kv`` is the backend's :class:`~attnbench.core.backend.KVCache`; ``seen_tokens`` is the padded length
    transformers sees (prompt width + generated tokens), while ``kv.seq_lens`` holds each sequence's
    own length. Call :meth:`reset` before reusing it for a new prompt.
    """

    def __init__(
        self,
        *,
        backend: Backend,
        kv: KVCache,
        layers: list[LayerAttention],
        model: str,
    ) -> None:
        super().__init__(layers=[_BackendLayer(self) for _ in layers])
        self.backend = backend
        self.kv = kv
        self.model = model
        self.num_attention_layers = len(layers)
        self.seen_tokens = 0
        # the model's softmax scale (as the probe saw it), folded into q: backends scale by 1/sqrt(Dk)
        self.q_factor = [self._fold(la.scaling) for la in layers]
        self._plan: StepPlan | None = None
        self._pending: int | None = None
        self._shift: torch.Tensor | None = None  # [B] left-padding width at prefill

    def _fold(self, scaling: float) -> float:
        """The factor on ``q`` that turns the backend's ``1/sqrt(Dk)`` into the model's ``scaling``."""
        factor = scaling / self.kv.geometry.scale
        return 1.0 if math.isclose(factor, 1.0, rel_tol=1e-12) else factor

    # -- transformers' Cache API ------------------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hand the new K/V to this layer's attention call; the backend writes them there (once)."""
        self._pending = layer_idx
        return key_states, value_states

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return self.seen_tokens

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def get_mask_sizes(self, query: Any, layer_idx: int = 0) -> tuple[int, int]:
        """``(kv_length, kv_offset)``; ``query`` is the query length (transformers 5) or ``cache_position`` (4.x)."""
        q_len = query if isinstance(query, int) else int(query.shape[0])
        return self.seen_tokens + q_len, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    def reset(self) -> None:
        """Empty the backend's cache (every sequence back to length 0)."""
        self.kv.reset()
        self.seen_tokens = 0
        self._plan = None
        self._pending = None

    def _refuse(self, what: str) -> None:
        raise NotImplementedError(
            f"{what} is not supported by attnbench's cache (backend {self.backend.name!r}): "
            "its KV cache cannot be reordered or cut; use greedy or sampled generation"
        )

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        self._refuse("beam search (reorder_cache)")

    def crop(self, max_length: int) -> None:
        self._refuse("cropping the cache (assisted decoding)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._refuse("expanding the batch (num_beams / num_return_sequences > 1)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._refuse("selecting sequences")

    # -- one attention call -----------------------------------------------------------------------
    def attend(self, call: AttentionCall) -> torch.Tensor:
        """One layer's attention for this step (``q [B, Hq, T, Dk]`` → ``[B, T, Hq, Dv]``); plans at
        layer 0, commits after the last layer."""
        module, query, key, value, scaling = call.module, call.query, call.key, call.value, call.scaling
        layer = int(module.layer_idx)
        if self._pending != layer:
            raise RuntimeError(
                f"{self.model} layer {layer}: the model did not hand its K/V to this cache; pass the cache "
                f"use_backend() returned as past_key_values (got another cache, or none)"
            )
        self._pending = None
        t = query.shape[2]
        if layer == 0:
            self._plan = self._begin_step(t, call.attention_mask)
        plan = self._plan
        assert plan is not None
        q = query.transpose(1, 2)  # [B, T, Hq, Dk]
        factor = self.q_factor[layer] if scaling is None else self._fold(float(scaling))
        if factor != 1.0:
            q = q * factor
        k, v = key.transpose(1, 2), value.transpose(1, 2)  # [B, T, Hkv, Dk], [B, T, Hkv, Dv]
        if self._shift is None:  # decode: one token per sequence
            out = self.backend.decode(
                self.kv,
                plan,
                layer=layer,
                q=q[:, 0].contiguous(),
                k=k[:, 0].contiguous(),
                v=v[:, 0].contiguous(),
            )[:, None]
        else:
            shift = self._shift
            q, k, v = (left_to_right(x, shift) for x in (q, k, v))
            out = right_to_left(self.backend.prefill(self.kv, plan, layer=layer, q=q, k=k, v=v), shift)
        if layer == self.num_attention_layers - 1:
            self.kv.commit(plan)
            self.seen_tokens += t
            self._plan = None
        return out.contiguous()

    def _begin_step(self, t: int, attention_mask: torch.Tensor | None) -> StepPlan:
        """Plan the step at the first layer: a prompt (ragged lengths from the mask) or one token each."""
        b = self.kv.batch
        if any(self.kv.seq_lens):
            if t == 1:
                self._shift = None
                return self.backend.plan(self.kv, num_new=[1] * b)
            # a prompt appended to the cached sequences (a chat's next turn): every row holds t new
            # tokens, which attend to their own sequence's cached tokens and to themselves
            self._shift = torch.zeros(b, dtype=torch.long, device=self.kv.device)
            return self.backend.plan(self.kv, num_new=[t] * b)
        lengths = prompt_lengths(attention_mask, batch=b, t=t, model=self.model)
        self._shift = torch.tensor([t - n for n in lengths], device=self.kv.device)
        return self.backend.plan(self.kv, num_new=lengths)


def _resolve(backend: Any, config: Mapping[str, Any] | None) -> tuple[Backend, dict[str, Any]]:
    """A backend instance and its resolved config from a name, a :class:`~attnbench.Choice` or an instance."""

    if isinstance(backend, Backend):
        instance = backend
    elif isinstance(backend, str):
        instance = load_registry().get(backend)
    elif hasattr(backend, "build") and hasattr(backend, "workload"):  # a Choice from select()
        instance = backend.build()  # from the registry the choice was made from
        config = backend.config if config is None else config
    else:
        raise TypeError(f"backend: expected a name, a Choice or a Backend, got {type(backend).__name__}")
    return instance, instance.resolve_config(config)


def _geometry(shape: ModelShape) -> tuple[int, int, int, int]:
    g = shape.geometry()
    return g.num_q_heads, g.num_kv_heads, g.qk_head_dim, g.v_head_dim


def _describe(shape: ModelShape) -> str:
    q, kv, dk, dv = _geometry(shape)
    return f"{q} query / {kv} KV heads of {dk}" + (f" (values {dv})" if dv != dk else "")


def use_backend(
    model: Any,
    backend: Any,
    *,
    config: Mapping[str, Any] | None = None,
    batch: int,
    max_seq_len: int,
) -> BackendCache:
    """Route ``model``'s attention through ``backend``; returns the cache to pass to ``generate``.

    ``backend`` is a registered name, a :class:`~attnbench.Choice` from :func:`attnbench.select`
    (built with :meth:`~attnbench.Choice.build`, its config used unless ``config`` is given; a model
    whose attention geometry is not the choice's is refused, naming both) or a
    :class:`~attnbench.Backend` instance. The
    backend's cache is allocated for ``batch`` sequences of up to ``max_seq_len`` tokens (prompt
    width + new tokens) in the model's dtype on its device. The model is switched to the
    ``"attnbench"`` attention implementation; ``model.set_attn_implementation("sdpa")`` switches it
    back. Raises :class:`~attnbench.models.UnsupportedModelError` when the model's attention cannot
    run exactly through the backend, naming the feature, the layer and the backend.
    """
    instance, resolved = _resolve(backend, config)
    name = model_name(model)
    if batch < 1 or max_seq_len < 1:
        raise ValueError(f"use_backend: batch = {batch} and max_seq_len = {max_seq_len} must both be ≥ 1")

    def refuse(reasons: list[str]) -> None:
        raise UnsupportedModelError(
            f"{name} cannot run through backend {instance.name!r}: {'; '.join(reasons)}"
        )

    if instance.kv_form == "latent":
        refuse(
            [
                f"backend {instance.name!r} uses the MLA latent cache, but transformers' attention modules hand "
                "over expanded per-head K/V (for DeepSeek's absorbed form use attnbench.models.load_model): every layer"
            ]
        )
    reasons = static_refusals(model)
    if reasons:
        refuse(reasons)
    layers = inspect_attention(model)
    reasons = refusals(model, layers, max_seq_len=max_seq_len)
    if reasons:
        refuse(reasons)
    shape = model_shape(model, layers, name)
    chosen_for = getattr(backend, "workload", None) if not isinstance(backend, (str, Backend)) else None
    if chosen_for is not None and _geometry(chosen_for.shape) != _geometry(shape):
        raise UnsupportedModelError(
            f"{name} is not the shape this choice was made for: the model's attention is "
            f"{_describe(shape)}, the choice's ({chosen_for.shape.name}) {_describe(chosen_for.shape)}; "
            "select() for this model"
        )
    workload = Workload(shape, (max_seq_len,) * batch, model.dtype, str(model.device))
    reasons = list(instance.resolve(workload, resolved).reasons)
    if reasons:
        refuse([f"{r}: every layer" for r in reasons])
    kv = instance.create_cache(workload, config=resolved, num_layers=len(layers), max_seq_len=max_seq_len)
    cache = BackendCache(backend=instance, kv=kv, layers=layers, model=name)
    bind_cache(model, cache)
    return cache


def bind_cache(model: Any, cache: BackendCache) -> None:
    """Route ``model``'s attention through ``cache`` again (what :func:`use_backend` does once the cache
    is made): after ``model.set_attn_implementation("sdpa")``, or to alternate between two backends'
    caches on one model (``attnbench e2e`` interleaves the decode steps of its paths)."""
    register_attention()
    for module in model.modules():
        if getattr(module, "layer_idx", None) is not None and hasattr(module, "config"):
            setattr(module, _BINDING, cache)
    model.set_attn_implementation(ATTENTION_IMPLEMENTATION)


def shape_of(model: Any) -> ModelShape:
    """The attention shape of a transformers model (layers, heads, head dims; MLA fields for DeepSeek),
    read from one probing forward — what :func:`attnbench.select` needs in a workload."""
    layers = inspect_attention(model)
    reasons = refusals(model, layers, max_seq_len=1)
    if not layers or any(r.startswith(("per-layer", "attention calls")) for r in reasons):
        raise UnsupportedModelError(f"{model_name(model)}: no single attention shape: {'; '.join(reasons)}")
    return model_shape(model, layers, model_name(model))


def greedy_reference(
    model: Any, prompt: torch.Tensor, *, new_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' own greedy ``generate`` after an unpadded ``prompt [B, T]``: the reference a
    backend's tokens are compared with. Returns the new tokens ``[B, N]`` and the logits each was
    chosen from ``[B, N, V]`` (the model's dtype), ``N = new_tokens``."""
    out = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return out.sequences[:, prompt.shape[1] :], torch.stack(out.logits, dim=1)


def cache_kwarg(model: Any) -> str:
    """The name ``model.forward`` takes its cache under: ``cache`` (transformers ≥ 5.2x) or ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class TransformersDecodeModel:
    """A transformers causal LM as a :class:`attnbench.measure.decode.DecodeModel`, attention through ``backend``.

    ``setup`` allocates the backend's cache (:func:`use_backend`), ``prefill`` runs the prompt
    (``[B, T]`` → last-position logits ``[B, V]``), ``decode_step`` one token per sequence. The decode
    loop (:func:`attnbench.measure.decode.generate`) times them: TTFT, ITL, e2e.
    """

    def __init__(self, model: Any, backend: Any, *, config: Mapping[str, Any] | None = None, batch: int = 1):
        self.model = model.eval()
        self.backend, self.config = _resolve(backend, config)
        self.batch = batch
        self.device = model.device
        self.vocab_size: int | None = int(model.config.get_text_config(decoder=True).vocab_size)
        self.cache: BackendCache | None = None
        self._kw = cache_kwarg(model)
        self._max_seq_len = 0

    @property
    def shape(self) -> ModelShape:
        assert self.cache is not None
        return self.cache.kv.workload.shape

    def setup(self, prompt_len: int, new_tokens: int) -> None:
        need = prompt_len + new_tokens
        if self.cache is None or need > self._max_seq_len:
            self.cache = None
            self.cache = use_backend(
                self.model, self.backend, config=self.config, batch=self.batch, max_seq_len=need
            )
            self._max_seq_len = need
        self.cache.reset()

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        assert self.cache is not None, "call setup() first"
        self.cache.reset()
        out = self.model(input_ids=tokens, use_cache=True, **{self._kw: self.cache})
        return out.logits[:, -1].float()

    @torch.inference_mode()
    def decode_step(self, tokens: torch.Tensor) -> torch.Tensor:
        assert self.cache is not None, "call setup() first"
        out = self.model(input_ids=tokens[:, None], use_cache=True, **{self._kw: self.cache})
        return out.logits[:, -1].float()

    def kv_bytes_per_step(self) -> int:
        assert self.cache is not None
        kv = self.cache.kv
        return kv.bytes_per_token() * sum(n + 1 for n in kv.seq_lens)
