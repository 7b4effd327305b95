"""A rollout-level replay buffer for GRPO: store single rollouts, replay the ones whose
advantage is large, never ones older than ``max_age`` steps.

GRPO uses each rollout for one step's updates and drops it. This buffer keeps individual
rollouts (not whole groups) with what their loss needs as it was when they were generated:
the token ids and prompt length, the group advantage, the behaviour policy's log-probs (the
"old" log-probs of the PPO ratio) and the reference log-probs. Each step

- every fresh rollout of the step is trained on (fresh-anchored composition); replayed
  rollouts are drawn separately and appended (``sample``);
- a rollout older than ``max_age`` training steps is dropped (age eviction), so a replayed
  rollout's behaviour policy is at most ``max_age`` steps behind;
- draws are without replacement, each with probability proportional to ``|A|^alpha``
  (``priority="abs_advantage"``) or uniform;
- rollouts whose advantage is exactly zero are never stored: their policy-gradient
  coefficient is zero, so replaying them adds only the KL term.

A replayed rollout's old log-probs are older than the current policy, so more of its tokens
fall outside the PPO clip range; a clipped token's coefficient is exactly zero (Eq. 4), and
the exposure then lets the allocator compress more of those microbatches' activations.

The buffer is part of the job's checkpoint (``state_dict``); its draws use a generator seeded
per step, so a resumed run draws what the uninterrupted one did.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

PRIORITIES = ("abs_advantage", "uniform")


@dataclass
class ReplayItem:
    """One rollout as it was trained on when fresh. ``old_log_probs`` / ``ref_log_probs``: the
    log-probs of tokens 1..n-1 of ``ids`` (next-token layout, ``n - 1`` values)."""

    ids: torch.Tensor
    prompt_len: int
    advantage: float
    step: int
    old_log_probs: torch.Tensor
    ref_log_probs: torch.Tensor
    replays: int = 0

    def to_dict(self) -> Dict:
        return dict(
            ids=self.ids,
            prompt_len=self.prompt_len,
            advantage=self.advantage,
            step=self.step,
            old_log_probs=self.old_log_probs,
            ref_log_probs=self.ref_log_probs,
            replays=self.replays,
        )


class ReplayBuffer:
    def __init__(self, capacity: int, max_age: int, priority: str = "abs_advantage", alpha: float = 1.0, seed: int = 0):
        if capacity < 1 or max_age < 0 or alpha < 0 or priority not in PRIORITIES:
            raise ValueError(
                f"replay buffer: capacity >= 1, max_age >= 0, alpha >= 0 and priority in {PRIORITIES}; got "
                f"{capacity}, {max_age}, {alpha}, {priority!r}"
            )
        self.capacity, self.max_age, self.priority, self.alpha, self.seed = capacity, max_age, priority, alpha, seed
        self.items: List[ReplayItem] = []

    def __len__(self) -> int:
        return len(self.items)

    def add(self, items: List[ReplayItem]) -> int:
        """Store the rollouts with a non-zero advantage (oldest dropped past ``capacity``);
        returns how many were stored."""
        kept = [it for it in items if it.advantage != 0.0]
        self.items.extend(kept)
        if len(self.items) > self.capacity:
            self.items = self.items[len(self.items) - self.capacity :]
        return len(kept)

    def evict(self, step: int) -> int:
        """Drop every rollout older than ``max_age`` steps at ``step``; returns how many."""
        before = len(self.items)
        self.items = [it for it in self.items if step - it.step <= self.max_age]
        return before - len(self.items)

    def weights(self) -> torch.Tensor:
        """Each stored rollout's draw weight: ``|A|^alpha`` or 1."""
        if self.priority == "uniform" or not self.items:
            return torch.ones(len(self.items), dtype=torch.float64)
        return torch.tensor([abs(it.advantage) for it in self.items], dtype=torch.float64) ** self.alpha

    def sample(self, n: int, step: int) -> List[ReplayItem]:
        """Evict by age, then draw ``min(n, len)`` rollouts without replacement (see the module
        docstring); the same ``(seed, step)`` draws the same ones."""
        self.evict(step)
        n = min(n, len(self.items))
        if n <= 0:
            return []
        gen = torch.Generator().manual_seed(self.seed * 1000003 + step)
        picked = torch.multinomial(self.weights(), n, replacement=False, generator=gen).tolist()
        out = [self.items[i] for i in picked]
        for it in out:
            it.replays += 1
        return out

    def state_dict(self) -> Dict:
        return {
            "items": [it.to_dict() for it in self.items],
            "config": dict(capacity=self.capacity, max_age=self.max_age, priority=self.priority, alpha=self.alpha),
        }

    def load_state_dict(self, state: Dict) -> None:
        self.items = [ReplayItem(**d) for d in state["items"]]


def split_row(values: torch.Tensor, lengths: List[int]) -> List[torch.Tensor]:
    """A packed row's next-token values ``[1, T-1]`` (or ``[T-1]``) -> per sequence its
    ``n - 1`` own values (the value at a sequence's last token predicts the next sequence's
    first token and belongs to neither)."""
    flat = values.reshape(-1)
    out, offset = [], 0
    for n in lengths:
        out.append(flat[offset : offset + n - 1].clone())
        offset += n
    return out


def stats(replayed: List[ReplayItem], buffer: Optional[ReplayBuffer], step: int) -> Dict:
    """Per-step metrics of the buffer and of the step's replayed rollouts."""
    m = {"replay_buffer_size": len(buffer) if buffer is not None else 0, "replayed": len(replayed)}
    if replayed:
        m["replay_mean_age"] = sum(step - it.step for it in replayed) / len(replayed)
        m["replay_mean_abs_advantage"] = sum(abs(it.advantage) for it in replayed) / len(replayed)
    return m
