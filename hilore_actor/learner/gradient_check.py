"""How far an update's gradient under HiLoRe is from the exact one (``--measure_grad_error``).

L keeps some activations in low precision, so the gradient an update applies differs from
the gradient with every activation stored. This measures by how much on the update's own
microbatches and weights, beside training: the microbatches run twice outside the
optimizer's gradient path (``torch.autograd.grad``, so no ZeRO hook or accumulation sees
them), once under the rank's plan exactly as the update runs them (the plan sized to each
microbatch's tokens and its online actions, ``step.run_microbatch``), once exactly (every
layer recomputed: bitwise the gradients of storing everything, and within B, which storing
everything is not on a device the plan fills); the two accumulated gradients give the
relative error ``||g - g*|| / ||g*||`` (the quantity the risk budget delta bounds) and the
cosine. Memory beyond the update's: two gradient copies of the trainable parameters (small
with LoRA; a full fine-tune's size otherwise).

The update that follows is untouched: the random state and the online chooser's state are
restored, no peak goes to the coordinator, and the gradients are cleared. A plan whose
actions are exact (H/R) gives an error of exactly 0: a check in itself.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from ..allocation.runner import token_scores
from ..recovery.policies import layer_checkpointing
from .microbatch_run import run_microbatch


def update_gradient_error(plan, engine, module, loss_fn, microbatches: List, device) -> Dict[str, float]:
    """``{"grad_rel_error", "grad_cosine"}`` of the update over ``microbatches`` under ``plan``
    (a ``RankPlanner``) run on ``engine`` (the ``RecoveryEngine`` attached to ``module``)."""
    params = [p for p in module.parameters() if p.requires_grad]

    def accumulate(loss):
        for p, g in zip(params, torch.autograd.grad(loss, params, allow_unused=True)):
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g

    def take() -> List[torch.Tensor]:  # the gradients, per parameter, cleared from .grad
        out = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        for p in params:
            p.grad = None
        return out

    cuda = device.type == "cuda"
    rng = torch.random.get_rng_state(), (torch.cuda.get_rng_state(device) if cuda else None)

    def restore_rng():
        torch.random.set_rng_state(rng[0])
        if cuda:
            torch.cuda.set_rng_state(rng[1], device)

    held = [p.grad for p in params]  # whatever .grad holds now is not the update's: put back after
    for p in params:
        p.grad = None
    try:
        with plan.planner.side_pass():
            for mb in microbatches:
                with run_microbatch(plan, engine, device, mb.num_tokens, token_scores=token_scores(mb)) as rec:
                    out = loss_fn(module, mb)
                    rec.set_actions(plan, out)
                    accumulate(out.loss)
        ours = take()
        restore_rng()  # the same dropout masks for the exact pass
        with layer_checkpointing(module):  # exact (bitwise no-gc) and within B, unlike storing everything
            for mb in microbatches:
                accumulate(loss_fn(module, mb).loss)
        exact = take()
    finally:
        for p, g in zip(params, held):
            p.grad = g
        restore_rng()
    diff, dot, na, nb = _sums(ours, exact)
    if diff == 0.0:  # also when both are zero (no advantage in any group): no error
        return {"grad_rel_error": 0.0, "grad_cosine": 1.0}
    return {"grad_rel_error": diff**0.5 / max(nb**0.5, 1e-30), "grad_cosine": dot / max((na * nb) ** 0.5, 1e-300)}


def _sums(ours: List[torch.Tensor], exact: List[torch.Tensor], chunk: int = 1 << 22) -> Tuple[float, ...]:
    """``||a - b||^2``, ``<a, b>``, ``||a||^2``, ``||b||^2`` over all parameters in float64 (a
    cosine this close to 1 needs it), in chunks of ``chunk`` elements, so no copy larger than
    a chunk is made, and summed on the device: one sync at the end."""
    acc = torch.zeros(4, dtype=torch.float64, device=ours[0].device if ours else "cpu")
    for a, b in zip(ours, exact):
        a, b = a.detach().reshape(-1), b.detach().reshape(-1)
        for i in range(0, a.numel(), chunk):
            x, y = a[i : i + chunk].double(), b[i : i + chunk].double()
            acc += torch.stack([(x - y).pow(2).sum(), (x * y).sum(), x.pow(2).sum(), y.pow(2).sum()])
    return tuple(acc.tolist())
