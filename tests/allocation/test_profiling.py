"""Unit costs within a budget: bytes measured on prefixes and scaled to the whole microbatch
agree with bytes measured on the whole one, and no profiling pass peaks above the room."""

import pytest
import torch

from hilore_actor.allocation import Runner, resolve_budget
from hilore_actor.allocation.profiling import profile_units, scaled
from hilore_actor.models import LoraSpec, build_model, tiny_config
from hilore_actor.workloads import replayed_microbatches


@pytest.fixture(scope="module")
def setup():
    seed = torch.seed() % 2**31
    print("seed", seed)
    cfg = tiny_config(
        "qwen2", hidden_size=128, intermediate_size=704, num_layers=3, num_heads=4, num_kv_heads=2, vocab_size=4096
    )
    model = build_model(cfg, lora=LoraSpec(8, 16), seed=seed)
    model.train()
    mb = replayed_microbatches(model, 1, 1024, seed=seed)[0]
    runner = Runner(model)
    budget = resolve_budget(1.10, runner.run(mb, "gc", measure_peak=True).peak_bytes, 0)
    return runner, mb, budget


def test_prefix_probes_match_the_whole_microbatch(setup):
    runner, mb, budget = setup
    whole = profile_units(runner, mb, repeats=1)
    assert runner.run(mb, "all-h", measure_peak=True).peak_bytes > budget  # all-H itself would not fit
    with runner.watching() as peaks:
        capped = profile_units(runner, mb, repeats=1, room=budget)
    print(
        f"probes {capped.probe_tokens}; bytes off a line by {capped.bytes_linear_error:.4f}; "
        f"peaks/B {[round(p / budget, 3) for p in peaks]}"
    )
    assert max(capped.probe_tokens) < mb.num_tokens and len(capped.probe_tokens) >= 2
    assert max(peaks) <= budget
    assert capped.base_peak == whole.base_peak
    for n in whole.dm:
        for a in ("H", "L"):
            assert capped.dm[n][a] == pytest.approx(whole.dm[n][a], rel=0.01), (n, a)


def test_scaled_is_exact_on_quadratic_bytes_and_reports_the_curvature():
    def probe(t):
        return {"H": {"u": 100 + 8 * t + t * t / 64}, "L": {"u": 2 * t}, "codec|L": {"u": 1e-6 * t}, "mixed": {}}

    est, off_line = scaled({t: probe(t) for t in (64, 256, 512)}, 2048)
    assert est["H"]["u"] == pytest.approx(probe(2048)["H"]["u"]) and est["L"]["u"] == pytest.approx(4096)
    assert est["codec|L"]["u"] == pytest.approx(2048e-6) and off_line > 0.01
    one, _ = scaled({256: probe(256)}, 1024)
    assert one["L"]["u"] == pytest.approx(2048)  # one probe: proportional


def test_partial_costs_and_a_plan_that_takes_p(setup):
    """P's profiled costs: an MLP unit keeps fewer bytes than under H and its P replay saves
    part of its R replay; with P offered and room for the P bytes of every unit but not the
    H bytes, the knapsack takes a partial option (P or P:core) somewhere, and that plan's
    gradients equal all-R's bitwise. Which one depends on the measured times: an attention
    unit's H plus P:core can beat the MLP units' P on a noisy machine."""
    from hilore_actor.allocation import Planner

    runner, mb, budget = setup
    costs = profile_units(runner, mb, repeats=1, partial=True)
    for n in costs.dm:
        print(
            n,
            {a: v >> 10 for a, v in costs.dm[n].items()},
            "KiB;",
            {a: round(v, 4) for a, v in costs.dtau[n].items()},
            "s",
        )
        assert costs.dm[n]["P"] > 0 and 0.0 <= costs.dtau[n]["P"] <= costs.dtau[n]["H"] * 1.5
        if n.endswith("mlp"):  # no attention kernel: P:core would keep nothing, so it is no option
            assert costs.dm[n]["P"] < costs.dm[n]["H"] and "P:core" not in costs.dm[n]
        else:  # the kernel's outputs alone: fewer bytes than P's
            assert (
                0 < costs.dm[n]["P:core"] < costs.dm[n]["P"]
                and 0.0 <= costs.dtau[n]["P:core"] <= costs.dtau[n]["H"] * 1.5
            )
    hl = Planner(runner, 10**12, None, Planner.Config(mode="hilore-hr", partial=True, loo=False), log=lambda *a: None)
    room = sum(costs.dm[n]["P"] for n in costs.dm if n.endswith("mlp")) * 1.01
    actions = hl.allocate(costs, {}, room, 0.0)
    print(actions)
    assert any(a in ("P", "P:core") for a in actions.values())
    g_p = runner.run(mb, {n: a for n, a in actions.items()}, grads=True).grad
    g_r = runner.run(mb, "all-r", grads=True).grad
    assert torch.equal(g_p, g_r)


