"""Worker for test_lockstep.py: 2 CPU ranks over gloo, a tiny LoRA model under FSDP2
(``fully_shard`` per decoder layer and at the root). Rank 0 runs planning-like passes with a
``lockstep.Leader`` (a fixed map, an online chooser, gradients), rank 1 ``follow``s; rank 0
prints one JSON line. Launched with torchrun."""

import json
import os
import sys

import torch
import torch.distributed as dist


def main():
    seed = int(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    sys.path.insert(0, os.path.dirname(__file__))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hilore_actor.allocation import Runner
    from hilore_actor.learner.lockstep import Leader, finish, follow
    from hilore_actor.learner.plan import planning_microbatches
    from hilore_actor.models import LoraSpec, build_model, tiny_config
    from hilore_actor.recovery import RecoveryEngine

    model = build_model(
        tiny_config("llama", hidden_size=64, num_layers=2, vocab_size=128), lora=LoraSpec(4, 8, 0.0), seed=seed
    )
    model.train()
    with torch.no_grad():  # LoRA B not zero, the same on every rank
        gen = torch.Generator().manual_seed(seed + 1)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    mb = planning_microbatches(
        model, 1, tokens=64, seqs_per_microbatch=2, group_size=2, seed=seed, loss_options={}, device="cpu"
    )[0]
    ref = Runner(model).run(mb, "no-gc", grads=True, seed=3).grad  # unsharded, before FSDP
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    engine = RecoveryEngine(model)
    units = engine.unit_names
    plan = {n: ("exact" if i % 2 == 0 else "checkpoint") for i, n in enumerate(units)}
    chosen = {n: ("H" if i % 2 == 0 else "R") for i, n in enumerate(units)}
    out = {"units": len(units)}
    if rank == 0:
        runner = Leader(model, engine)
        passes = [("all-r", None), (plan, chosen), (plan, lambda step, loss: dict(chosen)), ("all-h", None)]
        out["grads_equal"] = []
        for method, actions in passes:
            g = runner.run(mb, method, actions, grads=True, seed=3).grad
            out["grads_equal"].append(bool(torch.allclose(g, ref, rtol=1e-5, atol=1e-7)))
        out["peak_watched"] = bool(runner.run(mb, "gc", measure_peak=True).peak_bytes > 0)
        finish({"budget": 123, "plan": plan})
    else:
        runner = Runner(model, engine)
        ran, real = [], runner.run

        def recording(mb_, method, actions=None, **kw):
            res = real(mb_, method, actions, **kw)
            ran.append(dict(res.actions))
            return res

        runner.run = recording
        state = follow(runner)
        out.update(state=state, followed=len(ran), chooser_actions=ran[2] == chosen, fixed_actions=ran[1] == chosen)
    parts = [None, None]
    dist.all_gather_object(parts, out)
    if rank == 0:
        print("RESULT " + json.dumps(parts), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
