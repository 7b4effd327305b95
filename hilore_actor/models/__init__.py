"""Model construction: tiny in-code configs, local checkpoints, the bundled SmolLM2, LoRA."""

from .factory import ARCHS, LoraSpec, apply_lora, build_model, init_lora_b, load_model, tiny_config
from .smollm2 import load_smollm2, smollm2_gguf_path

__all__ = [
    "ARCHS",
    "LoraSpec",
    "apply_lora",
    "build_model",
    "init_lora_b",
    "load_model",
    "load_smollm2",
    "smollm2_gguf_path",
    "tiny_config",
]
