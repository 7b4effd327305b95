"""Two gloo ranks for ``test_learner_plan_memory.py``: planning's gradient checks on sharded
full fine-tunings (no LoRA) of one tiny model.

- ``zero3``: DeepSpeed ZeRO-3 (nothing persistent), planned on ``engine.module`` in lockstep with
  ``torch.autograd.grad`` as backward, as the OpenRLHF drop-in plans; each rank's CPU peak over
  the planning (the storage meter, so planning's own meters nest), gc's pass peak, gradient sizes;
  and one comparison (``checks``) of a plan's gradient with all-R's through the held slices
  against the whole flattened gradients.
- ``fsdp2``: the same comparison on FSDP2 (``fully_shard`` per decoder layer and at the root),
  the runner's own backward: DTensor shards.

``python zero3_planning_ranks.py OUT.json TOKENS SEQS CHUNK``.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from gloo_ranks import spawn_two, start_deepspeed_rank, write_ranks  # noqa: E402

SETTINGS = dict(  # with L (calibration and validation both check gradients), one codec: fewer passes
    budget="1.10",
    budget_scope="activations",
    mode="hilore",
    codec="int8-g64",
    calibration_batches=1,
    profile_repeats=1,
    loo=False,
)


def _model():
    from hilore_actor.models import build_model, tiny_config

    model = build_model(tiny_config("llama", hidden_size=64, num_layers=2, vocab_size=512), lora=None, seed=0)
    model.train()
    return model


def _microbatches(model, n, tokens, seqs):
    from hilore_actor.learner.plan import planning_microbatches

    return planning_microbatches(
        model, n, tokens=tokens, seqs_per_microbatch=seqs, group_size=4, seed=7, loss_options={}, device="cpu"
    )


def _sizes(params):
    return [int(getattr(p, "ds_numel", p.numel())) * p.element_size() for p in params]


def checks(runner, mb) -> dict:
    """All-R's gradient held by ``GradOp`` (this rank's part), a plan with L compared with it;
    the same from the whole flattened gradients (``grads=True``)."""
    from hilore_actor.allocation.runner import GradOp

    amap = {n: ("L", "H", "R")[i % 3] for i, n in enumerate(runner.engine.unit_names)}
    runner.run(mb, "all-r", grad_op=GradOp(add="ref", restart=True), seed=1)
    held = sum(t.numel() * t.element_size() for t in runner.held.sets["ref"] if t is not None)
    diff, _, _, ref_sq = runner.run(mb, amap, grad_op=GradOp(compare="ref", drop=("ref",)), seed=1).grad_sums
    ref = runner.run(mb, "all-r", grads=True, seed=1).grad.double()
    got = runner.run(mb, amap, grads=True, seed=1).grad.double()
    for p in runner.params:
        p.grad = None
    return {
        "got": diff**0.5 / ref_sq**0.5,
        "want": float((got - ref).norm() / ref.norm()),
        "ref": ref_sq,
        "ref_want": float(ref.pow(2).sum()),
        "held": held,
        "gradients": sum(_sizes(runner.params)),
        "left": sorted(runner.held.sets),
    }


def zero3(tokens, seqs) -> dict:
    import deepspeed

    from hilore_actor.allocation import Runner
    from hilore_actor.grpo.microbatch import microbatch_loss
    from hilore_actor.learner.plan import plan_in_lockstep
    from hilore_actor.learner.settings import hilore_settings
    from hilore_actor.runtime import MemoryMeter

    model = _model()
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    eng, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    eng.train()
    module = eng.module
    params = [p for p in module.parameters() if p.requires_grad]

    def back(loss):
        return torch.autograd.grad(loss, params, allow_unused=True)

    mbs = _microbatches(module, 2, tokens, seqs)  # planning's own (the same seed and sizes)
    runner = Runner(module, backward=back)
    gc_pass = runner.run(mbs[0], "gc", measure_peak=True).peak_bytes
    found = checks(runner, mbs[0])
    runner.engine.detach()
    for p in params:
        p.grad = None
    world = torch.distributed.get_world_size()
    with MemoryMeter("cpu") as planning:
        plan = plan_in_lockstep(
            module,
            hilore_settings(**SETTINGS),
            backend="hilore",
            tokens=tokens,
            seqs_per_microbatch=seqs,
            group_size=4,
            loss_options={},
            loss_fn=microbatch_loss,
            std_loss_fn=microbatch_loss,
            device=torch.device("cpu"),
            seed=7,
            backward=back,
        )
    info = plan.info
    sizes = _sizes(params)
    return {
        "peak": planning.peak_bytes,
        "gc_update": gc_pass + sum(sizes) // world,  # gc's pass with this rank's share of the update's gradient
        "gc_pass": gc_pass,
        "top_pass": info["plan_peak_bytes"] - info["resident_bytes"],
        "largest_grad": max(sizes),
        "gradients": sum(sizes),
        "data": sum(t.numel() * t.element_size() for mb in mbs for t in vars(mb).values() if torch.is_tensor(t)),
        "grads_left": sum(p.grad is not None for p in params),
        "checks": found,
    }


def fsdp2(tokens, seqs) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hilore_actor.allocation import Runner

    model = _model()
    mb = _microbatches(model, 1, tokens, seqs)[0]
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return {"checks": checks(Runner(model), mb)}


def rank_main(rank: int, world: int, port: int, out: str, tokens: str, seqs: str, chunk: str) -> None:
    import hilore_actor.allocation.runner as runner_mod
    from hilore_actor.runtime import memory

    start_deepspeed_rank(rank, world, port, hang_seconds=300)
    memory.CPU_METER = "storage"  # planning's per-pass meters nest inside the planning's
    runner_mod.CHUNK = int(chunk)
    seen = {"zero3": zero3(int(tokens), int(seqs)), "fsdp2": fsdp2(int(tokens), int(seqs))}
    write_ranks(seen, out, world)


if __name__ == "__main__":
    spawn_two(rank_main, *sys.argv[1:5])
