"""Baselines applied to the model (``recovery/policies.py``): HF layer checkpointing turned on and
off per all-R microbatch and per gc pass leaves the model's hooks, and whether the embedding's
output requires grad, as it found them; gradients stay bitwise those of plain autograd."""

import pytest
import torch

from conftest import FixedPlan
from hilore_actor.allocation.runner import Runner
from hilore_actor.grpo.microbatch import microbatch_loss
from hilore_actor.learner.microbatch_run import run_microbatch
from hilore_actor.models import LoraSpec, build_model, tiny_config
from hilore_actor.recovery import RecoveryEngine, apply_baseline
from hilore_actor.recovery.policies import _HOOK_ATTRS, _HOOK_DICTS
from hilore_actor.workloads import replayed_microbatches

LORAS = {"full": None, "lora": LoraSpec(rank=4, alpha=8)}
REPEATS = 20


def _model(lora, seed):
    model = build_model(tiny_config("qwen2", hidden_size=32, num_layers=2, vocab_size=64), lora=LORAS[lora], seed=seed)
    for n, p in model.named_parameters():  # LoRA B away from zero: the adapters' gradients are not all alike
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=1e-2, generator=torch.Generator().manual_seed(seed))
    model.train()
    return model


def _hooks(model):
    """Every module's hook tables (hook objects by key, in order) and transformers' input-grad
    hook attributes: what a toggle must leave as it found it."""
    return [
        ([list(getattr(m, k).items()) for k in _HOOK_DICTS], [vars(m).get(a) for a in _HOOK_ATTRS])
        for m in model.modules()
    ]


def _embedding_output_requires_grad(model, mb) -> bool:
    return model.get_input_embeddings()(mb.input_ids).requires_grad  # runs the embedding's forward hooks


def _flat_grads(model):
    out = torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("lora", sorted(LORAS))
def test_all_r_microbatches_and_gc_passes_leave_the_hooks_as_found(fresh_seed, lora):
    """20 all-R microbatches (``run_microbatch(all_r=True)``: HF checkpointing on and off around
    each, as an out-of-memory rerun, ZeRO-3's agreement or a plan that stores nothing runs them)
    and 20 gc passes (``Runner.run(mb, "gc")``, as planning and the benchmark run gc): the
    embedding's forward hooks, every other module's hook tables and transformers' hook records
    are as before; the embedding's output requires grad only when its weight trains (a frozen
    LoRA embedding: no layer-0 input gradient), also inside the block; every microbatch's
    gradients are bitwise plain autograd's (non-reentrant checkpointing reaches the adapters
    without an input that requires grad)."""
    print("seed", fresh_seed)
    model = _model(lora, fresh_seed)
    (mb,) = replayed_microbatches(model, 1, 32, mean_len=16, seed=fresh_seed)
    emb = model.get_input_embeddings()
    trains_embedding = emb.weight.requires_grad
    assert trains_embedding == (lora == "full")
    engine = RecoveryEngine(model)
    before, emb_before = _hooks(model), list(emb._forward_hooks.items())
    assert _embedding_output_requires_grad(model, mb) == trains_embedding

    torch.manual_seed(fresh_seed)
    microbatch_loss(model, mb).loss.backward()
    ref = _flat_grads(model)

    plan = FixedPlan({n: "exact" for n in engine.unit_names})  # all_r=True overrides it, as a rerun does
    for _ in range(REPEATS):
        torch.manual_seed(fresh_seed)
        with run_microbatch(plan, engine, torch.device("cpu"), mb.num_tokens, all_r=True) as rec:
            assert any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())
            assert _embedding_output_requires_grad(model, mb) == trains_embedding
            microbatch_loss(model, mb).loss.backward()
        assert set(rec.actions.values()) == {"R"}
        assert torch.equal(_flat_grads(model), ref)
    after_all_r = list(emb._forward_hooks.items())
    print(f"embedding forward hooks: {len(emb_before)} before, {len(after_all_r)} after {REPEATS} all-R microbatches")
    assert after_all_r == emb_before and _hooks(model) == before

    runner = Runner(model, engine)
    for _ in range(REPEATS):
        assert torch.equal(runner.run(mb, "gc", grads=True, seed=fresh_seed).grad, ref)
    assert torch.equal(runner.run(mb, "no-gc", grads=True, seed=fresh_seed).grad, ref)
    after_gc = list(emb._forward_hooks.items())
    print(f"embedding forward hooks: {len(after_gc)} after {REPEATS} gc passes")
    assert after_gc == emb_before and _hooks(model) == before
    assert _embedding_output_requires_grad(model, mb) == trains_embedding
    engine.detach()


def test_hooks_the_model_had_stay_through_gc_and_no_gc(fresh_seed):
    """An owner's ``enable_input_require_grads`` (what OpenRLHF's LoRA actor and peft's gradient-
    checkpointing preparation call) is kept through gc and no-gc, also where transformers' disable
    would remove it (``_hf_peft_config_loaded``), and still removable by its owner afterwards."""
    print("seed", fresh_seed)
    model = _model("lora", fresh_seed)
    (mb,) = replayed_microbatches(model, 1, 32, mean_len=16, seed=fresh_seed)
    hf = model.get_base_model()
    hf.enable_input_require_grads()
    hf._hf_peft_config_loaded = True  # transformers' own PEFT integration: its disable removes the hook
    before = _hooks(model)
    assert len(model.get_input_embeddings()._forward_hooks) == 1 and _embedding_output_requires_grad(model, mb)
    for _ in range(3):
        apply_baseline(model, "gc")
        apply_baseline(model, "no-gc")
    assert _hooks(model) == before and _embedding_output_requires_grad(model, mb)
    hf.disable_input_require_grads()
    assert not model.get_input_embeddings()._forward_hooks and not _embedding_output_requires_grad(model, mb)


def test_a_reentrant_checkpoint_keeps_transformers_input_grad_hook(fresh_seed, monkeypatch):
    """Where a model's own enable checkpoints reentrantly (torch's default without
    ``use_reentrant``), a frozen embedding's output must require grad or the adapters inside the
    layers get no gradient: transformers' hook stays there, and the LoRA gradients equal plain
    autograd's."""
    print("seed", fresh_seed)
    model = _model("lora", fresh_seed)
    (mb,) = replayed_microbatches(model, 1, 32, mean_len=16, seed=fresh_seed)
    torch.manual_seed(fresh_seed)
    microbatch_loss(model, mb).loss.backward()
    ref = _flat_grads(model)
    hf = model.get_base_model()
    enable = type(hf).activation_checkpointing_enable
    monkeypatch.setattr(
        hf, "activation_checkpointing_enable", lambda **kw: enable(hf, activation_checkpointing_kwargs={})
    )
    apply_baseline(model, "gc")
    assert len(model.get_input_embeddings()._forward_hooks) == 1 and _embedding_output_requires_grad(model, mb)
    torch.manual_seed(fresh_seed)
    microbatch_loss(model, mb).loss.backward()
    torch.testing.assert_close(_flat_grads(model), ref, rtol=0, atol=1e-6)
    apply_baseline(model, "no-gc")
