"""Rollouts -> packed learner microbatches (the layout of ``grpo.microbatch``)."""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from ..grpo.microbatch import Microbatch
from ..models.logprobs import sequence_log_probs
from .hf_generate import Rollout


def pack_row(seqs: Sequence[Tuple[torch.Tensor, int, float]]) -> Dict[str, torch.Tensor]:
    """Sequences ``(token ids, prompt length, advantage)`` back to back in one row: ids and
    position ids ``[1, T]``; action mask and advantages ``[1, T-1]`` (see ``grpo.microbatch``)."""
    ids = torch.cat([s[0] for s in seqs])[None]
    pos = torch.cat([torch.arange(len(s[0])) for s in seqs])[None]
    mask = torch.cat([torch.cat([torch.zeros(p - 1), torch.ones(len(t) - p), torch.zeros(1)]) for t, p, _ in seqs])[None, :-1]
    adv = torch.cat([torch.full((len(t),), float(a)) for t, _, a in seqs])[None, :-1]
    return {"input_ids": ids, "position_ids": pos, "action_mask": mask, "advantages": adv}


def rollout_sequences(rollout: Rollout, advantages: torch.Tensor) -> List[Tuple[torch.Tensor, int, float]]:
    """The rollout's sequences without padding, with prompt lengths and advantages."""
    return [(rollout.sequences[i, : rollout.prompt_lens[i] + rollout.response_lens[i]], rollout.prompt_lens[i],
             float(advantages[i])) for i in range(rollout.sequences.shape[0])]


@torch.no_grad()
def pack_rollout(model, rollout: Rollout, advantages: torch.Tensor, max_tokens: int, ref_model=None,
                 loss_options=None) -> List[Microbatch]:
    """Pack the rollout's sequences (padding dropped) into rows of at most ``max_tokens``;
    old log-probs from ``model`` (the behaviour policy), reference log-probs from
    ``ref_model`` (or ``model`` with its LoRA adapters disabled)."""
    seqs = rollout_sequences(rollout, advantages)
    for i, (ids, _, _) in enumerate(seqs):
        if len(ids) > max_tokens:
            raise ValueError(f"sequence {i} has {len(ids)} tokens, more than a microbatch of {max_tokens}")
    rows, cur = [], []
    for s in seqs:
        if sum(len(x[0]) for x in cur) + len(s[0]) > max_tokens:
            rows.append(cur)
            cur = []
        cur.append(s)
    rows.append(cur)
    out = []
    for row in rows:
        r = pack_row(row)
        ids, pos, mask, adv = r["input_ids"], r["position_ids"], r["action_mask"], r["advantages"]
        old = sequence_log_probs(model, ids, position_ids=pos).float()
        if ref_model is not None:
            ref = sequence_log_probs(ref_model, ids, position_ids=pos).float()
        elif hasattr(model, "disable_adapter"):
            with model.disable_adapter():
                ref = sequence_log_probs(model, ids, position_ids=pos).float()
        else:
            ref = old.clone()
        out.append(Microbatch(ids, pos, old, ref, adv, mask, loss_options=dict(loss_options or {})))
    return out
