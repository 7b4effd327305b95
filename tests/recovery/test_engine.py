"""The recovery engine against plain autograd (no-gc): H and R bitwise, L close."""

import contextlib
import warnings

import pytest
import torch

from conftest import downgrade_peaks, grads, grpo_loss, packed_microbatch, rel_err
from hilore_actor.models import ARCHS, LoraSpec, build_model, tiny_config
from hilore_actor.recovery import RecoveryEngine, apply_baseline
from hilore_actor.recovery.state import tensors
from hilore_actor.recovery.step import Step
from hilore_actor.runtime import MemoryMeter

LORAS = {
    "full": None,
    "lora": LoraSpec(rank=4, alpha=8, dropout=0.0),
    "lora-dropout": LoraSpec(rank=4, alpha=8, dropout=0.1),
}
VOCAB = 128
CODECS = ("int8", "int8-g64", "int8-outlier", "bf16", "fp8-e4m3", "fp8-e4m3-b32", "fp8-e5m2")
# Cross-products cut to what each property needs. Bitwise H/R/gc and P: every architecture under
# LoRA with dropout (its masks replayed), no LoRA and LoRA without dropout on one architecture.
EXACT_CASES = [(a, "lora-dropout") for a in ARCHS] + [("qwen2", "full"), ("qwen2", "lora")]
# All-L: every codec on one architecture under LoRA with dropout (the codec sets the error), every
# architecture under the default codec, no LoRA under the default and the coarsest codec.
ALL_L_CASES = (
    [("qwen2", "lora-dropout", c) for c in CODECS]
    + [(a, "lora-dropout", "int8") for a in ARCHS if a != "qwen2"]
    + [("qwen2", "full", "int8"), ("qwen2", "full", "fp8-e5m2")]
)


def tiny(arch, lora, layers=2, hidden=64):
    m = build_model(
        tiny_config(arch, hidden_size=hidden, num_layers=layers, vocab_size=VOCAB),
        lora=LORAS[lora],
        seed=torch.seed() % 2**31,
    )
    m.train()
    return m


