"""The KEEP_EXACT table, one test per kind: each kind of tensor really stays exact under L."""
import pytest
import torch

from conftest import grads, grpo_loss, packed_microbatch, rel_err
from hilore_actor.models import LoraSpec, build_model, tiny_config
from hilore_actor.recovery import RecoveryEngine, get_codec
from hilore_actor.recovery.rules import KEEP_EXACT, MIN_COMPRESS_NUMEL, exact_reason

VOCAB = 128


def _seed():
    seed = torch.seed() % 2**31
    print("seed", seed)
    return seed


def test_every_rule_has_a_reason():
    assert set(KEEP_EXACT) == {"not float", "small", "not finite", "attention core"}
    assert all(len(why) > 20 for why in KEEP_EXACT.values())


def test_integer_and_boolean_tensors_stay_exact():
    for t in (torch.arange(4096), torch.ones(4096, dtype=torch.bool), torch.zeros(4096, dtype=torch.int8)):
        assert exact_reason(t) == "not float"


def test_small_tensors_stay_exact_and_large_ones_may_be_compressed():
    assert exact_reason(torch.randn(MIN_COMPRESS_NUMEL - 1)) == "small"
    assert exact_reason(torch.randn(MIN_COMPRESS_NUMEL)) is None
    assert exact_reason(torch.randn(MIN_COMPRESS_NUMEL), in_attention_core=True) == "attention core"


@pytest.mark.parametrize("codec", ["int8", "bf16", "fp8-e4m3"])
def test_non_finite_tensors_are_flagged_by_every_codec(codec):
    mask = torch.zeros(8, 256)
    mask[:, 100:] = float("-inf")
    assert not get_codec(codec).encode(mask).finite()


def _run(model, ids, pos, engine=None, plan=None):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    if engine is None:
        grpo_loss(model, ids, pos).backward()
        return grads(model), None
    with engine.step(plan) as step:
        loss = grpo_loss(model, ids, pos)
        step.ensure_actions()
        held = step.bytes_by_unit(shared=False)
        loss.backward()
    return grads(model), held


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_attention_core_stays_exact_under_l(arch):
    """With the rule, an attention unit under L holds exact bytes the rule-free engine
    compresses (MLP units are unchanged), and attention-only L moves the gradient less."""
    seed = _seed()
    model = build_model(tiny_config(arch, hidden_size=64, num_layers=2, vocab_size=VOCAB),
                        lora=LoraSpec(rank=4, alpha=8, dropout=0.0), seed=seed).train()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(seed))
    ids, pos = packed_microbatch(128, VOCAB, seed=seed)
    ref, _ = _run(model, ids, pos)
    out = {}
    for on in (True, False):
        engine = RecoveryEngine(model, codec="int8", attention_core_exact=on)
        plan = {n: "compressed" if n.endswith("self_attn") else "checkpoint" for n in engine.unit_names}
        g, held = _run(model, ids, pos, engine, plan)
        engine.detach()
        out[on] = (rel_err(g, ref), held)
    print({k: v[0] for k, v in out.items()})
    for name, b in out[True][1].items():
        off = out[False][1][name]
        if name.endswith("self_attn"):
            assert b["exact"] > off["exact"] and b["compressed"] < off["compressed"], name
        else:
            assert b == off, name
    assert out[True][0] < out[False][0]


def test_sign_reading_activations_keep_their_signs_under_l(monkeypatch):
    """OPT's MLP saves a ReLU output whose zero pattern its backward reads: all-L with the
    sign-keeping rule moves the gradient less than the same engine rounding to nearest there."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import arch_sweep

    import hilore_actor.recovery.engine as engine_mod

    seed = _seed()
    model = build_model(arch_sweep.tiny_config("opt"), seed=seed).train()
    ids = torch.randint(3, 128, (2, arch_sweep.SEQ), generator=torch.Generator().manual_seed(seed))
    ref = arch_sweep._run(model, ids)
    out = {}
    for on in (True, False):
        if not on:
            monkeypatch.setattr(engine_mod, "reads_sign", lambda m: False)
        engine = RecoveryEngine(model, codec="int8")
        out[on] = arch_sweep._rel(arch_sweep._run(model, ids, engine, "all-l"), ref)
        engine.detach()
    print(out)
    assert 0 < out[True] < out[False] / 2
