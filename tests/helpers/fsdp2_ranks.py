"""Two FSDP2 ranks over gloo on this CPU: the engine around ``fully_shard``-ed decoder layers.

``python tests/helpers/fsdp2_ranks.py SEED OUT.json`` spawns two processes (one rank each), runs a tiny
LoRA qwen2 sharded per decoder layer and at the root, and writes what each rank saw;
``tests/recovery/test_fsdp2_params.py`` runs it with a timeout and asserts on the file.

While a layer runs, FSDP2 puts unsharded parameters (views of its all-gather buffers) on the
modules, and frees those buffers after forward. Per plan, each rank records its local gradient
shard against plain FSDP2's, and every tensor ``Step.compress`` received whose storage is one
of those buffers: such a tensor is a weight, which L must never copy (after forward, for an
H -> L switch, its storage is already freed, so it is recorded, not compressed).
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # conftest's helpers
from gloo_ranks import spawn_two, write_ranks  # noqa: E402

# plan, then the actions set after forward (None: the plan's own); "online" is the chooser's
# path: every unit stored exact in forward, then L, H or R per unit
PLANS = {
    "all-h": ("all-h", None),
    "all-r": ("all-r", None),
    "all-l": ("all-l", None),
    "h-to-l": ("all-h", "all-l"),
    "online": ("all-h", "LHRL"),
}


def sharded_model(seed: int, mesh):
    from torch.distributed.fsdp import fully_shard

    from hilore_actor.models import LoraSpec, build_model, tiny_config

    model = build_model(
        tiny_config("qwen2", hidden_size=64, num_layers=2, vocab_size=128), lora=LoraSpec(4, 8), seed=seed
    )
    model.train()
    for p in model.parameters():  # LoRA B away from zero: every LoRA gradient is nonzero
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.05)
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def watch_weights(model) -> set:
    """The storages (their C++ identity, stable while FSDP2 frees and refills them) of every
    parameter a decoder-layer module holds as it runs: FSDP2's unsharded ones."""
    seen = set()

    def pre(module, args):
        seen.update(p.untyped_storage()._cdata for p in module.parameters(recurse=False))

    for layer in model.base_model.model.model.layers:
        for m in layer.modules():
            m.register_forward_pre_hook(pre)
    return seen


def spy_compress(weights: set, log: dict):
    """Wrap ``Step.compress``: count what it encodes, and record (not encode) any weight."""
    from hilore_actor.recovery.step import Step

    orig = Step.compress

    def compress(self, t, unit, keep_sign=False):
        if t.untyped_storage()._cdata in weights or t.untyped_storage().nbytes() == 0:
            log["weights"].append(f"{unit.name} {tuple(t.shape)}")
            return t
        log["activations"] += 1
        return orig(self, t, unit, keep_sign)

    Step.compress = compress


def run(model, engine, ids, pos, plan=None, actions=None):
    from conftest import grpo_loss

    model.zero_grad(set_to_none=True)
    if engine is None:
        grpo_loss(model, ids, pos).backward()
    else:
        with engine.step(plan) as step:
            loss = grpo_loss(model, ids, pos)
            if actions is not None:
                step.set_actions(actions)
            loss.backward()
    return {n: p.grad.to_local().detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def rank_main(rank: int, world: int, port: int, seed: int, out: str) -> None:
    import faulthandler

    faulthandler.dump_traceback_later(240, exit=True)  # a hang: say where
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    from conftest import packed_microbatch
    from hilore_actor.recovery import RecoveryEngine

    model = sharded_model(seed, init_device_mesh("cpu", (world,)))
    weights = watch_weights(model)
    ids, pos = packed_microbatch(64, 128, n_seqs=2, seed=seed + 1 + rank)  # each rank its own data
    ref = run(model, None, ids, pos)
    engine = RecoveryEngine(model)
    log = {"weights": [], "activations": 0}
    spy_compress(weights, log)
    seen = {"n_grads": len(ref), "n_weights": len(weights)}
    for name, (plan, actions) in PLANS.items():
        if actions == "LHRL":
            actions = {n: "LHRL"[i % 4] for i, n in enumerate(engine.unit_names)}
        log.update(weights=[], activations=0)
        g = run(model, engine, ids, pos, plan, actions)
        num = torch.cat([(g[n] - ref[n]).flatten() for n in ref]).norm()
        seen[name] = {
            "equal": set(g) == set(ref) and all(torch.equal(g[n], ref[n]) for n in ref),
            "rel": float(num / torch.cat([r.flatten() for r in ref.values()]).norm()),
            "weights": log["weights"],
            "activations": log["activations"],
        }
    write_ranks(seen, out, world)


def main(argv) -> None:
    spawn_two(rank_main, int(argv[0]), argv[1])


if __name__ == "__main__":
    main(sys.argv[1:])