def run(model, ids, pos, engine=None, plan=None, actions=None, rng_seed=1234):
    """fwd + GRPO loss + bwd under a fixed RNG seed (LoRA dropout draws the same masks)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(rng_seed)
    if engine is None:
        grpo_loss(model, ids, pos).backward()
        return grads(model), None
    with engine.step(plan) as step:
        loss = grpo_loss(model, ids, pos)
        if actions is not None:
            step.set_actions(actions)
        loss.backward()
    return grads(model), step


@pytest.mark.parametrize("arch, lora", EXACT_CASES)
def test_h_r_and_gc_are_bitwise_no_gc(arch, lora):
    model = tiny(arch, lora)
    ids, pos = packed_microbatch(96, VOCAB, n_seqs=3)
    ref, _ = run(model, ids, pos)
    engine = RecoveryEngine(model)
    assert len(engine.unit_names) == 4 and engine.unit_names[1] == "model.layers.0.mlp"
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    random_map = {n: "HR"[int(b)] for n, b in zip(engine.unit_names, torch.randint(0, 2, (4,), generator=gen))}
    two_phase = {n: ("R" if i % 2 else "H") for i, n in enumerate(engine.unit_names)}
    for plan, actions in [("all-h", None), ("all-r", None), (random_map, None), (None, two_phase), (None, "all-r")]:
        g, _ = run(model, ids, pos, engine, plan, actions)
        for n in ref:
            assert torch.equal(g[n], ref[n]), f"{plan}/{actions}: {n} differs"
    engine.detach()
    apply_baseline(model, "gc")
    g, _ = run(model, ids, pos)
    assert all(torch.equal(g[n], ref[n]) for n in ref), "gc differs from no-gc"


def test_gc_where_transformers_has_none_checkpoints_each_layer():
    """A model class without HF gradient checkpointing: gc is torch's checkpoint per decoder
    layer: each layer's forward runs again in backward, gradients bitwise no-gc's; no-gc undoes it."""
    model = tiny("qwen2", "full")
    ids, pos = packed_microbatch(96, VOCAB, n_seqs=3)
    ref, _ = run(model, ids, pos)
    type(model).supports_gradient_checkpointing = False
    try:
        calls = []
        hooks = [
            m.self_attn.register_forward_pre_hook(lambda *_, i=i: calls.append(i))
            for i, m in enumerate(model.model.layers)
        ]
        apply_baseline(model, "gc")
        g, _ = run(model, ids, pos)
        assert all(torch.equal(g[n], ref[n]) for n in ref), "torch's layer checkpointing differs from no-gc"
        n = len(model.model.layers)
        assert len(calls) == 2 * n and sorted(calls[n:]) == list(range(n))  # forward, then each layer again
        apply_baseline(model, "no-gc")
        calls.clear()
        run(model, ids, pos)
        assert len(calls) == n and not any("forward" in vars(m) for m in model.model.layers)
        for h in hooks:
            h.remove()
    finally:
        del type(model).supports_gradient_checkpointing


def _held(model, engine, ids, pos, plan, shared=False):
    """Bytes each unit holds between forward and backward under ``plan`` (``Step.bytes_by_unit``)."""
    model.zero_grad(set_to_none=True)
    with engine.step(plan) as st:
        loss = grpo_loss(model, ids, pos)
        st.set_actions()
        held = st.bytes_by_unit(shared=shared)
        loss.backward()
    return held


def _held_bytes(model, engine, ids, pos, plans):
    """{plan: bytes each unit holds, as if held alone}."""
    return {plan: _held(model, engine, ids, pos, plan) for plan in plans}


@pytest.mark.parametrize("arch, lora", [c for c in EXACT_CASES if c[1] != "lora"])
def test_p_is_bitwise_no_gc_and_keeps_part_of_a_bundle(arch, lora):
    """P (plan ``partial``): the unit keeps its matmul and attention-kernel outputs and
    replays the rest from them: gradients bitwise no-gc, alone, mixed with H and R, and
    sent to R after forward; an MLP unit keeps fewer bytes than under H."""
    seed = torch.seed() % 2**31
    print("seed", seed)
    model = tiny(arch, lora)
    ids, pos = packed_microbatch(96, VOCAB, n_seqs=3)
    ref, _ = run(model, ids, pos)
    engine = RecoveryEngine(model)
    gen = torch.Generator().manual_seed(seed)
    mixed = {n: "HPR"[int(b)] for n, b in zip(engine.unit_names, torch.randint(0, 3, (4,), generator=gen))}
    first_r = {n: ("R" if i == 0 else "P") for i, n in enumerate(engine.unit_names)}
    for plan, actions in [("all-p", None), (mixed, None), ("all-p", first_r), ("all-p", "all-r")]:
        g, step = run(model, ids, pos, engine, plan, actions)
        for n in ref:
            assert torch.equal(g[n], ref[n]), f"{plan}/{actions}: {n} differs"
    held = _held_bytes(model, engine, ids, pos, ("all-h", "all-p"))
    for n in engine.unit_names:
        h, p = held["all-h"][n], held["all-p"][n]
        print(n, "H", h, "P", p)
        assert p["exact"] == 0 and p["partial"] > 0
        if n.endswith("mlp"):
            assert p["partial"] + p["checkpoint"] < h["exact"] + h["checkpoint"]


@pytest.mark.parametrize("arch", ARCHS)
def test_p_core_keeps_only_the_attention_kernel_and_is_bitwise_no_gc(arch):
    """P at level ``core`` (plan ``partial:core``) keeps only the attention kernel's outputs:
    gradients bitwise no-gc, alone and mixed with H, P and R; an attention unit keeps bytes,
    fewer than under P; an MLP unit (no attention kernel) keeps none."""
    seed = torch.seed() % 2**31
    print("seed", seed)
    model = tiny(arch, "lora-dropout")
    ids, pos = packed_microbatch(96, VOCAB, n_seqs=3)
    ref, _ = run(model, ids, pos)
    engine = RecoveryEngine(model)
    gen = torch.Generator().manual_seed(seed)
    labels = ("H", "P", "P:core", "R")
    mixed = {n: labels[int(b)] for n, b in zip(engine.unit_names, torch.randint(0, 4, (4,), generator=gen))}
    for plan, actions in [("all-p:core", None), (mixed, None), ("all-p:core", "all-r")]:
        g, _ = run(model, ids, pos, engine, plan, actions)
        for n in ref:
            assert torch.equal(g[n], ref[n]), f"{plan}/{actions}: {n} differs"
    held = _held_bytes(model, engine, ids, pos, ("all-p", "all-p:core"))
    for n in engine.unit_names:
        p, c = held["all-p"][n]["partial"], held["all-p:core"][n]["partial"]
        print(n, "P", p, "P:core", c)
        assert (0 < c < p) if n.endswith("attn") or "self_attn" in n else c == 0
    with pytest.raises(ValueError, match="not available"), engine.step("all-p:core") as st:
        grpo_loss(model, ids, pos)
        st.set_actions({n: "P" for n in engine.unit_names})  # the kept outputs were chosen in forward
    with pytest.raises(ValueError, match="unknown P level"):
        engine.step({n: "P:fast" for n in engine.unit_names})


def _held_total(model, engine, ids, pos, actions):
    """(all bytes, kept op outputs) held between forward and backward, each storage counted once."""
    held = _held(model, engine, ids, pos, actions, shared=True).values()
    return sum(sum(b.values()) for b in held), sum(b["partial"] for b in held)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_layer_of_p_and_r_units_replays_as_one(arch):
    """A layer whose units are all R or P replays as one (engine.py, 4-5): each P unit's kept
    outputs are served inside that unit only (another unit's matmuls are recomputed), the
    gradients are bitwise no-gc, and the layer holds what all-R holds plus the P units' kept
    outputs: no input of its MLP, which the layer replay rebuilds."""
    seed = torch.seed() % 2**31
    print("seed", seed)
    model = tiny(arch, "lora-dropout")
    ids, pos = packed_microbatch(96, VOCAB, n_seqs=3)
    ref, _ = run(model, ids, pos, rng_seed=seed)
    engine = RecoveryEngine(model)
    attn, mlp = engine.unit_names[:2]
    all_r = {n: "R" for n in engine.unit_names}
    base, _ = _held_total(model, engine, ids, pos, all_r)
    for acts in ({attn: "P:core"}, {attn: "P"}, {mlp: "P"}, {attn: "P", mlp: "P"}, {attn: "P:core", mlp: "P"}):
        g, step = run(model, ids, pos, engine, {**all_r, **acts}, rng_seed=seed)
        for n in ref:
            assert torch.equal(g[n], ref[n]), f"{acts}: {n} differs"
        total, partial = _held_total(model, engine, ids, pos, {**all_r, **acts})
        print(acts, "held", total, "all-R", base, "kept outputs", partial)
        assert partial > 0 and total == base + partial


@pytest.mark.parametrize("arch, lora, codec", ALL_L_CASES)
def test_all_l_is_close_and_reported(arch, lora, codec):
    model = tiny(arch, lora)
    ids, pos = packed_microbatch(96, VOCAB)
    ref, _ = run(model, ids, pos)
    engine = RecoveryEngine(model, codec=codec)
    g, step = run(model, ids, pos, engine, "all-l")
    err = rel_err(g, ref)
    recon = step.reconstruction_errors()
    print(f"{arch}/{lora}/{codec}: all-l gradient rel. error {err:.4f}; reconstruction {max(recon.values()):.4f} max")
    limit = 0.25 if codec.startswith("fp8") else 0.05  # e5m2 keeps 2 mantissa bits
    assert 0.0 < err < limit
    assert set(recon) == set(engine.unit_names) and all(0 < e < 0.2 for e in recon.values())


@pytest.mark.parametrize("arch", ARCHS)
def test_l_levels_name_their_codec_per_unit(arch):
    """``L:bf16`` / ``compressed:bf16`` on an int8 engine give bitwise the gradients of a bf16
    engine's L, before or after forward; units may mix codecs, each holding its own bytes; a
    compressed copy keeps the codec it was made with."""
    model = tiny(arch, "lora")
    ids, pos = packed_microbatch(96, VOCAB)
    ref_bf16, _ = run(model, ids, pos, RecoveryEngine(model, codec="bf16"), "all-l")
    engine = RecoveryEngine(model, codec="int8")
    names = engine.unit_names
    for plan, actions in [
        ({n: "compressed:bf16" for n in names}, None),
        (None, {n: "L:bf16" for n in names}),
        ({n: "L:bf16" for n in names}, None),
    ]:
        g, _ = run(model, ids, pos, engine, plan, actions)
        assert all(torch.equal(g[n], ref_bf16[n]) for n in ref_bf16), (plan, actions)
    mixed = {n: ("L:bf16" if ".layers.1." in n else "L") for n in names}  # layer 0 int8, layer 1 bf16
    with engine.step(mixed) as step:
        loss = grpo_loss(model, ids, pos)
        held = step.bytes_by_unit(shared=False)
        loss.backward()
    assert step.actions() == {n: "L" for n in names}
    mlp_int8, mlp_bf16 = held["model.layers.0.mlp"]["compressed"], held["model.layers.1.mlp"]["compressed"]
    assert 0 < mlp_int8 < 0.75 * mlp_bf16  # same shapes: about 1 byte per value against 2
    with engine.step({names[0]: "compressed:bf16"}) as step:
        grpo_loss(model, ids, pos)
        with pytest.raises(ValueError, match="keeps the codec it was made with"):
            step.set_actions({names[0]: "L:int8"})
    with pytest.raises(ValueError, match="unknown codec"):
        engine.step({names[0]: "L:int3"})
    with pytest.raises(ValueError, match="only L and compressed name a codec"):
        engine.step({names[0]: "H:bf16"})


def test_downgrade_to_r_frees_bundle_memory():
    """Peak of set_actions + backward: R after an exact forward is lower than H by >= 80% of the
    exact bundle bytes (8 layers: backward rebuilds one layer at a time)."""
    model = tiny("qwen2", "lora", layers=8, hidden=128)
    ids, pos = packed_microbatch(256, VOCAB)
    peaks, bundle = downgrade_peaks(model, lambda m: grpo_loss(m, ids, pos), "cpu")
    assert bundle > 0
    saved = peaks["H"] - peaks["R"]
    print(f"bundle {bundle} B, peak H {peaks['H']} B, peak R {peaks['R']} B, saved {saved / bundle:.1%} of the bundle")
    assert saved >= 0.8 * bundle


def test_all_r_peak_matches_gc():
    """all-r keeps what decoder-layer checkpointing keeps: peaks within 5% (1024-token packed row)."""
    model = tiny("qwen2", "lora", layers=4, hidden=128)
    ids, pos = packed_microbatch(1024, VOCAB, n_seqs=4)
    engine = RecoveryEngine(model)
    with MemoryMeter("cpu") as m_r:
        run(model, ids, pos, engine, "all-r")
    engine.detach()
    apply_baseline(model, "gc")
    with MemoryMeter("cpu") as m_gc:
        run(model, ids, pos)
    apply_baseline(model, "no-gc")
    with MemoryMeter("cpu") as m_no:
        run(model, ids, pos)
    ratio = m_r.peak_bytes / m_gc.peak_bytes
    print(f"peak all-r / gc = {ratio:.4f}; no-gc / gc = {m_no.peak_bytes / m_gc.peak_bytes:.3f}")
    assert abs(ratio - 1) <= 0.05
    assert m_no.peak_bytes > 1.2 * m_gc.peak_bytes  # the workload really is activation-bound


def test_bundles_never_hold_parameters_and_count_storage_once():
    model = tiny("phi3", "lora")
    ids, pos = packed_microbatch(64, VOCAB)
    engine = RecoveryEngine(model)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with engine.step("all-h") as step:
        loss = grpo_loss(model, ids, pos)
        storages = {}
        for u in step.units:
            for v in u.saved.entries.values():
                assert v.untyped_storage().data_ptr() not in params
                storages[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
        for ls in step.layers:  # checkpoint inputs held by the replay records
            for c in ls.replay.calls + [c for u in ls.units for c in u.rebuild.replay.calls]:
                for t in tensors((c.args, c.kwargs)):
                    storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        by_unit = step.bytes_by_unit()
        assert sum(b["exact"] + b["checkpoint"] for b in by_unit.values()) == sum(storages.values())
        assert sum(b["exact"] for b in by_unit.values()) > 0
        loss.backward()


def _hook_ids(model):
    return {
        (name, attr, k)
        for name, m in model.named_modules()
        for attr, d in vars(m).items()
        if attr.startswith("_")
        and attr.endswith(("hooks", "hooks_with_kwargs", "hooks_always_called"))
        and isinstance(d, dict)
        for k in d
    }


def test_unhooked_copy_drops_the_engines_hooks_and_keeps_the_users():
    """A copy for another engine or a compiled peer: none of this engine's hooks, every other
    hook kept, the original untouched; a second engine on the copy gives no-gc's gradients."""
    model = tiny("llama", "full")
    calls = []
    model.model.layers[0].self_attn.register_forward_pre_hook(lambda *_: calls.append(1))
    user = _hook_ids(model)
    engine = RecoveryEngine(model)
    hooked = _hook_ids(model)
    assert len(hooked) > len(user)
    twin = engine.unhooked_copy()
    assert _hook_ids(twin) == user and _hook_ids(model) == hooked
    ids, pos = packed_microbatch(64, VOCAB, n_seqs=2)
    ref, _ = run(model, ids, pos)
    other = RecoveryEngine(twin)
    calls.clear()
    for plan in ("all-h", "all-r"):
        g, _ = run(twin, ids, pos, other, plan)
        assert all(torch.equal(g[n], ref[n]) for n in ref), plan
    assert len(calls) == 3  # the user's hook: one forward each, one R replay (layer 0's attention)


def test_unknown_layer_structure_falls_back_to_layer_checkpointing():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = torch.nn.Linear(16, 16)
            self.proj = torch.nn.Linear(16, 16)

        def forward(self, x):
            return x + self.proj(torch.tanh(self.attn(x)))

    class Weird(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Block() for _ in range(3)])

        def forward(self, x):
            for b in self.layers:
                x = b(x)
            return x

    model = Weird()
    x = torch.randn(4, 16)
    model(x).square().sum().backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        engine = RecoveryEngine(model)
    assert any("Weird" in str(x.message) and "whole-layer" in str(x.message) for x in w)
    assert engine.unit_names == ["layers.0", "layers.1", "layers.2"]
    for plan in ("all-r", "all-p", "all-h"):  # P on a whole-layer unit keeps its matmul outputs
        model.zero_grad()
        with engine.step(plan) as st:
            loss = model(x).square().sum()
            st.set_actions()
            kept = st.bytes_by_unit(shared=False)
            loss.backward()
        assert all(torch.equal(p.grad, ref[n]) for n, p in model.named_parameters()), plan
        assert all((b["partial"] > 0) == (plan == "all-p") for b in kept.values()), (plan, kept)


