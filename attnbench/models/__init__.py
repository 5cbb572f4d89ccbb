"""Real decoders whose attention runs through a backend where transformers cannot express the form.

DeepSeek-V3's absorbed MLA latent form (:class:`DeepseekDecoder`): transformers' module decompresses
the latent to per-head K/V before attention, so the latent cache (``kv_form = "latent"``, e.g. ``mla``)
needs a decoder of its own. Weights come from a transformers model object or a checkpoint directory
(config.json + safetensors); everything but attention is plain torch. Greedy tokens are checked
against transformers' own ``generate`` in the tests.

Every other decoder (Llama, Mistral, Qwen2/3, Phi-3, Granite, OLMo-2, Gemma-3, DeepSeek's expanded
form, ...) runs through transformers' own modeling code with
:func:`attnbench.integrations.transformers.use_backend`. See ``docs/real-models.md``.
"""

from __future__ import annotations

from attnbench.models.architectures import ARCHITECTURES, hf_config
from attnbench.models.base import Decoder, RopeSpec, UnsupportedModelError
from attnbench.models.deepseek import DEEPSEEK_FAMILY, DeepseekDecoder
from attnbench.models.loading import SUPPORTED_MODEL_TYPES, from_transformers, load_model, read_checkpoint

__all__ = [
    "ARCHITECTURES",
    "DEEPSEEK_FAMILY",
    "SUPPORTED_MODEL_TYPES",
    "Decoder",
    "DeepseekDecoder",
    "RopeSpec",
    "UnsupportedModelError",
    "from_transformers",
    "hf_config",
    "load_model",
    "read_checkpoint",
]
