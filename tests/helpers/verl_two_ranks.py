"""Two FSDP2 ranks over gloo on this CPU: verl's engine and HiLoRe's, planned in lockstep (the
case ``lockstep`` of ``verl_ranks.py``; a planning pass one rank skipped would hang both in a
collective; ``tests/verl/test_verl.py`` asserts on what the ranks saw).

Per rank: verl's engine with its gradient checkpointing and HiLoRe's engine in mode hilore-hr,
then in mode hilore (rank 0 plans, rank 1 replays: ``learner/lockstep.py``); one
``forward_backward_batch`` each on that rank's own GRPO batch; the whole (reduced) LoRA
gradient; then hilore-hr again with rank 1 forced all-R while rank 0 keeps its H/R plan, so
the ranks take different actions in the same step.
"""

import os

import torch

import verl_cpu


def lockstep(rank: int, path: str, seed: int) -> dict:
    from hilore_actor.verl import verify
    from hilore_actor.verl.settings import CONFIG_ENV

    vocab = verl_cpu.TINY["vocab_size"]
    td = verify.grpo_batch(seed + 100 + rank, vocab=vocab, full=True)  # each rank its own data
    loss_fn = verify.ppo_loss_fn()

    def build(kind, budget="1.2"):
        try:
            return verify.build_engine(
                kind, path, seed, settings={**verl_cpu.SETTINGS, "budget": budget}, job=verl_cpu.JOB
            )
        finally:
            os.environ.pop(CONFIG_ENV, None)

    ref = verify.batch_gradient(build("verl"), td.clone(), loss_fn)
    seen = {}
    for kind, budget in (("hilore-hr", "1.2"), ("hilore", "1.4")):
        engine = build(kind, budget)
        g = verify.batch_gradient(engine, td.clone(), loss_fn)
        mb = engine.hilore
        seen[kind] = {
            "equal": bool(torch.equal(g, ref)),
            "rel": float((g - ref).norm() / ref.norm()),
            "plan": {k: v for k, v in mb.plan.sp.plan.items()},
            "budget": mb.plan.budget,
            "counts": mb.last["counts"],
            "peaks": list(mb.batch_peaks),
        }
        if kind == "hilore-hr":
            if rank == 1:  # this rank recomputes everything; rank 0 keeps its mixed plan
                mb._choose = lambda rec, loss, held, data: {n: "R" for n in rec.sp.plan}
            g2 = verify.batch_gradient(engine, td.clone(), loss_fn)
            seen["divergent"] = {"equal": bool(torch.equal(g2, ref)), "counts": mb.last["counts"]}
    return seen
