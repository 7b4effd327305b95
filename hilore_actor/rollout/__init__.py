"""Rollout backends: HF ``generate`` on CPU (vLLM engines on GPU come with the training job)."""

from .hf_generate import Rollout, generate_groups
from .packing import pack_rollout

__all__ = ["Rollout", "generate_groups", "pack_rollout"]
