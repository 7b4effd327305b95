"""The side pass behind ``--measure_grad_error``: the error it reports is the error of the
update's gradient under the plan (reference: the same microbatches run by hand, under the
engine and plainly), exactly 0 for an H/R plan, and it leaves no gradient, random state or
chooser state behind."""

from types import SimpleNamespace

import pytest
import torch

from hilore_actor.learner.gradient_check import update_gradient_error
from hilore_actor.models import LoraSpec, build_model, tiny_config
from hilore_actor.recovery import RecoveryEngine

from conftest import FixedPlan, grads, grpo_loss, packed_microbatch, rel_err


def _setup(seed, n_mbs=2):
    model = build_model(
        tiny_config("llama", hidden_size=64, num_layers=3, vocab_size=256), lora=LoraSpec(8, 16), seed=seed
    )
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=1e-2, generator=torch.Generator().manual_seed(seed))
    mbs = []
    for i in range(n_mbs):
        ids, pos = packed_microbatch(96, 256, seed=seed + i)
        mbs.append(SimpleNamespace(ids=ids, pos=pos, num_tokens=ids.numel(), seed=seed + i))
    return model, mbs


def _loss(model, mb):
    return SimpleNamespace(loss=grpo_loss(model, mb.ids, mb.pos, seed=mb.seed))


def _by_hand(model, engine, plan, mbs):
    """The update's gradient under ``plan`` and the exact one, each accumulated over ``mbs``."""
    for mb in mbs:
        with engine.step(plan.sp.plan) as st:
            out = _loss(model, mb)
            st.set_actions(plan.actions(st, out))
            out.loss.backward()
    ours = grads(model)
    model.zero_grad(set_to_none=True)
    for mb in mbs:
        _loss(model, mb).loss.backward()
    exact = grads(model)
    model.zero_grad(set_to_none=True)
    return ours, exact


def test_reports_the_error_of_the_update_under_the_plan(fresh_seed):
    print("seed", fresh_seed)
    model, mbs = _setup(fresh_seed)
    engine = RecoveryEngine(model, codec="int8")
    names = engine.unit_names
    plan = FixedPlan({n: ("compressed", "exact", "checkpoint")[i % 3] for i, n in enumerate(names)})
    ours, exact = _by_hand(model, engine, plan, mbs)
    want = rel_err(ours, exact)
    assert want > 0  # int8 L changes the gradient

    torch.manual_seed(fresh_seed)
    before = torch.random.get_rng_state()
    first = next(p for p in model.parameters() if p.requires_grad)
    first.grad = held = torch.full_like(first, 7.0)  # not the update's: neither counted nor lost
    got = update_gradient_error(plan, engine, model, _loss, mbs, torch.device("cpu"))
    assert first.grad is held
    first.grad = None
    assert abs(got["grad_rel_error"] - want) <= 1e-5 * want + 1e-7, (got, want)
    flat = lambda g: torch.cat([g[n].double().flatten() for n in exact])  # noqa: E731
    cos = float(torch.nn.functional.cosine_similarity(flat(ours), flat(exact), dim=0))
    assert abs(got["grad_cosine"] - cos) < 1e-9 and got["grad_cosine"] < 1.0
    assert torch.equal(torch.random.get_rng_state(), before)  # the update that follows draws the same numbers
    assert all(p.grad is None for p in model.parameters())  # nothing for the optimizer to pick up
    assert plan.planner.entered == 1  # the online chooser's state is kept


def test_an_exact_plan_reports_zero(fresh_seed):
    print("seed", fresh_seed)
    model, mbs = _setup(fresh_seed)
    engine = RecoveryEngine(model)
    plan = FixedPlan({n: ("exact", "checkpoint")[i % 2] for i, n in enumerate(engine.unit_names)})
    got = update_gradient_error(plan, engine, model, _loss, mbs, torch.device("cpu"))
    assert got["grad_rel_error"] == 0.0


def _full_setup(seed, n_mbs):
    """A full fine-tuning (no LoRA) of the same tiny model."""
    model = build_model(tiny_config("llama", hidden_size=64, num_layers=3, vocab_size=256), lora=None, seed=seed)
    mbs = []
    for i in range(n_mbs):
        ids, pos = packed_microbatch(96, 256, seed=seed + i)
        mbs.append(SimpleNamespace(ids=ids, pos=pos, num_tokens=ids.numel(), seed=seed + i))
    return model, mbs


def _update(model, engine, plan, mbs):
    """The check's passes as one update would run them: the plan's, then the exact ones under
    layer checkpointing, every gradient accumulated in ``.grad``."""
    from hilore_actor.recovery.policies import layer_checkpointing

    for mb in mbs:
        with engine.step(plan.sp.plan) as st:
            out = _loss(model, mb)
            st.set_actions(plan.actions(st, out))
            out.loss.backward()
    with layer_checkpointing(model):
        for mb in mbs:
            _loss(model, mb).loss.backward()
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("n_mbs", [1, 2])
def test_a_full_fine_tuning_is_compared_parameter_by_parameter(fresh_seed, n_mbs, monkeypatch):
    """The error and cosine are those of the flattened gradients in float64, with one or two
    microbatches per update; with one, the check holds no more than its passes run as one
    update hold (which keeps one set of gradients in ``.grad``) plus one parameter's gradient
    and the float64 temporaries of the reductions (3 chunks, set small here)."""
    import hilore_actor.allocation.runner as runner_mod
    from hilore_actor.runtime import MemoryMeter, memory

    print("seed", fresh_seed)
    chunk = 1 << 10
    monkeypatch.setattr(memory, "CPU_METER", "storage")  # the microbatches' own meters nest inside
    monkeypatch.setattr(runner_mod, "CHUNK", chunk)
    model, mbs = _full_setup(fresh_seed, n_mbs)
    engine = RecoveryEngine(model, codec="int8")
    plan = FixedPlan({n: ("compressed", "exact", "checkpoint")[i % 3] for i, n in enumerate(engine.unit_names)})
    ours, exact = _by_hand(model, engine, plan, mbs)
    flat = lambda g: torch.cat([g[n].double().flatten() for n in exact])  # noqa: E731
    a, b = flat(ours), flat(exact)
    with MemoryMeter("cpu") as check:
        got = update_gradient_error(plan, engine, model, _loss, mbs, torch.device("cpu"))
    assert got["grad_rel_error"] == pytest.approx(float((a - b).norm() / b.norm()), rel=1e-10)
    assert got["grad_cosine"] == pytest.approx(float(a @ b / (a.norm() * b.norm())), rel=0, abs=1e-12)
    assert all(p.grad is None for p in model.parameters())
    with MemoryMeter("cpu") as update:
        _update(model, engine, plan, mbs)
    params = [p for p in model.parameters() if p.requires_grad]
    largest = max(p.numel() * p.element_size() for p in params)
    print(got, check.peak_bytes, update.peak_bytes, largest, sum(p.numel() * p.element_size() for p in params))
    if n_mbs == 1:
        assert check.peak_bytes <= update.peak_bytes + largest + 3 * 8 * chunk
