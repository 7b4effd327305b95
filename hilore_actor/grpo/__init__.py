"""GRPO math: group-relative advantages, the policy loss (Eq. 1) and its exact token
coefficients omega (Eq. 4), both with one ``LossConfig`` of options. Pure torch."""

from .advantages import ESTIMATORS, group_advantages
from .coefficients import token_coefficients
from .inputs import KL_ESTIMATORS, LOSS_AGG_MODES, LossConfig
from .loss import kl_estimate, policy_loss

__all__ = [
    "ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "LossConfig",
    "group_advantages",
    "kl_estimate",
    "policy_loss",
    "token_coefficients",
]
