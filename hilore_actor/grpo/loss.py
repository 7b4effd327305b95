"""GRPO policy loss, Eq. 1 of docs/DESIGN.md, with OpenRLHF 0.11.2 semantics.

``loss = agg(-min(r A, clip(r, 1-eps_low, 1+eps_high) A)) + kl_coef * agg(KL)`` where ``agg`` is
the chosen loss aggregation, exactly as OpenRLHF's ``actor_loss + kl_loss * kl_ctl``.
Deviation: where OpenRLHF divides by a zero token count (a fully masked batch) and returns
NaN, we return 0 (denominators are clamped to at least 1).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from .inputs import K3_LOG_RATIO_MIN, KL_VALUE_CLAMP, LOG_RATIO_CLAMP, LossConfig, LossInputs, masked_mean, prepare


def kl_estimate(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate (Schulman's k1/k2/k3), clamped as OpenRLHF does."""
    log_ratio = log_probs - ref_log_probs
    if estimator == "k1":
        value = log_ratio
    elif estimator == "k2":
        value = log_ratio**2 / 2.0
    else:  # k3 = exp(-x) - 1 + x, x bounded below so exp cannot overflow
        x = log_ratio.clamp(min=K3_LOG_RATIO_MIN)
        value = (-x).exp() - 1 + x
    return value.clamp(min=-KL_VALUE_CLAMP, max=KL_VALUE_CLAMP)


def aggregate(per_token: torch.Tensor, inp: LossInputs) -> torch.Tensor:
    """Reduce a ``[B, T]`` per-token loss to a scalar with ``inp.config.loss_agg_mode``.

    ``num_tokens`` / ``num_sequences`` replace the local denominators (e.g. the global
    counts over all microbatches of an optimizer step, for exact gradient accumulation).
    """
    mask = inp.mask
    if inp.config.loss_agg_mode == "token-mean":
        denom = inp.config.num_tokens if inp.config.num_tokens is not None else mask.sum().clamp(min=1)
        return (per_token * mask).sum() / denom
    counts = mask.sum(dim=-1)
    seq = (per_token * mask).sum(dim=-1)
    if inp.config.loss_agg_mode == "seq-mean-token-mean":
        seq = seq / counts.clamp(min=1)
    seq_mask = (counts > 0).to(per_token.dtype)  # fully masked responses do not count
    denom = inp.config.num_sequences if inp.config.num_sequences is not None else seq_mask.sum().clamp(min=1)
    return (seq * seq_mask).sum() / denom


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: Optional[torch.Tensor] = None,
    ref_log_probs: Optional[torch.Tensor] = None,
    config: Optional[LossConfig] = None,
    **options,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """GRPO/PPO-clip loss and its statistics.

    Args:
        log_probs: ``[B, T]`` log-probs of the sampled tokens under the current policy
            (carries the graph; its gradient is ``token_coefficients``).
        old_log_probs: ``[B, T]`` behaviour-policy log-probs.
        advantages: ``[B]`` (one per response) or ``[B, T]``.
        action_mask: ``[B, T]`` of 0/1, 1 on response tokens that train. ``None``: all.
        ref_log_probs: ``[B, T]`` reference-policy log-probs; needed when ``kl_coef != 0``.
        config: the options (``inputs.LossConfig``: clip range, dual clip, KL coefficient and
            estimator, aggregation mode, global denominators); its defaults when None.
        **options: ``LossConfig`` fields replacing ``config``'s, e.g. ``kl_coef=0.01``.

    Returns:
        ``(loss, stats)`` with detached scalar stats ``policy_loss``, ``kl_loss``,
        ``clip_fraction`` (share of masked tokens whose clipped surrogate is active, as
        OpenRLHF's ``ppo_clip_ratio``), ``kl_mean`` and ``ppo_kl`` (mean of ``old - new``).
    """
    return loss_from(prepare(log_probs, old_log_probs, advantages, action_mask, ref_log_probs, config, **options))


def loss_from(inp: LossInputs) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """``policy_loss`` on inputs already validated by ``inputs.prepare`` (a learner prepares
    a microbatch's inputs once for both the loss and ``coefficients.coefficients_from``)."""
    raw_log_ratio = inp.log_probs - inp.old_log_probs
    ratio = raw_log_ratio.clamp(min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP).exp()
    adv = inp.advantages
    surr1 = ratio * adv
    surr2 = ratio.clamp(1 - inp.config.clip_eps_low, 1 + inp.config.clip_eps_high) * adv
    clipped = torch.min(surr1, surr2)
    if inp.config.dual_clip is not None:
        clipped = torch.where(adv < 0, torch.max(clipped, inp.config.dual_clip * adv), clipped)
    pg_loss = aggregate(-clipped, inp)
    loss = pg_loss
    zero = pg_loss.new_zeros(())
    kl_loss, kl_mean = zero, zero
    if inp.ref_log_probs is not None:
        kl = kl_estimate(inp.log_probs, inp.ref_log_probs, inp.config.kl_estimator)
        kl_loss = aggregate(kl, inp)
        kl_mean = masked_mean(kl.detach(), inp.mask)
        loss = pg_loss + inp.config.kl_coef * kl_loss
    stats = {
        "policy_loss": pg_loss.detach(),
        "kl_loss": kl_loss.detach(),
        "clip_fraction": masked_mean((surr2 < surr1).to(ratio.dtype), inp.mask).detach(),
        "kl_mean": kl_mean,
        "ppo_kl": masked_mean(-raw_log_ratio.detach(), inp.mask),
    }
    return loss, stats