def test_clear_errors_for_bad_plans_and_actions():
    model = tiny("llama", "full")
    engine = RecoveryEngine(model)
    with pytest.raises(ValueError, match="unknown policy"):
        engine.step("some-gc")
    with pytest.raises(ValueError, match="baseline"):
        engine.step("gc")
    with pytest.raises(ValueError, match="unknown unit"):
        engine.step({"model.layers.9.mlp": "R"})
    ids, pos = packed_microbatch(32, VOCAB)
    with engine.step("all-r") as step:
        grpo_loss(model, ids, pos)
        with pytest.raises(ValueError, match="not available for a 'checkpoint' bundle"):
            step.set_actions("all-h")
    with pytest.raises(RuntimeError, match="already active"):
        with engine.step():
            with engine.step():
                pass


@pytest.mark.parametrize("arch", ARCHS)
def test_padded_batch_with_kv_cache_is_bitwise_no_gc(arch):
    """A padded [B, T] batch (left and right padding, an attention mask, as OpenRLHF feeds
    its Actor) with the model's default use_cache=True: replays must not append to the KV
    cache a second time."""
    seed = torch.seed() % 2**31
    g = torch.Generator().manual_seed(seed)
    model = tiny(arch, "lora", layers=3)
    B, T = 4, 32
    ids = torch.randint(3, model.config.vocab_size, (B, T), generator=g)
    att = torch.ones(B, T, dtype=torch.long)
    for b in range(B):
        att[b, : int(torch.randint(0, 6, (1,), generator=g))] = 0
        att[b, T - int(torch.randint(0, 6, (1,), generator=g)) :] = 0
    pos = (att.cumsum(-1) - 1).masked_fill(att == 0, 1)

    def step(engine=None, plan=None):
        for p in model.parameters():
            p.grad = None
        ctx = engine.step(plan) if engine is not None else contextlib.nullcontext()
        with ctx:
            model(ids, attention_mask=att, position_ids=pos).logits.float().logsumexp(-1).mean().backward()
        return grads(model)

    ref = step()
    eng = RecoveryEngine(model)
    mixed = {n: "HPR"[int(torch.randint(0, 3, (1,), generator=g))] for n in eng.unit_names}
    print("seed", seed, mixed)
    for plan in ("all-r", "all-p", mixed):
        got = step(eng, plan)
        assert set(got) == set(ref) and all(torch.equal(got[n], ref[n]) for n in ref), plan


