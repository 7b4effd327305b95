"""A learner microbatch and its GRPO loss with omega, ready for allocation.

Packed layout: each row holds several sequences back to back; ``position_ids`` restart at 0
at every sequence start (HF models then attend within sequences only). Per-token tensors are
``[B, T-1]``: position ``t`` holds the log-prob of token ``t+1``; ``action_mask`` is 1 only on
response tokens (so never on a position that would predict the next sequence's first token).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import torch

from .coefficients import coefficients_from
from .inputs import masked_mean, prepare
from .loss import loss_from


@dataclass
class Microbatch:
    input_ids: torch.Tensor  # [B, T]
    position_ids: torch.Tensor  # [B, T]
    old_log_probs: torch.Tensor  # [B, T-1]
    ref_log_probs: torch.Tensor  # [B, T-1]
    advantages: torch.Tensor  # [B, T-1] (each response's advantage on its tokens)
    action_mask: torch.Tensor  # [B, T-1]
    loss_options: Dict[str, Any] = field(default_factory=dict)  # ``inputs.LossConfig``'s fields

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def prefix(self, tokens: int) -> "Microbatch":
        """The first ``tokens`` positions of every row: a shorter microbatch of the same
        sequences (profiling measures bytes on it when the whole one would not fit B)."""
        if not 2 <= tokens <= self.input_ids.shape[1]:
            raise ValueError(f"prefix of {tokens} tokens: choose 2 .. {self.input_ids.shape[1]}")
        cut = lambda t, n: t[:, :n]  # noqa: E731
        return Microbatch(
            cut(self.input_ids, tokens),
            cut(self.position_ids, tokens),
            *(
                cut(getattr(self, f), tokens - 1)
                for f in ("old_log_probs", "ref_log_probs", "advantages", "action_mask")
            ),
            loss_options=self.loss_options,
        )

    def to(self, device) -> "Microbatch":
        return Microbatch(
            *(
                getattr(self, f).to(device)
                for f in ("input_ids", "position_ids", "old_log_probs", "ref_log_probs", "advantages", "action_mask")
            ),
            loss_options=self.loss_options,
        )


@dataclass
class LossOutput:
    loss: torch.Tensor
    omega: torch.Tensor  # [B, T-1], dL/ds_t (Eq. 4), detached
    mask: torch.Tensor
    stats: Dict[str, torch.Tensor]


def microbatch_loss(
    model, mb: Microbatch, chunked_head: bool = False, entropy: bool = False, head_chunk: Optional[int] = None
) -> LossOutput:
    """Forward the packed microbatch, then Eq. 1 and Eq. 4 on its response tokens.
    ``chunked_head``: token log-probs through the chunked head (``models/chunked_head.py``) instead
    of the model's full logits, ``head_chunk`` rows at a time (default: the device's rule).
    ``entropy``: ``stats["entropy"]``, the policy's mean per-token entropy (temperature 1) over the
    trained response tokens (``action_mask``); detached, so the loss and its gradient are
    unchanged."""
    ent = None
    if chunked_head:
        from ..models.chunked_head import chunked_token_log_probs

        logp = chunked_token_log_probs(model, mb.input_ids, mb.position_ids, chunk=head_chunk, entropy=entropy)
        if entropy:
            logp, ent = logp
    else:
        from ..models.logprobs import output_log_probs, token_entropy

        out = model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False, return_dict=True)
        logp = output_log_probs(out, mb.input_ids)
        if entropy and getattr(out, "logits", None) is not None:  # a fused head without logits: no entropy
            ent = token_entropy(out.logits[:, :-1].detach())
    inp = prepare(logp, mb.old_log_probs, mb.advantages, mb.action_mask, mb.ref_log_probs, **mb.loss_options)
    loss, stats = loss_from(inp)  # Eq. 1
    if ent is not None:
        stats["entropy"] = masked_mean(ent, mb.action_mask.to(ent.dtype))
    return LossOutput(loss, coefficients_from(inp), mb.action_mask, stats)  # Eq. 4, from the same prepared inputs
