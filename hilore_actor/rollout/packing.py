"""Rollouts -> packed learner microbatches (the layout of ``grpo.microbatch``)."""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from ..grpo.microbatch import Microbatch
from ..models.logprobs import sequence_log_probs
from .hf_generate import Rollout


def pack_row(seqs: Sequence[Tuple]) -> Dict[str, torch.Tensor]:
    """Sequences ``(token ids, prompt length, advantage)`` back to back in one row: ids and
    position ids ``[1, T]``; action mask and advantages ``[1, T-1]`` (see ``grpo.microbatch``).

    A sequence may carry its own old and reference log-probs (``(ids, prompt length,
    advantage, old, ref)``, ``n - 1`` values each: a replayed rollout, ``rollout/replay.py``);
    the row then has ``given_mask`` and ``given_old_log_probs`` / ``given_ref_log_probs``
    ``[1, T-1]``, which replace the computed ones where the mask is set, and ``replayed``,
    how many such sequences it holds."""
    ids = torch.cat([s[0] for s in seqs])[None]
    pos = torch.cat([torch.arange(len(s[0])) for s in seqs])[None]
    mask = torch.cat(
        [
            torch.cat([torch.zeros(p - 1), torch.ones(len(s[0]) - p), torch.zeros(1)])
            for s, p in ((s, s[1]) for s in seqs)
        ]
    )[None, :-1]
    adv = torch.cat([torch.full((len(s[0]),), float(s[2])) for s in seqs])[None, :-1]
    row = {"input_ids": ids, "position_ids": pos, "action_mask": mask, "advantages": adv}
    given = [len(s) > 3 for s in seqs]
    if any(given):

        def laid_out(k):  # per sequence its n - 1 values and a 0 where it meets the next one
            return torch.cat(
                [
                    torch.cat([s[k].float(), torch.zeros(1)]) if g else torch.zeros(len(s[0]))
                    for s, g in zip(seqs, given)
                ]
            )[None, :-1]

        row["given_mask"] = torch.cat(
            [
                torch.cat([torch.full((len(s[0]) - 1,), g), torch.zeros(1, dtype=torch.bool)])
                for s, g in zip(seqs, given)
            ]
        )[None, :-1]
        row["given_old_log_probs"], row["given_ref_log_probs"] = laid_out(3), laid_out(4)
        row["replayed"] = sum(given)
    return row


def rollout_sequences(rollout: Rollout, advantages: torch.Tensor) -> List[Tuple[torch.Tensor, int, float]]:
    """The rollout's sequences without padding, with prompt lengths and advantages."""
    return [
        (
            rollout.sequences[i, : rollout.prompt_lens[i] + rollout.response_lens[i]],
            rollout.prompt_lens[i],
            float(advantages[i]),
        )
        for i in range(rollout.sequences.shape[0])
    ]


@torch.no_grad()
def pack_rollout(
    model, rollout: Rollout, advantages: torch.Tensor, max_tokens: int, ref_model=None, loss_options=None
) -> List[Microbatch]:
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