def test_token_norms_are_the_unit_inputs_norms_and_skip_checkpoint_units():
    """Exposure weights (Eq. 7): each unit's per-token input norm, against a forward hook on
    the unit's first module; units planned ``checkpoint`` (R only) are not tracked."""
    model = tiny("llama", "lora")
    ids, pos = packed_microbatch(96, VOCAB)
    engine = RecoveryEngine(model)
    seen, hooks = {}, []

    def keep(name):
        def hook(_m, args, kwargs):
            seen.setdefault(name, (args[0] if args else kwargs["hidden_states"]).detach().clone())

        return hook

    for layer in engine.layer_specs:
        for u in layer.units:
            hooks.append(u.modules[0].register_forward_pre_hook(keep(u.name), with_kwargs=True))
    plan = {
        n: "checkpoint" if i % 3 == 0 else ("compressed" if i % 3 == 1 else "exact")
        for i, n in enumerate(engine.unit_names)
    }
    with engine.step(plan, track_tokens=True) as step:
        loss = grpo_loss(model, ids, pos)
        norms = step.token_norms()
        loss.backward()
    for h in hooks:
        h.remove()
    assert set(norms) == {n for n, q in plan.items() if q != "checkpoint"}
    for n, v in norms.items():
        assert torch.allclose(v, seen[n].float().norm(dim=-1))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_l_compresses_each_stored_tensor_once_and_never_a_storage_kept_exact(arch):
    """Under L an attention unit's projections each save a 2-D view of one normed input (q, k,
    v): one payload serves them all; a saved tensor that is a view of a storage the attention
    core keeps exact (o_proj's input, where SDPA's output layout allows) stays that view, at
    no cost. So L's bundle is smaller than H's by more than half the input's exact bytes (it
    was not, when each view was compressed on its own)."""
    from hilore_actor.recovery import storage_key
    from hilore_actor.recovery.codecs import Payload

    seed = torch.seed() % 2**31
    print("seed", seed)
    model = tiny(arch, "lora", hidden=64)
    ids, pos = packed_microbatch(256, VOCAB, n_seqs=3, seed=seed)
    engine = RecoveryEngine(model)
    name = [n for n in engine.unit_names if n.endswith("0.self_attn")][0]
    total = {}
    for policy in ("all-h", "all-l"):
        with engine.step(policy) as st:
            loss = grpo_loss(model, ids, pos)
            u = [x for x in st.units if x.name == name][0]
            total[policy] = sum(st.bytes_by_unit()[name].values())
            if policy == "all-l":
                s = u.saved
                wide = [v for v in s.entries.values() if isinstance(v, Payload) and tuple(v.shape) == (256, 64)]
                kept = {storage_key(v) for i, v in s.entries.items() if i in s.kept}
                big_exact = [
                    v
                    for i, v in s.entries.items()
                    if isinstance(v, torch.Tensor)
                    and i not in s.kept
                    and i not in s.external
                    and v.is_floating_point()
                    and v.numel() >= 256 * 64
                ]
            st.set_actions(policy)
            loss.backward()
    print(total, len(wide), len({id(v) for v in wide}))
    assert len(wide) >= 3 and len({id(v) for v in wide}) <= 2  # q/k/v's input once (+ o_proj's, when not an alias)
    assert all(storage_key(v) in kept for v in big_exact)  # an exact copy under L only as a view of the kept core
    assert total["all-h"] - total["all-l"] >= 0.5 * 256 * 64 * 4


