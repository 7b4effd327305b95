"""Units found by structure: cut at the residual adds of a traced layer (``structure.segments``
against hand-made event lists), norms in the unit of the block they belong to, and H/R bitwise
equal to no-gc on the architectures whose layouts the name table got wrong."""

import random
import warnings

import pytest
import torch

from conftest import grads, grpo_loss
from hilore_actor.recovery import RecoveryEngine
from hilore_actor.recovery.structure import segments, shrunk_config
from hilore_actor.recovery.units import _innermost

transformers = pytest.importorskip("transformers")
VOCAB = 128
C, A, S = "call", "add", "save"


def test_segments_cut_at_the_residual_adds():
    ev = [(C, "input_layernorm"), (C, "self_attn"), (A, None), (C, "post_attention_layernorm"), (C, "mlp"), (A, None)]
    assert segments(ev) == [["input_layernorm", "self_attn"], ["post_attention_layernorm", "mlp"]]
    post = [
        (C, "self_attn"),
        (C, "post_attention_layernorm"),
        (A, None),
        (C, "mlp"),
        (C, "post_feedforward_layernorm"),
        (A, None),
    ]
    assert segments(post) == [["self_attn", "post_attention_layernorm"], ["mlp", "post_feedforward_layernorm"]]
    assert segments([(C, "ln_1"), (C, "attn"), (C, "mlp"), (A, None), (A, None)]) == [["ln_1", "attn", "mlp"]]
    # saves at the layer's own level: harmless after a segment's last child, fatal between two children
    assert segments([(C, "a"), (S, None), (A, None), (C, "b"), (A, None)]) == [["a"], ["b"]]
    assert segments([(C, "a"), (S, None), (C, "b"), (A, None)]) is None
    assert segments([(C, "a"), (A, None), (C, "a"), (A, None)]) is None  # one child in two units
    assert segments([]) is None


def test_segments_against_a_brute_force_cut():
    seed = random.randrange(2**31)
    print("seed", seed)
    rng = random.Random(seed)
    for _ in range(200):
        names = [f"m{i}" for i in range(rng.randint(1, 6))]
        ev = []
        for n in names:
            ev += [(C, n)] + [(A, None)] * rng.choice([0, 0, 1, 2])
        want, cur = [], []
        for kind, n in ev:
            if kind == C:
                cur.append(n)
            elif cur:
                want.append(cur)
                cur = []
        want += [cur] if cur else []
        assert segments(ev) == want


def _tiny(cls_name, **kw):
    cfg = getattr(transformers, cls_name)(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **kw,
    )
    cfg._attn_implementation = "sdpa"
    return cfg


def _exact_under_h_and_r(model):
    ids = torch.randint(0, VOCAB, (2, 24))
    pos = torch.arange(24).expand(2, 24)
    model.zero_grad(set_to_none=True)
    grpo_loss(model, ids, pos).backward()
    ref = grads(model)
    engine = RecoveryEngine(model)
    for plan in ("all-h", "all-r"):
        model.zero_grad(set_to_none=True)
        with engine.step(plan):
            grpo_loss(model, ids, pos).backward()
        got = grads(model)
        assert all(torch.equal(got[n], ref[n]) for n in ref), plan
    return engine


@pytest.mark.parametrize("arch", ["Olmo2", "Gemma3Text"])
def test_each_norm_sits_in_the_unit_of_its_block(arch):
    seed = torch.seed() % 2**31
    print("seed", seed)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_tiny(f"{arch}Config")).train()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning
        engine = _exact_under_h_and_r(model)
    layer = model.model.layers[0]
    attn, mlp = engine.layer_specs[0].units
    assert (attn.name, attn.kind, mlp.name, mlp.kind) == (
        "model.layers.0.self_attn",
        "attn",
        "model.layers.0.mlp",
        "mlp",
    )
    if arch == "Olmo2":  # post-norm: the norm after each block
        assert attn.modules == [layer.self_attn, layer.post_attention_layernorm]
        assert mlp.modules == [layer.mlp, layer.post_feedforward_layernorm]
    else:  # sandwich: a norm before and after each block
        assert attn.modules == [layer.input_layernorm, layer.self_attn, layer.post_attention_layernorm]
        assert mlp.modules == [layer.pre_feedforward_layernorm, layer.mlp, layer.post_feedforward_layernorm]
    assert attn.attention is layer.self_attn and mlp.token_wise


def test_one_residual_add_for_both_blocks_is_one_unit():
    cfg = transformers.GPTJConfig(
        vocab_size=VOCAB,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=256,
        rotary_dim=8,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = transformers.GPTJForCausalLM(cfg).train()
    engine = RecoveryEngine(model)
    (unit,) = engine.layer_specs[0].units
    assert (unit.name, unit.kind, unit.token_wise) == ("transformer.h.0.attn+mlp", "block", False)
    assert unit.attention is model.transformer.h[0].attn


def test_moe_blocks_are_units_without_token_l_and_exact():
    torch.manual_seed(0)
    cfg = _tiny("Qwen3MoeConfig", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16)
    model = transformers.Qwen3MoeForCausalLM(cfg).train()
    engine = _exact_under_h_and_r(model)
    kinds = [u.kind for u in engine.layer_specs[0].units]
    assert kinds == ["attn", "moe"] and not engine.layer_specs[0].units[1].token_wise


def test_tracing_leaves_the_random_state_and_the_config_alone(monkeypatch):
    """The trace seeds the CPU generator inside a fork only: ``torch.manual_seed`` would also
    reseed every CUDA generator, which the fork does not restore."""
    from hilore_actor.recovery import structure

    structure._CACHE.clear()
    monkeypatch.setattr(torch, "manual_seed", lambda *_: (_ for _ in ()).throw(AssertionError("global reseed")))
    model = transformers.Olmo2ForCausalLM(_tiny("Olmo2Config"))
    before = model.config.to_dict()
    state = torch.get_rng_state()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # traced, not fallen back to names
        RecoveryEngine(model)
    assert torch.equal(state, torch.get_rng_state()) and model.config.to_dict() == before
    small = shrunk_config(model.config)
    assert small.num_hidden_layers == model.config.num_hidden_layers and small.hidden_size == 64


def test_innermost_stops_at_an_hf_model_whose_base_model_is_itself():
    model = transformers.Olmo2Model(_tiny("Olmo2Config"))
    assert model.base_model is model and _innermost(model) is model

    class Wrapper(torch.nn.Module):  # DeepSpeed-style .module
        def __init__(self, m):
            super().__init__()
            self.module = m

    assert _innermost(Wrapper(model)) is model
