"""Compiled recovery units (recovery/compiled.py) against the compiled model's plain autograd:
H, R and P bitwise, L close, token counts and actions changing without recompiling; layer
regions: H and R layers bitwise the compiled layers' own autograd, mixed layers per unit."""

import pytest
import torch

from conftest import grads, grpo_loss, packed_microbatch, rel_err
from hilore_actor.models import LoraSpec, build_model, tiny_config
from hilore_actor.recovery import RecoveryEngine
from hilore_actor.recovery.compiled import compile_units, uncompile_units

VOCAB = 128
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def compiled_tiny(arch, seed):
    model = build_model(
        tiny_config(arch, hidden_size=64, num_layers=2, vocab_size=VOCAB),
        lora=LoraSpec(rank=4, alpha=8, dropout=0.0),
        seed=seed,
    )
    model.train()
    engine = RecoveryEngine(model)
    assert compile_units(engine) == 8  # two norms, attention and MLP per layer
    return model, engine


def run(model, ids, pos, engine=None, plan=None, actions=None, regions=False):
    model.zero_grad(set_to_none=True)
    if engine is None:
        grpo_loss(model, ids, pos).backward()
        return grads(model)
    with engine.step(plan, regions=regions) as step:
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
    for plan, actions in [
        ("all-h", None),
        ("all-r", None),
        ("all-p", None),
        (None, {n: "HR"[i % 2] for i, n in enumerate(names)}),
    ]:
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
    for t in (96, 64):  # 96 first: the static graphs of the tests before (inductor's cache)
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


def test_each_unit_graph_runs_under_its_activation_budget(monkeypatch, fresh_seed):
    """``compile_units`` hands inductor's partitioner its activation budget on every unit call
    (torch.compile replaced by a recording identity: nothing is compiled), leaves torch's own
    setting as it was, and refuses a budget outside [0, 1]."""
    import torch._functorch.config as fconf

    print("seed", fresh_seed)
    seen = []

    def recording_compile(fn, **_):
        def call(*args, **kwargs):
            seen.append(fconf.activation_memory_budget)
            return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(torch, "compile", recording_compile)
    model = build_model(tiny_config("llama", hidden_size=64, num_layers=2, vocab_size=VOCAB), seed=fresh_seed)
    engine = RecoveryEngine(model)
    with pytest.raises(ValueError, match=r"\[0, 1\], got 1.5"):
        compile_units(engine, activation_budget=1.5)
    before = fconf.activation_memory_budget
    assert compile_units(engine, activation_budget=0.25) == 8
    ids, pos = packed_microbatch(48, VOCAB, n_seqs=2, seed=fresh_seed)
    run(model, ids, pos, engine, "all-h")
    assert len(seen) == 8 and set(seen) == {0.25}
    assert fconf.activation_memory_budget == before


def saved_exact_bytes(model, ids, pos, engine, plan):
    model.zero_grad(set_to_none=True)
    with engine.step(plan) as step:
        loss = grpo_loss(model, ids, pos)
        held = sum(b["exact"] for b in step.bytes_by_unit().values())
        loss.backward()
    return held, grads(model)


@pytest.mark.slow
def test_a_lower_activation_budget_keeps_fewer_bytes_and_stays_exact(fresh_seed):
    """At activation budget 0 every unit graph saves less under H than at 1, and H and R stay
    bitwise equal to the compiled model's own autograd at that budget."""
    print("seed", fresh_seed)
    ids, pos = packed_microbatch(96, VOCAB, n_seqs=3, seed=fresh_seed)
    held = {}
    for budget in (1.0, 0.0):
        torch._dynamo.reset()  # compiled graphs do not key on the partitioner's settings
        model = build_model(
            tiny_config("llama", hidden_size=64, num_layers=2, vocab_size=VOCAB),
            lora=LoraSpec(rank=4, alpha=8, dropout=0.0),
            seed=fresh_seed,
        )
        model.train()
        engine = RecoveryEngine(model)
        compile_units(engine, activation_budget=budget)
        ref = run(model, ids, pos)
        held[budget], g = saved_exact_bytes(model, ids, pos, engine, "all-h")
        assert all(torch.equal(g[n], ref[n]) for n in ref), f"H differs from compiled no-gc at {budget}"
        g = run(model, ids, pos, engine, "all-r")
        assert all(torch.equal(g[n], ref[n]) for n in ref), f"R differs from compiled no-gc at {budget}"
    print("H bytes by activation budget", held)
    assert held[0.0] < held[1.0]