@pytest.mark.parametrize("arch", ARCHS)
def test_token_l_spans_h_to_whole_unit_l(arch):
    """Token L on the MLP units (``L@f``: the share f of token rows with the largest exposure
    weight kept exact, the rest compressed): every row exact gives bitwise H's gradients,
    none bitwise whole-unit L's; in between, the gradient error and the bytes lie between
    theirs; rows scored 0 before forward (no advantage) are never kept."""
    seed = torch.seed() % 2**31
    print("seed", seed)
    model = tiny(arch, "lora")
    ids, pos = packed_microbatch(96, VOCAB, seed=seed)
    ref, _ = run(model, ids, pos)
    engine = RecoveryEngine(model, codec="int8")
    mlps = [n for n in engine.unit_names if n.endswith("mlp")]
    whole, _ = run(model, ids, pos, engine, {n: "L" for n in mlps})
    for share, want in ((1.0, ref), (0.0, whole)):
        g, step = run(model, ids, pos, engine, {n: f"L@{share}" for n in mlps})
        assert all(torch.equal(g[n], want[n]) for n in ref), share
    assert step.actions() == {n: ("L" if n in mlps else "H") for n in engine.unit_names}
    held = {}
    for share in (0.0, 0.5, 1.0):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1234)
        with engine.step({n: f"compressed@{share}" for n in mlps}) as st:
            loss = grpo_loss(model, ids, pos)
            held[share] = sum(st.bytes_by_unit(shared=False)[n]["compressed"] for n in mlps)
            assert all(int(st.kept_rows()[n].sum()) == round(share * ids.numel()) for n in mlps)
            loss.backward()
        if share == 0.5:
            half = rel_err(grads(model), ref)
    assert held[0.0] < held[0.5] < held[1.0]
    assert 0 < half < rel_err(whole, ref)
    scores = torch.zeros(1, ids.shape[1] - 1)
    scores[0, :10] = 1.0  # only ten rows carry a coefficient
    with engine.step({n: "compressed@0.5" for n in mlps}, token_scores=scores) as st:
        loss = grpo_loss(model, ids, pos)
        assert all(st.kept_rows()[n].nonzero().flatten().tolist() == list(range(10)) for n in mlps)
        loss.backward()
    with pytest.raises(ValueError, match="token-wise units"):
        engine.step({engine.unit_names[0]: "L@0.5"})
    with pytest.raises(ValueError, match="share in"):
        engine.step({mlps[0]: "L@1.5"})
    with engine.step({mlps[0]: "compressed@0.5"}) as st:
        grpo_loss(model, ids, pos)
        with pytest.raises(ValueError, match="not available"):
            st.set_actions({mlps[0]: "L"})  # the rows were chosen in forward: no other split after it


