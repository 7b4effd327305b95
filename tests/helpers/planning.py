"""A rank's planning before DeepSpeed (``learner.plan.plan_before_wrapping``) on a tiny model on
this CPU, for the tests that plan: groups of 4, no loss options."""

import torch

from hilore_actor.grpo.microbatch import microbatch_loss
from hilore_actor.learner.plan import plan_before_wrapping


def plan_on_cpu(
    model, hcfg, tokens: int, seqs: int, seed: int, loss_fn=microbatch_loss, log=lambda *_: None, backend="hilore"
):
    """The plan for microbatches of ``tokens`` tokens in ``seqs`` sequences; ``loss_fn`` plans
    (the standard loss is the reference), ``log`` takes planning's lines; ``backend`` gc: B alone."""
    return plan_before_wrapping(
        model,
        hcfg,
        backend=backend,
        tokens=tokens,
        seqs_per_microbatch=seqs,
        group_size=4,
        loss_options={},
        loss_fn=loss_fn,
        std_loss_fn=microbatch_loss,
        device=torch.device("cpu"),
        seed=seed,
        log=log,
    )
