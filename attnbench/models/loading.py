"""Load the DeepSeek latent-form decoder from a transformers model object or a local checkpoint directory.

A checkpoint directory holds ``config.json`` and safetensors weights (``model.safetensors`` or shards
listed in ``model.safetensors.index.json``), as ``save_pretrained`` writes them. transformers itself
is not needed to load a directory. The architecture is chosen by ``model_type``::

    >>> from attnbench.models import load_model
    >>> model = load_model("path/to/checkpoint", backend="mla", dtype=torch.float32, batch=2)
    >>> run = attnbench.measure.decode.generate(model, prompt=prompt_ids, new_tokens=32)   # greedy
    >>> run.tokens                                                                  # [2, 32]

Anything the decoders do not implement raises :class:`UnsupportedModelError` naming the feature; other
architectures are pointed to :func:`attnbench.integrations.transformers.use_backend`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from attnbench.core.backend import Backend
from attnbench.core.registry import load_registry
from attnbench.models.base import Decoder, UnsupportedModelError
from attnbench.models.deepseek import DEEPSEEK_FAMILY, DeepseekDecoder

__all__ = ["SUPPORTED_MODEL_TYPES", "from_transformers", "load_model", "read_checkpoint"]

_DECODERS: dict[str, type[DeepseekDecoder]] = dict.fromkeys(DEEPSEEK_FAMILY, DeepseekDecoder)
#: ``model_type`` values :func:`load_model` accepts.
SUPPORTED_MODEL_TYPES = tuple(_DECODERS)


def read_checkpoint(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``config.json`` and every safetensors tensor of a checkpoint directory (loaded on CPU)."""
    from safetensors.torch import load_file  # deferred: safetensors comes with the transformers extra

    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(
            f"checkpoint {str(path)!r} is not a directory (expected config.json + safetensors)"
        )
    config_path = root / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"checkpoint {root.name!r}: config.json is missing")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"checkpoint {root.name!r}: config.json is not valid JSON ({err})") from None
    index = root / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in root.glob("*.bin")) + sorted(p.name for p in root.glob("*.pt"))
        hint = f" (found {', '.join(others)}; only safetensors are read)" if others else ""
        raise FileNotFoundError(f"checkpoint {root.name!r}: no *.safetensors weights{hint}")
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        weights.update(load_file(str(root / name), device="cpu"))
    return config, weights


def from_transformers(model: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Config dict and state dict of a transformers ``*ForCausalLM`` model object."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "state_dict"):
        raise TypeError(
            f"expected a transformers model object with .config and .state_dict(), got {type(model).__name__}"
        )
    weights = dict(model.state_dict())
    if "model.embed_tokens.weight" not in weights:
        raise UnsupportedModelError(
            f"{type(model).__name__}: no 'model.embed_tokens.weight'; pass a *ForCausalLM model (with its LM head)"
        )
    return config.to_dict(), weights


def _resolve_backend(backend: Backend | str) -> Backend:
    if isinstance(backend, Backend):
        return backend

    return load_registry().get(backend)


def load_model(
    source: Any,
    *,
    backend: Backend | str,
    backend_config: Mapping[str, Any] | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    batch: int = 1,
    name: str | None = None,
) -> Decoder:
    """A real decoder whose attention runs through ``backend`` (an instance or a registered name).

    ``source`` is a transformers model object or a checkpoint directory path. ``dtype`` defaults to
    the checkpoint's embedding dtype; ``batch`` is the number of sequences :meth:`~Decoder.setup`
    allocates for. The result is a :class:`attnbench.measure.decode.DecodeModel`: drive it with
    :func:`attnbench.measure.decode.generate`, or call ``setup`` / ``prefill`` / ``decode_step`` yourself.
    """
    if isinstance(source, (str, Path)):
        config, weights = read_checkpoint(source)
        name = name or Path(source).name
    else:
        config, weights = from_transformers(source)
        name = name or getattr(source.config, "name_or_path", "") or type(source).__name__
    model_type = config.get("model_type")
    if model_type not in _DECODERS:
        archs = ", ".join(config.get("architectures") or []) or "unknown architecture"
        raise UnsupportedModelError(
            f"{name}: model_type {model_type!r} ({archs}) has no hand-written decoder (supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}); run it through transformers' own modeling code with "
            "attnbench.integrations.transformers.use_backend"
        )
    return _DECODERS[model_type].from_weights(
        config,
        weights,
        backend=_resolve_backend(backend),
        backend_config=backend_config,
        dtype=dtype,
        device=device,
        batch=batch,
        name=name,
    )