def _attend(q, k, v, bias, scale):
    return torch.softmax((q @ k.transpose(-1, -2)) * scale + bias, dim=-1) @ v


class _EfficientLike(torch.autograd.Function):
    """Stands in for aten's ``_scaled_dot_product_efficient_attention``: it saves the bias it
    was given (derivatives.yaml: its backward takes ``attn_bias``)."""

    @staticmethod
    def forward(ctx, q, k, v, bias, scale):
        ctx.save_for_backward(q, k, v, bias)
        ctx.scale = scale
        return _attend(q, k, v, bias, scale)

    @staticmethod
    def backward(ctx, g):
        q, k, v, bias = ctx.saved_tensors
        with torch.enable_grad():
            x = [t.detach().requires_grad_() for t in (q, k, v)]
            return (*torch.autograd.grad(_attend(*x, bias, ctx.scale), x, g), None, None)


def cuda_like_sdpa(materialised):
    """SDPA as aten dispatches it on CUDA with a boolean mask: a fresh additive mask per call
    (``convert_boolean_attn_mask``), padded to an aligned last dimension and expanded over
    the heads (``preprocess_mask``: a stride-0 view; older torch expanded first and padded,
    which materialises ``[B, H, T, S]``), then the efficient kernel saves that bias."""
    import torch.nn.functional as F

    real = F.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
        if attn_mask is None:  # no packed mask (the engine's structure trace): the kernel as it is
            return real(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, **kw)
        assert attn_mask.dtype == torch.bool and not is_causal and not kw
        bias = torch.zeros_like(attn_mask, dtype=q.dtype).masked_fill_(attn_mask.logical_not(), float("-inf"))
        B, H, T, S = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
        pad = (-S) % 8
        if materialised:
            bias = F.pad(bias.expand(B, H, T, S), (0, pad))[..., :S]
        else:
            bias = F.pad(bias, (0, pad))[..., :S].expand(B, H, T, S)
        return _EfficientLike.apply(q, k, v, bias, scale if scale is not None else q.shape[-1] ** -0.5)

    return sdpa


