"""Policy-update exposure of a unit, Eq. 7: ``E_u = sum_{t in J(u)} alpha_{t,u} |omega_t|``.

For a full-microbatch unit of a causal LM the support ``J(u)`` is every valid response
position of the microbatch. Token weights ``alpha_{t,u}`` are the token's activation
magnitude at the unit's input (L2 norm over the hidden dimension), normalised to mean 1 over
the valid positions of (unit, microbatch); masked positions (prompt tokens, padding, and the
position that would predict the next packed sequence's first token) weigh 0. If every omega
on the support is 0, the exposure, and so the risk, is exactly 0.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch


def token_weights(norms: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``alpha``: ``norms`` masked and scaled to mean 1 over ``mask``; 0 where masked (all 0 when
    no position is valid or every valid norm is 0). No host sync: the case is chosen on the device."""
    norms = norms[..., : mask.shape[-1]].to(mask.device, torch.float64)  # position t predicts s_t
    m = mask.to(torch.float64)
    total = (norms * m).sum()
    count = m.sum()
    return torch.where((count != 0) & (total != 0), norms * m * (count / total), torch.zeros_like(m))


def _exposure(omega_abs: torch.Tensor, norms: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``E_u`` as a 0-d float64 tensor on the device (``omega_abs``: |omega| in float64)."""
    return (token_weights(norms, mask) * omega_abs).sum()


def unit_exposure(omega: torch.Tensor, norms: torch.Tensor, mask: torch.Tensor) -> float:
    return float(_exposure(omega.to(torch.float64).abs(), norms, mask))


def exposures(omega: torch.Tensor, token_norms: Dict[str, torch.Tensor], mask: torch.Tensor) -> Dict[str, float]:
    """``E_u`` for every unit whose input norms were recorded (``engine.step(track_tokens=True)``);
    one host transfer for all of them."""
    return exposures_and_rest(omega, token_norms, mask)[0]


def exposures_and_rest(
    omega: torch.Tensor,
    token_norms: Dict[str, torch.Tensor],
    mask: torch.Tensor,
    kept_rows: Optional[Dict[str, torch.Tensor]] = None,
) -> Tuple[Dict[str, float], Dict[str, float]]:
    """``exposures`` and, for the units of ``kept_rows``, ``rest_exposures``: every unit's score
    computed on the device as ``unit_exposure`` computes it (the same ops, so the same bits),
    gathered into one tensor and read with one ``tolist``: one device-to-host sync per
    microbatch, not one per unit."""
    w = omega.to(torch.float64).abs()
    names, rest = list(token_norms), list(kept_rows or {})
    scores = [_exposure(w, token_norms[n], mask) for n in names]
    scores += [_rest(w, token_norms[n], mask, kept_rows[n]) for n in rest]
    values = torch.stack(scores).tolist() if scores else []
    return dict(zip(names, values[: len(names)])), dict(zip(rest, values[len(names) :]))


def advantage_only_exposure(advantages: torch.Tensor, mask: torch.Tensor) -> float:
    """The weaker proxy the diagnostics compare against: ``sum_t |A_t|`` over valid tokens."""
    return float((advantages.to(torch.float64).abs() * mask.to(torch.float64)).sum())


def _rest(omega_abs: torch.Tensor, norms: torch.Tensor, mask: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    w = token_weights(norms, mask) * omega_abs
    rest = ~keep.reshape(norms.shape)[..., : mask.shape[-1]].to(w.device)
    return (w * rest).sum()


def rest_exposures(
    omega: torch.Tensor, token_norms: Dict[str, torch.Tensor], mask: torch.Tensor, kept_rows: Dict[str, torch.Tensor]
) -> Dict[str, float]:
    """Token L: ``E_u`` over the rows a unit compressed, i.e. Eq. 7 without the rows it kept
    exact (``Step.kept_rows``; weights normalised over all valid positions, as for ``E_u``);
    one host transfer."""
    return exposures_and_rest(omega, {n: token_norms[n] for n in kept_rows}, mask, kept_rows)[1]