def regions_tiny(seed, layers=2):
    model = build_model(
        tiny_config("llama", hidden_size=64, num_layers=layers, vocab_size=VOCAB),
        lora=LoraSpec(rank=4, alpha=8, dropout=0.0),
        seed=seed,
    )
    model.train()
    engine = RecoveryEngine(model)
    assert compile_units(engine, layer_regions=True) == 4 * layers + layers  # 4 unit modules a layer
    return model, engine


def test_layer_regions_keep_h_and_r_bitwise_and_mixed_layers_per_unit(fresh_seed):
    """Outside a step every layer runs its compiled region (no-gc), under HF's checkpointing
    too (gc+compile); a planned step runs all-H and all-R layers as that region (bitwise the
    same gradients, nothing filed under their units) and a mixed layer through its units."""
    from hilore_actor.recovery import apply_baseline

    print("seed", fresh_seed)
    torch._dynamo.reset()
    model, engine = regions_tiny(fresh_seed)
    ids, pos = packed_microbatch(96, VOCAB, n_seqs=3, seed=fresh_seed)
    ref = run(model, ids, pos)
    apply_baseline(model, "gc")
    try:
        g = run(model, ids, pos)
    finally:
        apply_baseline(model, "no-gc")
    assert all(torch.equal(g[n], ref[n]) for n in ref), "gc over the layer regions differs from their no-gc"
    for plan in ("all-h", "all-r"):
        g = run(model, ids, pos, engine, plan, regions=True)
        assert all(torch.equal(g[n], ref[n]) for n in ref), f"{plan} in layer regions differs from compiled no-gc"
    names = engine.unit_names  # layer 0: both exact (a region); layer 1: exact + checkpoint (per unit)
    mixed = {names[0]: "exact", names[1]: "exact", names[2]: "exact", names[3]: "checkpoint"}
    model.zero_grad(set_to_none=True)
    with engine.step(mixed, regions=True) as step:
        loss = grpo_loss(model, ids, pos)
        counts = step.saved_counts()
        loss.backward()
    print("saved per unit", counts)
    assert counts[names[0]] == counts[names[1]] == 0 and counts[names[2]] > 0 and counts[names[3]] > 0
    err = rel_err(grads(model), ref)
    print("mixed plan vs the layer regions' no-gc", err)
    assert err < 1e-4  # per-unit regions fuse differently from the layer's: not bitwise, float rounding only


def test_an_h_region_keeps_its_units_h_and_the_knapsack_knows(fresh_seed):
    """After forward an H region's units cannot become L or R (their tensors were never the
    engine's); ``region_units`` names them for the online chooser; without regions they can."""
    from hilore_actor.recovery.compiled import region_units

    print("seed", fresh_seed)
    torch._dynamo.reset()
    model, engine = regions_tiny(fresh_seed)
    names = engine.unit_names
    plan = {names[0]: "exact", names[1]: "exact", names[2]: "exact", names[3]: "compressed"}
    assert region_units(engine, plan) == set(names[:2])
    assert region_units(engine, {n: "checkpoint" for n in names}) == set()
    ids, pos = packed_microbatch(96, VOCAB, n_seqs=2, seed=fresh_seed)  # the graphs of the tests before
    with engine.step(plan, regions=True) as step:
        loss = grpo_loss(model, ids, pos)
        with pytest.raises(ValueError, match="one compiled region"):
            step.set_actions({names[0]: "L"})
    with engine.step(plan) as step:  # no regions: every exact unit may still become L
        loss = grpo_loss(model, ids, pos)
        step.set_actions({names[0]: "L"})
        loss.backward()