@pytest.mark.parametrize("materialised, total", [(False, 96), (False, 90), (True, 90)])
def test_a_mask_expanded_in_every_layer_is_stored_once(materialised, total, monkeypatch):
    """CUDA's SDPA saves each layer's own expansion of the packed-sequence mask; the engine
    keeps one copy for all layers (bytes counted), and gradients stay bitwise."""
    seed = torch.seed() % 2**31
    print("seed", seed)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", cuda_like_sdpa(materialised))
    model = tiny("qwen2", "lora", layers=3)
    ids, pos = packed_microbatch(total, VOCAB, n_seqs=3, seed=seed)
    ref, _ = run(model, ids, pos)
    engine = RecoveryEngine(model)

    def stored(dedup):
        if not dedup:
            monkeypatch.setattr(Step, "canonical", lambda self, t: t)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1234)
        with engine.step("all-h") as step:
            loss = grpo_loss(model, ids, pos)
            masks = {
                id(t.untyped_storage()): t.untyped_storage().nbytes()
                for u in step.units
                for t in u.saved.entries.values()
                if isinstance(t, torch.Tensor) and t.dim() == 4 and t.is_floating_point() and t.isinf().any()
            }
            held = sum(b["exact"] for b in step.bytes_by_unit().values())
            loss.backward()
        assert all(torch.equal(p.grad, ref[n]) for n, p in model.named_parameters() if n in ref)
        return masks, held

    shared, held = stored(True)
    apart, held_apart = stored(False)
    assert len(shared) == 1 and len(apart) == 3
    assert held_apart - held == 2 * next(iter(shared.values()))
