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
cosine. Each parameter's gradient is taken as backward produces it (``allocation.runner``'s
``HeldGradients``; tensor hooks, since ``torch.autograd.grad`` captures rather than
accumulates): the plan's passes add it into a held sum, the exact passes into another, and
the last exact pass compares the two parameter by parameter in float64 and lets both go.
Memory beyond the update's: the plan's summed gradient (one set, in the parameters' dtype;
small with LoRA, a full fine-tune's size otherwise), with several microbatches also the
exact sum being built beside it (a second set), and one parameter's gradient in flight.

The update that follows is untouched: the random state and the online chooser's state are
restored, no peak goes to the coordinator, and the gradients are cleared. A plan whose
actions are exact (H/R) gives an error of exactly 0: a check in itself.
"""

from __future__ import annotations

from typing import Dict, List

import torch

from ..allocation.runner import GradOp, HeldGradients, token_scores
from ..recovery.policies import layer_checkpointing
from .microbatch_run import run_microbatch

OURS, EXACT = "update under the plan", "exact update"  # the held sums


def update_gradient_error(plan, engine, module, loss_fn, microbatches: List, device) -> Dict[str, float]:
    """``{"grad_rel_error", "grad_cosine"}`` of the update over ``microbatches`` under ``plan``
    (a ``RankPlanner``) run on ``engine`` (the ``RecoveryEngine`` attached to ``module``)."""
    params = [p for p in module.parameters() if p.requires_grad]
    # each rank its own microbatches: a ZeRO-3 gradient is this rank's whole one, not a slice
    sums = HeldGradients(params, zero3_slices=False)
    last = len(microbatches) - 1

    def backward(loss):  # outside the optimizer's gradient path; the hooks take each gradient
        torch.autograd.grad(loss, params, allow_unused=True)

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
            for j, mb in enumerate(microbatches):
                with sums.stream(GradOp(add=OURS, restart=j == 0), True, device):
                    with run_microbatch(plan, engine, device, mb.num_tokens, token_scores=token_scores(mb)) as rec:
                        out = loss_fn(module, mb)
                        rec.set_actions(plan, out)
                        backward(out.loss)
        restore_rng()  # the same dropout masks for the exact pass
        with layer_checkpointing(module):  # exact (bitwise no-gc) and within B, unlike storing everything
            for j, mb in enumerate(microbatches):
                op = GradOp(
                    add=EXACT, restart=j == 0, compare=OURS if j == last else None, drop=(OURS,) if j == last else ()
                )
                with sums.stream(op, True, device) as got:
                    backward(loss_fn(module, mb).loss)
        diff, dot, nb, na = got.total(sums.keys) if microbatches else (0.0,) * 4  # (exact, ours): s, r
    finally:
        sums.free()
        for p, g in zip(params, held):
            p.grad = g
        restore_rng()
    if diff == 0.0:  # also when both are zero (no advantage in any group): no error
        return {"grad_rel_error": 0.0, "grad_cosine": 1.0}
    return {"grad_rel_error": diff**0.5 / max(nb**0.5, 1e-30), "grad_cosine": dot / max((na * nb) ** 0.5, 1e-300)}
