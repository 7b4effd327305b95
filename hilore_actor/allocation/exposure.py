"""Policy-update exposure of a unit, Eq. 7: ``E_u = sum_{t in J(u)} alpha_{t,u} |omega_t|``.

For a full-microbatch unit of a causal LM the support ``J(u)`` is every valid response
position of the microbatch. Token weights ``alpha_{t,u}`` are the token's activation
magnitude at the unit's input (L2 norm over the hidden dimension), normalised to mean 1 over
the valid positions of (unit, microbatch); masked positions (prompt tokens, padding, and the
position that would predict the next packed sequence's first token) weigh 0. If every omega
on the support is 0, the exposure, and so the risk, is exactly 0.
"""

from __future__ import annotations

from typing import Dict

import torch


def token_weights(norms: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``alpha``: ``norms`` masked and scaled to mean 1 over ``mask``; 0 where masked."""
    norms = norms[..., : mask.shape[-1]].to(mask.device, torch.float64)  # position t predicts s_t
    m = mask.to(torch.float64)
    total = (norms * m).sum()
    count = m.sum()
    if count == 0 or total == 0:
        return torch.zeros_like(m)
    return norms * m * (count / total)


def unit_exposure(omega: torch.Tensor, norms: torch.Tensor, mask: torch.Tensor) -> float:
    return float((token_weights(norms, mask) * omega.to(torch.float64).abs()).sum())


def exposures(omega: torch.Tensor, token_norms: Dict[str, torch.Tensor], mask: torch.Tensor) -> Dict[str, float]:
    """``E_u`` for every unit whose input norms were recorded (``engine.step(track_tokens=True)``)."""
    return {name: unit_exposure(omega, norms, mask) for name, norms in token_norms.items()}


def advantage_only_exposure(advantages: torch.Tensor, mask: torch.Tensor) -> float:
    """The weaker proxy the diagnostics compare against: ``sum_t |A_t|`` over valid tokens."""
    return float((advantages.to(torch.float64).abs() * mask.to(torch.float64)).sum())


def rest_exposures(
    omega: torch.Tensor, token_norms: Dict[str, torch.Tensor], mask: torch.Tensor, kept_rows: Dict[str, torch.Tensor]
) -> Dict[str, float]:
    """Token L: ``E_u`` over the rows a unit compressed, i.e. Eq. 7 without the rows it kept
    exact (``Step.kept_rows``; weights normalised over all valid positions, as for ``E_u``)."""
    out = {}
    for name, keep in kept_rows.items():
        w = token_weights(token_norms[name], mask) * omega.to(torch.float64).abs()
        rest = ~keep.reshape(token_norms[name].shape)[..., : mask.shape[-1]].to(w.device)
        out[name] = float((w * rest).sum())
    return out
