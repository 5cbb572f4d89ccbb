"""Architecture presets: transformers configs of published models, for runs with random weights.

``attnbench e2e --model qwen2.5-0.5b`` builds the model from its published ``config.json`` values
(copied below, with the Hugging Face model id) and random weights: the geometry, MLP and vocabulary
of the real model, so its TTFT and ITL are what the real model's would be, without downloading it.
``tiny-qwen2`` is the same architecture at test size.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ARCHITECTURES", "hf_config"]

#: name → (model id the values are copied from, config.json fields)
ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2.5-0.5b": (
        "Qwen/Qwen2.5-0.5B",
        {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "hidden_act": "silu",
            "hidden_size": 896,
            "intermediate_size": 4864,
            "max_position_embeddings": 32768,
            "max_window_layers": 24,
            "num_attention_heads": 14,
            "num_hidden_layers": 24,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-06,
            "rope_theta": 1000000.0,
            "sliding_window": 32768,
            "use_sliding_window": False,
            "tie_word_embeddings": True,
            "vocab_size": 151936,
            "bos_token_id": 151643,
            "eos_token_id": 151643,
        },
    ),
    "tiny-qwen2": (
        "attnbench test architecture (Qwen2, test size)",
        {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "hidden_size": 128,
            "intermediate_size": 256,
            "max_position_embeddings": 4096,
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-06,
            "rope_theta": 10000.0,
            "tie_word_embeddings": True,
            "vocab_size": 512,
            "initializer_range": 0.2,  # wide logits: fp32 rounding cannot flip a greedy token
        },
    ),
}


def hf_config(name: str) -> Any:
    """The transformers config of architecture preset ``name``."""
    import transformers  # deferred: transformers is an optional extra (the presets' other uses need none)

    if name not in ARCHITECTURES:
        raise ValueError(f"architecture {name!r} unknown; presets: {', '.join(ARCHITECTURES)}")
    _source, fields = ARCHITECTURES[name]
    config = transformers.AutoConfig.for_model(**fields)
    config.name_or_path = name
    return config