def test_partial_savings_within_a_cap_are_measured_on_the_whole_microbatch(setup):
    """Within B the probes are short prefixes; P's saving is then measured on the whole
    microbatch for a few units of each kind (the rest R), with no pass above B, and every
    unit's P saving is its kind's measured share of its own R replay time."""
    runner, mb, budget = setup
    with runner.watching() as peaks:
        costs = profile_units(runner, mb, repeats=1, room=budget, partial=True)
    print("probes", costs.probe_tokens, "shares", costs.partial_share, "peaks/B", [round(p / budget, 3) for p in peaks])
    assert max(costs.probe_tokens) < mb.num_tokens and max(peaks) <= budget
    assert set(costs.partial_share) == {"P", "P:core"} and "attn" in costs.partial_share["P:core"]
    assert "mlp" not in costs.partial_share["P:core"]  # it keeps nothing of an MLP unit: not measured
    for a, shares in costs.partial_share.items():
        assert all(0.0 <= s <= 1.0 for s in shares.values())
        for n in costs.dtau:
            kind = "attn" if n.endswith("self_attn") else "mlp"
            if kind in shares:  # an MLP unit's P may not fit half the room left above all-R
                assert costs.dtau[n][a] == pytest.approx(shares[kind] * costs.dtau[n]["H"])


def test_an_attention_unit_before_an_expert_block_pays_for_the_blocks_input():
    """Keeping a layer's attention while its expert block is R breaks the layer's joint replay:
    the block then keeps its own input, which the attention unit's H bytes include (``mixed``),
    for MoE layers as for dense ones."""
    from hilore_actor.allocation.profiling import _bytes_at

    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = build_model(cfg, seed=0).train()
    runner = Runner(model)
    assert [u.kind for u in runner.engine.layer_specs[0].units] == ["attn", "moe"]
    mb = replayed_microbatches(model, 1, 128, seed=0)[0]
    mixed = _bytes_at(runner, mb, 1, ("L",))["mixed"]
    attn = [u.name for layer in runner.engine.layer_specs for u in layer.units if u.kind == "attn"]
    assert sorted(mixed) == sorted(attn) and all(v >= 64 * 128 * 4 for v in mixed.values())  # one hidden-state tensor


def test_a_parameter_without_gradient_counts_as_zeros_in_the_flat_gradient(setup):
    """A trainable parameter the loss never reaches (BERT's pooler, an unused embedding) is
    zeros of its size in the runner's flat gradient, not a shape the concatenation refuses."""
    runner, mb, _ = setup
    extra = torch.nn.Parameter(torch.ones(3, 5))
    runner.params.append(extra)
    try:
        g = runner.run(mb, "all-r", grads=True).grad
    finally:
        runner.params.pop()
    assert g.shape == (sum(p.numel() for p in runner.params) + 15,) and torch.all(g[-15:] == 0)