def test_the_online_choice_keeps_h_regions_and_fits_the_rest_into_what_they_leave(fresh_seed):
    """An H region's units are H before the knapsack runs: they leave it (it needs R per item)
    and their bytes leave the budget; the other units are chosen in what remains, as a brute
    force over their H/R choices picks."""
    import itertools

    from hilore_actor.allocation import Planner, Runner
    from hilore_actor.allocation.profiling import UnitCosts

    print("seed", fresh_seed)
    gen = torch.Generator().manual_seed(fresh_seed)
    model, engine = regions_tiny(fresh_seed, layers=3)
    names = engine.unit_names
    hl = Planner(Runner(model, engine), 10**12, None, Planner.Config(mode="hilore-hr", loo=False), log=lambda *a: None)
    dm = {n: int(torch.randint(1000, 5000, (1,), generator=gen)) for n in names}
    dtau = {n: float(torch.rand(1, generator=gen)) for n in names}
    costs = UnitCosts("t", 1.0, 0, dtau={n: {"H": dtau[n]} for n in names}, dm={n: {"H": dm[n]} for n in names})
    plan = {n: "exact" for n in names}
    plan[names[5]] = "compressed"  # the last layer runs per unit: only layers 0 and 1 are H regions
    held = sum(dm[n] for n in names[:4])
    for room in (held - 1, held + dm[names[4]] // 2, held + dm[names[4]], held + 10**6):
        actions = hl.allocate(costs, {}, room, 0.0, plan=plan)
        assert all(actions[n] == "H" for n in names[:4]), (room, actions)
        assert actions[names[5]] == "R"  # "compressed" admits L alone, which hilore-hr does not offer
        free = names[4:5]
        best = max(
            (
                c
                for c in itertools.product("HR", repeat=len(free))
                if held + sum(dm[n] for n, a in zip(free, c) if a == "H") <= max(room, held)
            ),
            key=lambda c: sum(dtau[n] for n, a in zip(free, c) if a == "H"),
        )
        assert tuple(actions[n] for n in free) == best, (room, actions, best)
    assert all(a == "H" for a in hl.allocate(costs, {}, held + 10**6, 0.0).values())  # no plan: no region fixed


def test_layer_regions_reuse_their_graphs_and_uncompile(fresh_seed):
    """After two token counts, a third count, H and R regions, per-unit plans and gc compile
    nothing new; a layer whose submodule carries a foreign hook keeps per-unit regions; uncompiling
    restores every forward."""
    from hilore_actor.recovery import apply_baseline

    print("seed", fresh_seed)
    torch._dynamo.reset()
    model, engine = regions_tiny(fresh_seed)
    for t in (96, 64):  # 96 first: the static graphs of the tests before (inductor's cache)
        ids, pos = packed_microbatch(t, VOCAB, n_seqs=2, seed=fresh_seed)
        for plan in ("all-h", "all-r", "all-l"):
            run(model, ids, pos, engine, plan, regions=True)
        run(model, ids, pos)
    before = frames()
    ids, pos = packed_microbatch(80, VOCAB, n_seqs=2, seed=fresh_seed + 1)
    for plan in ("all-h", "all-r", "all-l", "all-p"):
        run(model, ids, pos, engine, plan, regions=True)
    apply_baseline(model, "gc")
    try:
        run(model, ids, pos)
    finally:
        apply_baseline(model, "no-gc")
    assert frames() == before, "a new token count, plan or gc compiled again"
    uncompile_units(engine)
    layer = model.base_model.model.model.layers[0]
    assert "forward" not in vars(layer) and not engine.region_layers
    layer.mlp.act_fn.register_forward_hook(lambda *_: None)
    with pytest.warns(UserWarning, match="keeps per-unit compiled regions"):
        compile_units(engine, layer_regions=True)
    assert engine.region_layers == {id(model.base_model.model.model.layers[1])}
