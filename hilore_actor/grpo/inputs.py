"""The loss's options (``LossConfig``) and the validation and broadcasting shared by
``policy_loss`` and ``token_coefficients``.

Both functions take the same arguments; checking them in one place keeps their semantics
identical and turns user mistakes into clear errors instead of broadcasting surprises deep
inside torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")

# Clamps, identical to OpenRLHF 0.11.2 (PolicyLoss / compute_approx_kl):
LOG_RATIO_CLAMP = 20.0  # log(pi/pi_old) is clamped to [-20, 20] before exp
K3_LOG_RATIO_MIN = -10.0  # k3 bounds log(pi/pi_ref) below at -10 before exp
KL_VALUE_CLAMP = 10.0  # every KL estimate is clamped to [-10, 10]


@dataclass(frozen=True)
class LossConfig:
    """The loss's options: one definition for ``policy_loss``, ``token_coefficients`` and a
    microbatch's ``loss_options`` (these fields as a dict, ``grpo.microbatch.Microbatch``).
    OpenRLHF 0.11.2's names and defaults."""

    clip_eps_low: float = field(default=0.2, metadata={"help": "the ratio is clipped to [1 - low, 1 + high]"})
    clip_eps_high: Optional[float] = field(default=None, metadata={"help": "high end of the clip range (None: low)"})
    dual_clip: Optional[float] = field(
        default=None, metadata={"help": "dual-clip constant c > 1 bounding the loss of negative advantages"}
    )
    kl_coef: float = field(default=0.0, metadata={"help": "beta: the KL term is kl_coef x agg(KL)"})
    kl_estimator: str = field(default="k3", metadata={"help": "Schulman's KL estimator: k1, k2 or k3"})
    loss_agg_mode: str = field(
        default="token-mean", metadata={"help": "token-mean, seq-mean-token-mean or seq-mean-token-sum"}
    )
    num_tokens: Optional[float] = field(
        default=None, metadata={"help": "global token count replacing the local one (token-mean)"}
    )
    num_sequences: Optional[float] = field(
        default=None, metadata={"help": "global sequence count replacing the local one (seq-mean modes)"}
    )

    @classmethod
    def of(cls, config: Optional["LossConfig"] = None, **options) -> "LossConfig":
        """``config`` (default: the defaults) with ``options`` (LossConfig's fields) replacing its values."""
        if config is None:
            return cls(**options)
        return dataclasses.replace(config, **options) if options else config


@dataclass
class LossInputs:
    """Validated inputs, all ``[B, T]`` in one floating dtype (at least float32), and the
    validated options (``clip_eps_high`` resolved, the scalars as floats)."""

    log_probs: torch.Tensor
    old_log_probs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    ref_log_probs: Optional[torch.Tensor]
    config: LossConfig


def prepare(
    log_probs,
    old_log_probs,
    advantages,
    action_mask=None,
    ref_log_probs=None,
    config: Optional[LossConfig] = None,
    **options,
) -> LossInputs:
    """Validate once, then call ``loss.loss_from`` and ``coefficients.coefficients_from`` on
    the result; the arguments are ``policy_loss``'s (``options``: ``LossConfig``'s fields)."""
    cfg = LossConfig.of(config, **options)
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
    if cfg.kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown kl_estimator {cfg.kl_estimator!r}; choose one of {KL_ESTIMATORS}")
    if cfg.loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {cfg.loss_agg_mode!r}; choose one of {LOSS_AGG_MODES}")
    ref = None
    if cfg.kl_coef != 0.0:
        if ref_log_probs is None:
            raise ValueError("kl_coef != 0 needs ref_log_probs (the reference policy's log-probs)")
        ref = same_shape("ref_log_probs", ref_log_probs).to(dtype)
    low = cfg.clip_eps_low
    high = low if cfg.clip_eps_high is None else cfg.clip_eps_high
    if not (0.0 <= low < 1.0) or high < 0.0:
        raise ValueError(f"clip range must satisfy 0 <= clip_eps_low < 1 and clip_eps_high >= 0, got {low}, {high}")
    if cfg.dual_clip is not None and cfg.dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1.0, got {cfg.dual_clip}")
    for name, v in (("num_tokens", cfg.num_tokens), ("num_sequences", cfg.num_sequences)):
        if v is not None and not v > 0:
            raise ValueError(f"{name} must be positive when given, got {v}")
    return LossInputs(
        log_probs=log_probs.to(dtype),
        old_log_probs=old,
        advantages=adv,
        mask=mask,
        ref_log_probs=ref,
        config=dataclasses.replace(cfg, clip_eps_low=float(low), clip_eps_high=float(high), kl_coef=float(cfg.kl_coef)),
    )


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over unmasked entries; 0 (not NaN) when everything is masked."""
    return (x * mask).sum() / mask.sum().clamp(min=1)
