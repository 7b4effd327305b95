"""Validation and broadcasting shared by ``policy_loss`` and ``token_coefficients``.

Both functions take the same arguments; checking them in one place keeps their semantics
identical and turns user mistakes into clear errors instead of broadcasting surprises deep
inside torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")

# Clamps, identical to OpenRLHF 0.11.2 (PolicyLoss / compute_approx_kl):
LOG_RATIO_CLAMP = 20.0  # log(pi/pi_old) is clamped to [-20, 20] before exp
K3_LOG_RATIO_MIN = -10.0  # k3 bounds log(pi/pi_ref) below at -10 before exp
KL_VALUE_CLAMP = 10.0  # every KL estimate is clamped to [-10, 10]


@dataclass
class LossInputs:
    """Validated inputs, all ``[B, T]`` in one floating dtype (at least float32)."""

    log_probs: torch.Tensor
    old_log_probs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    ref_log_probs: Optional[torch.Tensor]
    clip_low: float
    clip_high: float
    dual_clip: Optional[float]
    kl_coef: float
    kl_estimator: str
    loss_agg_mode: str
    num_tokens: Optional[float]
    num_sequences: Optional[float]


def prepare(
    log_probs,
    old_log_probs,
    advantages,
    action_mask,
    ref_log_probs,
    clip_eps_low,
    clip_eps_high,
    dual_clip,
    kl_coef,
    kl_estimator,
    loss_agg_mode,
    num_tokens,
    num_sequences,
) -> LossInputs:
    if not isinstance(log_probs, torch.Tensor) or log_probs.dim() != 2:
        raise ValueError("log_probs must be a [batch, response_len] tensor of per-token log-probabilities")
    shape = tuple(log_probs.shape)
    dtype = torch.promote_types(log_probs.dtype, torch.float32)

    def same_shape(name, t):
        t = torch.as_tensor(t, device=log_probs.device)
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape} like log_probs")
        return t

    old = same_shape("old_log_probs", old_log_probs).to(dtype)
    adv = torch.as_tensor(advantages, device=log_probs.device)
    if adv.dim() == 1 and adv.shape[0] == shape[0]:
        adv = adv[:, None].expand(shape)  # one advantage per response, shared by its tokens
    adv = same_shape("advantages (per response [B] or per token [B, T])", adv).to(dtype)
    if action_mask is None:
        mask = torch.ones(shape, dtype=dtype, device=log_probs.device)
    else:
        mask = same_shape("action_mask", action_mask)
        if mask.dtype != torch.bool and not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError("action_mask must hold only 0 and 1")
        mask = mask.to(dtype)
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown kl_estimator {kl_estimator!r}; choose one of {KL_ESTIMATORS}")
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; choose one of {LOSS_AGG_MODES}")
    ref = None
    if kl_coef != 0.0:
        if ref_log_probs is None:
            raise ValueError("kl_coef != 0 needs ref_log_probs (the reference policy's log-probs)")
        ref = same_shape("ref_log_probs", ref_log_probs).to(dtype)
    clip_high = clip_eps_low if clip_eps_high is None else clip_eps_high
    if not (0.0 <= clip_eps_low < 1.0) or clip_high < 0.0:
        raise ValueError(
            f"clip range must satisfy 0 <= clip_eps_low < 1 and clip_eps_high >= 0, got {clip_eps_low}, {clip_high}"
        )
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1.0, got {dual_clip}")
    for name, v in (("num_tokens", num_tokens), ("num_sequences", num_sequences)):
        if v is not None and not v > 0:
            raise ValueError(f"{name} must be positive when given, got {v}")
    return LossInputs(
        log_probs=log_probs.to(dtype),
        old_log_probs=old,
        advantages=adv,
        mask=mask,
        ref_log_probs=ref,
        clip_low=float(clip_eps_low),
        clip_high=float(clip_high),
        dual_clip=dual_clip,
        kl_coef=float(kl_coef),
        kl_estimator=kl_estimator,
        loss_agg_mode=loss_agg_mode,
        num_tokens=num_tokens,
        num_sequences=num_sequences,
    )


def prepare_loss_inputs(
    log_probs,
    old_log_probs,
    advantages,
    action_mask=None,
    ref_log_probs=None,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: Optional[float] = None,
    dual_clip: Optional[float] = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    loss_agg_mode: str = "token-mean",
    num_tokens: Optional[float] = None,
    num_sequences: Optional[float] = None,
) -> LossInputs:
    """``prepare`` with ``policy_loss``'s signature and defaults: validate once, then call
    ``loss.loss_from`` and ``coefficients.coefficients_from`` on the result."""
    return prepare(
        log_probs,
        old_log_probs,
        advantages,
        action_mask,
        ref_log_probs,
        clip_eps_low,
        clip_eps_high,
        dual_clip,
        kl_coef,
        kl_estimator,
        loss_agg_mode,
        num_tokens,
        num_sequences,
    )


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over unmasked entries; 0 (not NaN) when everything is masked."""
    return (x * mask).sum() / mask.sum().clamp(min=1)
