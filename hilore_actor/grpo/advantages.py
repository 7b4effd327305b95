"""Group-relative advantages (docs/DESIGN.md section 2).

Rewards arrive flat, group-contiguous: ``[p0_s0, p0_s1, ..., p0_s{G-1}, p1_s0, ...]``, the
order OpenRLHF 0.11.2 uses (``rewards.reshape(-1, n_samples_per_prompt)``). Every token of a
response shares its response's advantage.
"""

from __future__ import annotations

import torch

ESTIMATORS = ("group_norm", "dr_grpo", "rloo")


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    estimator: str = "group_norm",
    eps: float = 1e-9,
) -> torch.Tensor:
    """Per-response advantages, same shape as ``rewards`` (1-D).

    - ``group_norm``: ``(r - mean_g) / (std_g + eps)`` with the unbiased std, as OpenRLHF
      (GRPO).
    - ``dr_grpo``: ``r - mean_g`` (Dr. GRPO / REINFORCE baseline; no std division).
    - ``rloo``: ``r - mean of the other G-1 rewards``.

    A group whose rewards are all equal gets advantage exactly 0 under every estimator: in
    floating point ``r - mean_g`` is a rounding residue, which ``group_norm`` divides by an
    equally tiny std (eight rewards of 0.1 in float32 would get advantages near +-0.8, and
    OpenRLHF's formula gives them that); such a group carries no signal.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; choose one of {ESTIMATORS}")
    rewards = torch.as_tensor(rewards)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (one per response), got shape {tuple(rewards.shape)}")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
    if rewards.numel() == 0 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"{rewards.numel()} rewards are not a whole number of groups of {group_size} "
            f"(n_samples_per_prompt); the batch must hold complete groups"
        )
    if estimator in ("group_norm", "rloo") and group_size < 2:
        raise ValueError(f"estimator {estimator!r} needs group_size >= 2, got {group_size}")
    r = rewards.to(torch.float64 if rewards.dtype == torch.float64 else torch.float32).view(-1, group_size)
    mean = r.mean(dim=-1, keepdim=True)
    if estimator == "group_norm":
        adv = (r - mean) / (r.std(dim=-1, keepdim=True) + eps)
    elif estimator == "dr_grpo":
        adv = r - mean
    else:
        adv = r - (r.sum(dim=-1, keepdim=True) - r) / (group_size - 1)
    equal = (r == r[:, :1]).all(dim=-1, keepdim=True)
    return torch.where(equal, torch.zeros_like(adv), adv).reshape(-1)
