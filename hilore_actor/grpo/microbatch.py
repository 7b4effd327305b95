"""A learner microbatch and its GRPO loss with omega, ready for allocation.

Packed layout: each row holds several sequences back to back; ``position_ids`` restart at 0
at every sequence start (HF models then attend within sequences only). Per-token tensors are
``[B, T-1]``: position ``t`` holds the log-prob of token ``t+1``; ``action_mask`` is 1 only on
response tokens (so never on a position that would predict the next sequence's first token).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict

import torch

from .coefficients import token_coefficients
from .loss import policy_loss


@dataclass
class Microbatch:
    input_ids: torch.Tensor  # [B, T]
    position_ids: torch.Tensor  # [B, T]
    old_log_probs: torch.Tensor  # [B, T-1]
    ref_log_probs: torch.Tensor  # [B, T-1]
    advantages: torch.Tensor  # [B, T-1] (each response's advantage on its tokens)
    action_mask: torch.Tensor  # [B, T-1]
    loss_options: Dict[str, Any] = field(default_factory=dict)  # policy_loss keyword options

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def to(self, device) -> "Microbatch":
        return Microbatch(*(getattr(self, f).to(device) for f in
                            ("input_ids", "position_ids", "old_log_probs", "ref_log_probs", "advantages", "action_mask")),
                          loss_options=self.loss_options)


@dataclass
class LossOutput:
    loss: torch.Tensor
    omega: torch.Tensor  # [B, T-1], dL/ds_t (Eq. 4), detached
    mask: torch.Tensor
    stats: Dict[str, torch.Tensor]


def microbatch_loss(model, mb: Microbatch, lean_head: bool = False) -> LossOutput:
    """Forward the packed microbatch, then Eq. 1 and Eq. 4 on its response tokens.
    ``lean_head``: token log-probs through the chunked head (``models/lean_head.py``) instead
    of the model's full logits."""
    if lean_head:
        from ..models.lean_head import lean_token_log_probs

        logp = lean_token_log_probs(model, mb.input_ids, mb.position_ids)
    else:
        from ..models.logprobs import token_log_probs

        out = model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False)
        logp = token_log_probs(out.logits[:, :-1], mb.input_ids[:, 1:])
    args = (logp, mb.old_log_probs, mb.advantages, mb.action_mask, mb.ref_log_probs)
    loss, stats = policy_loss(*args, **mb.loss_options)
    omega = token_coefficients(*args, **mb.loss_options)
    return LossOutput(loss, omega, mb.action_mask, stats)
