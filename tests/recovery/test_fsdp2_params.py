"""Parameters that a wrapper substitutes while a module runs (FSDP2's unsharded parameters,
ZeRO-3's gathered ones) pass the engine's hooks untouched: L never compresses a weight."""

import torch

from conftest import grads, grpo_loss, packed_microbatch, rel_err
from gloo_ranks import run_ranks  # tests/helpers
from hilore_actor.models import LoraSpec, build_model, tiny_config
from hilore_actor.recovery import RecoveryEngine
from hilore_actor.recovery.step import Step


def test_views_of_substituted_parameters_are_not_compressed(monkeypatch):
    """Each linear's weight is swapped for a fresh Parameter as it runs (as FSDP2's pre-forward
    does): its storage is not among the step's parameters, yet the transposed view F.linear
    saves is still a weight. Under L none reaches the codec; H stays bitwise, L close."""
    seed = torch.seed() % 2**31
    print("seed", seed)
    model = build_model(
        tiny_config("qwen2", hidden_size=64, num_layers=2, vocab_size=128), lora=LoraSpec(4, 8), seed=seed
    )
    model.train()
    swapped, received = [], []  # both held, so no storage address is reused while compared

    def substitute(module, args):
        w = module._parameters["weight"]
        module._parameters["weight"] = torch.nn.Parameter(w.detach().clone(), requires_grad=w.requires_grad)
        swapped.append(module._parameters["weight"])

    for layer in model.base_model.model.model.layers:
        for m in layer.modules():
            if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad:  # the frozen base weights
                m.register_forward_pre_hook(substitute)
    ids, pos = packed_microbatch(64, 128, n_seqs=2, seed=seed + 1)
    grpo_loss(model, ids, pos).backward()
    ref = grads(model)
    engine = RecoveryEngine(model)
    orig = Step.compress
    monkeypatch.setattr(
        Step,
        "compress",
        lambda self, t, u, keep_sign=False: received.append(t.untyped_storage()) or orig(self, t, u, keep_sign),
    )
    for plan, actions in (("all-h", None), ("all-l", None), ("all-h", "all-l")):
        model.zero_grad(set_to_none=True)
        swapped.clear()
        received.clear()
        with engine.step(plan) as step:
            loss = grpo_loss(model, ids, pos)
            if actions:
                step.set_actions(actions)
            loss.backward()
        g = grads(model)
        if (plan, actions) == ("all-h", None):
            assert all(torch.equal(g[n], ref[n]) for n in ref)
        else:
            weights = {p.untyped_storage()._cdata for p in swapped}
            hits = sum(s._cdata in weights for s in received)
            assert received and hits == 0, f"{plan}/{actions}: {hits} of {len(received)} compressed tensors are weights"
            assert rel_err(g, ref) < 0.05


def test_two_fsdp2_ranks_never_compress_a_weight(tmp_path):
    """Two ranks, decoder layers and root under ``fully_shard`` (``fsdp2_ranks.py``). H and R
    give plain FSDP2's gradient shard bitwise; L, planned in forward or chosen after it (an
    exact bundle compressed once FSDP2 has freed the unsharded weights), stays within L's
    tolerance and compresses activations only: never a weight view."""
    seed = torch.seed() % 2**31
    print("seed", seed)
    out = tmp_path / "fsdp2.json"
    for r in run_ranks("fsdp2_ranks.py", seed, out, out=out, timeout=600):
        print({k: (v["rel"], v["activations"], v["weights"][:3]) for k, v in r.items() if isinstance(v, dict)})
        assert r["n_grads"] > 0 and r["n_weights"] > 0
        assert r["all-h"]["equal"] and r["all-r"]["equal"]
        for name in ("all-l", "h-to-l", "online"):
            assert r[name]["weights"] == [], f"{name}: weights compressed: {r[name]['weights'][:5]}"
            assert r[name]["activations"] > 0 and r[name]["rel"] < 0.05, (name, r[name])
