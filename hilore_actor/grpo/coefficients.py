"""Exact per-token update coefficients ``omega_t = dL/ds_t`` (Eq. 4 of docs/DESIGN.md).

Computed in closed form from the loss inputs, without autograd, so they are available right
after the learner's forward and before its backward (Proposition 1: ``grad L = sum_t omega_t
grad s_t``). At ties and clamp edges ``omega`` follows the derivative conventions of torch's
autograd on ``policy_loss`` exactly:

- ``clamp(x, lo, hi)`` passes the gradient for ``lo <= x <= hi`` (edges included);
- ``min(a, b)`` / ``max(a, b)`` split the gradient 1/2 : 1/2 when ``a == b``;
- ``where(c, a, b)`` sends it to the chosen branch only.

So at exactly ``r = 1 + eps`` with ``A > 0`` the two surrogates tie, each gets half, the clamp
passes its half, and the token keeps its full coefficient ``-(w_t) r A``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .inputs import K3_LOG_RATIO_MIN, KL_VALUE_CLAMP, LOG_RATIO_CLAMP, LossConfig, LossInputs, prepare


def _tie_weight(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Share of ``min(a, b)``'s gradient that flows to ``a`` (1, 1/2 on ties, or 0)."""
    return torch.where(a < b, 1.0, torch.where(a == b, 0.5, 0.0)).to(a.dtype)


def _in_range(x: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    return ((x >= lo) & (x <= hi)).to(x.dtype)


def aggregation_weights(inp: LossInputs) -> torch.Tensor:
    """``dL/d(per-token loss)`` for the aggregation mode: the ``m_t / N`` factor of Eq. 4."""
    mask = inp.mask
    if inp.config.loss_agg_mode == "token-mean":
        denom = inp.config.num_tokens if inp.config.num_tokens is not None else mask.sum().clamp(min=1)
        return mask / denom
    counts = mask.sum(dim=-1, keepdim=True)
    seq_mask = (counts > 0).to(mask.dtype)
    denom = inp.config.num_sequences if inp.config.num_sequences is not None else seq_mask.sum().clamp(min=1)
    w = mask * seq_mask / denom
    if inp.config.loss_agg_mode == "seq-mean-token-mean":
        w = w / counts.clamp(min=1)
    return w


def policy_term_derivative(inp: LossInputs) -> torch.Tensor:
    """``d(-clipped surrogate)/ds_t`` per token: ``-u_t r_t A_t`` with autograd's tie rules."""
    log_ratio = inp.log_probs - inp.old_log_probs
    ratio = log_ratio.clamp(min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP).exp()
    adv = inp.advantages
    lo, hi = 1 - inp.config.clip_eps_low, 1 + inp.config.clip_eps_high
    surr1 = ratio * adv
    surr2 = ratio.clamp(lo, hi) * adv
    w1 = _tie_weight(surr1, surr2)
    d_clipped = adv * (w1 + (1 - w1) * _in_range(ratio, lo, hi))  # d min(surr1, surr2) / d ratio
    if inp.config.dual_clip is not None:
        # max(clip1, c A): clip1 keeps the gradient where c A < clip1 (half on a tie)
        w_keep = _tie_weight(inp.config.dual_clip * adv, torch.min(surr1, surr2))
        d_clipped = torch.where(adv < 0, d_clipped * w_keep, d_clipped)
    return -d_clipped * ratio * _in_range(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def kl_derivative(inp: LossInputs) -> torch.Tensor:
    """``dKL_t/ds_t`` for the estimator, including OpenRLHF's clamps (zero where they bind)."""
    x = inp.log_probs - inp.ref_log_probs
    if inp.config.kl_estimator == "k1":
        value, d = x, torch.ones_like(x)
    elif inp.config.kl_estimator == "k2":
        value, d = x**2 / 2.0, x
    else:
        xc = x.clamp(min=K3_LOG_RATIO_MIN)
        value = (-xc).exp() - 1 + xc
        d = (1 - (-xc).exp()) * (x >= K3_LOG_RATIO_MIN).to(x.dtype)
    return d * _in_range(value, -KL_VALUE_CLAMP, KL_VALUE_CLAMP)


def token_coefficients(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: Optional[torch.Tensor] = None,
    ref_log_probs: Optional[torch.Tensor] = None,
    config: Optional[LossConfig] = None,
    **options,
) -> torch.Tensor:
    """``omega = dL/d log_probs`` of ``policy_loss`` with the same arguments, as a detached
    ``[B, T]`` tensor (masked tokens are exactly 0). See ``policy_loss`` for the arguments."""
    with torch.no_grad():
        inp = prepare(log_probs.detach(), old_log_probs, advantages, action_mask, ref_log_probs, config, **options)
    return coefficients_from(inp)


def coefficients_from(inp: LossInputs) -> torch.Tensor:
    """``token_coefficients`` on inputs already validated by ``inputs.prepare``."""
    with torch.no_grad():
        inp = dataclasses.replace(inp, log_probs=inp.log_probs.detach())
        per_token = policy_term_derivative(inp)
        if inp.ref_log_probs is not None:
            per_token = per_token + inp.config.kl_coef * kl_derivative(inp)
        return aggregation_weights(inp) * per_token
