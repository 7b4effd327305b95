"""Configs of the models users train, written in code: there is no model hub to read them from.

The fields are those of each model's published ``config.json`` (the Hugging Face model cards of
Qwen/Qwen2.5-*-Instruct, Qwen/Qwen3-*, meta-llama/Llama-3.1-*-Instruct) that shape its tensors:
widths, depths, heads, vocabulary, tied embeddings, and the attention layout. ``named_config``
builds the transformers config from them (weights are never needed: the estimate runs on the
meta device).
"""

from __future__ import annotations

from typing import Any, Dict

_QWEN25 = {"model_type": "qwen2", "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768}
_QWEN3 = {
    "model_type": "qwen3",
    "head_dim": 128,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 40960,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
}
_LLAMA31 = {
    "model_type": "llama",
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
}

NAMED: Dict[str, Dict[str, Any]] = {
    "qwen2.5-3b": dict(
        _QWEN25,
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen2.5-7b": dict(
        _QWEN25,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
    "qwen2.5-32b": dict(
        _QWEN25,
        hidden_size=5120,
        intermediate_size=27648,
        num_hidden_layers=64,
        num_attention_heads=40,
        num_key_value_heads=8,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
    "qwen2.5-72b": dict(
        _QWEN25,
        hidden_size=8192,
        intermediate_size=29568,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
    "qwen3-8b": dict(
        _QWEN3,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
    ),
    "qwen3-32b": dict(
        _QWEN3,
        hidden_size=5120,
        intermediate_size=25600,
        num_hidden_layers=64,
        num_attention_heads=64,
        num_key_value_heads=8,
    ),
    "llama-3.1-8b": dict(
        _LLAMA31,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
    ),
    "llama-3.1-70b": dict(
        _LLAMA31,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
    ),
}


def named_config(name: str):
    """The transformers config of a ``NAMED`` model (``KeyError`` names the known ones)."""
    import transformers

    key = name.lower()
    if key not in NAMED:
        raise KeyError(f"unknown model {name!r}; named configs: {', '.join(NAMED)}")
    fields = dict(NAMED[key])
    return transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
