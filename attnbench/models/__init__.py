"""Real decoders: Llama-family and DeepSeek-V3 MLA models whose attention runs through a backend.

Weights come from a transformers model object or a checkpoint directory (config.json + safetensors);
everything but attention (embeddings, RMSNorm, RoPE, MLP, LM head) is plain torch. Greedy tokens are
checked against transformers' own ``generate`` in the tests. See ``docs/real-models.md``.
"""

from __future__ import annotations

from attnbench.models.base import Decoder, RopeSpec, UnsupportedModelError
from attnbench.models.deepseek import DEEPSEEK_FAMILY, DeepseekDecoder
from attnbench.models.llama import LLAMA_FAMILY, LlamaDecoder
from attnbench.models.loading import SUPPORTED_MODEL_TYPES, from_transformers, load_model, read_checkpoint

__all__ = [
    "DEEPSEEK_FAMILY",
    "LLAMA_FAMILY",
    "SUPPORTED_MODEL_TYPES",
    "Decoder",
    "DeepseekDecoder",
    "LlamaDecoder",
    "RopeSpec",
    "UnsupportedModelError",
    "from_transformers",
    "load_model",
    "read_checkpoint",
]
