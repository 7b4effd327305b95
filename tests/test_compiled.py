"""Compiled recovery units (recovery/compiled.py) against the compiled model's plain autograd:
H, R and P bitwise, L close, token counts and actions changing without recompiling."""
import pytest
import torch

from conftest import grads, grpo_loss, packed_microbatch, rel_err
from hilore_actor.models import LoraSpec, build_model, tiny_config
from hilore_actor.recovery import RecoveryEngine
from hilore_actor.recovery.compiled import compile_units, uncompile_units

VOCAB = 128
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def compiled_tiny(arch, seed):
    model = build_model(tiny_config(arch, hidden_size=64, num_layers=2, vocab_size=VOCAB),
                        lora=LoraSpec(rank=4, alpha=8, dropout=0.0), seed=seed)
    model.train()
    engine = RecoveryEngine(model)
    assert compile_units(engine) == 8  # two norms, attention and MLP per layer
    return model, engine


def run(model, ids, pos, engine=None, plan=None, actions=None):
    model.zero_grad(set_to_none=True)
    if engine is None:
        grpo_loss(model, ids, pos).backward()
        return grads(model)
    with engine.step(plan) as step:
        loss = grpo_loss(model, ids, pos)
        if actions is not None:
            step.set_actions(actions)
        loss.backward()
    return grads(model)


def frames():
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("arch", ["llama", pytest.param("qwen2", marks=pytest.mark.slow)])
def test_h_r_p_bitwise_and_l_close_on_compiled_units(arch, fresh_seed):
    print("seed", fresh_seed)
    torch._dynamo.reset()
    model, engine = compiled_tiny(arch, fresh_seed)
    ids, pos = packed_microbatch(96, VOCAB, n_seqs=3, seed=fresh_seed)
    ref = run(model, ids, pos)  # the compiled model's own autograd (no engine step)
    names = engine.unit_names
    mixed = {n: ("exact", "checkpoint", "partial", "compressed")[i % 4] for i, n in enumerate(names)}
    for plan, actions in [("all-h", None), ("all-r", None), ("all-p", None), (None, {n: "HR"[i % 2] for i, n in enumerate(names)})]:
        g = run(model, ids, pos, engine, plan, actions)
        assert all(torch.equal(g[n], ref[n]) for n in ref), f"{plan}/{actions} differs from compiled no-gc"
    g = run(model, ids, pos, engine, "all-l")
    err = rel_err(g, ref)
    print("all-l rel err", err)
    assert 0 < err < 0.05
    g = run(model, ids, pos, engine, mixed)  # H, R, P and L in one microbatch
    assert 0 < rel_err(g, ref) < 0.05


def test_token_counts_and_actions_change_without_recompiling(fresh_seed):
    """After two token counts (static, then dynamic graphs), a third count and every action
    reuse the compiled graphs; uncompiling gives back the eager forward."""
    print("seed", fresh_seed)
    torch._dynamo.reset()
    model, engine = compiled_tiny("llama", fresh_seed)
    for t in (64, 96):
        ids, pos = packed_microbatch(t, VOCAB, n_seqs=2, seed=fresh_seed)
        run(model, ids, pos, engine, "all-h")
    before = frames()
    assert before >= 3  # norm, attention, MLP graphs at least (the counter counts compiles)
    ids, pos = packed_microbatch(80, VOCAB, n_seqs=2, seed=fresh_seed + 1)
    for plan in ("all-h", "all-r", "all-l", "all-p"):
        run(model, ids, pos, engine, plan)
    assert frames() == before, "a new token count or action compiled again"
    uncompile_units(engine)
    assert "forward" not in model.base_model.model.model.layers[0].mlp.__dict__ and not engine.compiled
