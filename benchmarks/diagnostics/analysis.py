"""How well exposure predicts approximation damage (the paper's section 6 checks).

Coefficient structure of GRPO updates: the share of response tokens whose policy-gradient
coefficient is exactly 0, and the share of |omega| mass carried by the top 10% of tokens.
Risk predictor quality on held-out microbatches: single-unit L interventions give the
measured gradient error y of each (unit, microbatch); three predictors are scored against it
by Spearman correlation, recall of the top 10%, and AUROC of "y is in the top 10%":
advantage-only exposure (sum alpha |A|), complete exposure (Eq. 7), and psi_u.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import torch

from hilore_actor.grpo.coefficients import token_coefficients
from hilore_actor.allocation.calibration import Calibration, calibrate


def ranks(x: Sequence[float]) -> torch.Tensor:
    """1-based ranks, ties averaged."""
    t = torch.tensor(list(x), dtype=torch.float64)
    order = torch.argsort(t)
    r = torch.empty_like(t)
    r[order] = torch.arange(1, len(t) + 1, dtype=torch.float64)
    for v in torch.unique(t):
        idx = (t == v).nonzero().flatten()
        if len(idx) > 1:
            r[idx] = r[idx].mean()
    return r


def spearman(x, y) -> float:
    rx, ry = ranks(x), ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = rx.norm() * ry.norm()
    return float((rx * ry).sum() / den) if den > 0 else 0.0


def auroc(scores, labels) -> float:
    """Probability a positive outranks a negative (Mann-Whitney), ties count half."""
    r = ranks(scores)
    lab = torch.tensor(list(labels), dtype=torch.bool)
    n_pos, n_neg = int(lab.sum()), int((~lab).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    return float((r[lab].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def top_recall(pred, truth, frac: float = 0.1) -> float:
    k = max(1, round(len(truth) * frac))
    top_true = set(torch.tensor(list(truth)).argsort(descending=True)[:k].tolist())
    top_pred = set(torch.tensor(list(pred)).argsort(descending=True)[:k].tolist())
    return len(top_true & top_pred) / k


def coefficient_structure(batches) -> Dict[str, float]:
    """Zero policy-gradient coefficients and top-10% |omega| mass over ``batches``' responses."""
    zero = total = 0
    mags: List[torch.Tensor] = []
    for mb in batches:
        opts = dict(mb.loss_options, kl_coef=0.0)  # the policy-gradient part alone
        om = token_coefficients(mb.old_log_probs, mb.old_log_probs, mb.advantages, mb.action_mask, **opts)
        full = token_coefficients(
            mb.old_log_probs, mb.old_log_probs, mb.advantages, mb.action_mask, mb.ref_log_probs, **mb.loss_options
        )
        valid = mb.action_mask.bool()
        zero += int((om[valid] == 0).sum())
        total += int(valid.sum())
        mags.append(full[valid].abs().flatten())
    m = torch.cat(mags).sort(descending=True).values
    k = max(1, len(m) // 10)
    return {
        "zero_pg_coefficient_fraction": zero / max(total, 1),
        "top10_omega_mass": float(m[:k].sum() / m.sum().clamp(min=1e-30)),
    }


def predictor_quality(runner, calib_batches, heldout_batches, calibration: Calibration = None, progress=None) -> Dict:
    """Calibrate (unless given), then score the three predictors on held-out interventions;
    ``progress(done, total)`` is called after every pass of each set."""
    cal = calibration or calibrate(runner, calib_batches, progress=progress)
    held = calibrate(
        runner, heldout_batches, progress=progress
    )  # same interventions: measured e, y and E per (unit, batch)
    preds: Dict[str, List[float]] = {"advantage_only": [], "complete_exposure": [], "psi": []}
    truth: List[float] = []
    for s in held.samples:
        preds["advantage_only"].append(s["adv_exposure"])
        preds["complete_exposure"].append(s["exposure"])
        preds["psi"].append(cal.risk(s["unit"], s["exposure"]))
        truth.append(s["grad_err"])
    k = max(1, round(len(truth) * 0.1))
    cut = sorted(truth, reverse=True)[k - 1]
    labels = [y >= cut for y in truth]
    return {
        "n_samples": len(truth),
        "predictors": {
            name: {
                "spearman": spearman(p, truth),
                "top10_recall": top_recall(p, truth),
                "auroc_top10": auroc(p, labels),
            }
            for name, p in preds.items()
        },
        "kappa": cal.kappa,
    }
