"""hilore-actor: a GRPO learner that chooses, per recovery unit and microbatch, to store (H),
compress (L) or recompute (R) activations under a memory budget.

``import hilore_actor`` needs torch only; deepspeed, ray, vllm, flash-attn, openrlhf,
transformers and reasoning-gym are imported where they are used.
"""

__version__ = "0.1.0"

from . import grpo  # noqa: E402  (pure torch)

__all__ = ["__version__", "grpo"]
