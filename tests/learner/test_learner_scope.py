"""What B counts: the resident estimate against an optimizer's real state, the measured
resident bytes, ``auto`` on CPU, and a plan rebased on measured resident bytes."""

import pytest
import torch

from benchmarks.bench.scope import grad_bytes, make_optimizer, resident_bytes
from hilore_actor.learner.plan import RankPlanner
from hilore_actor.learner.scope import CPU_AUTO_RATIO, auto_budget, estimate_resident, resident_now
from hilore_actor.models import LoraSpec, build_model, tiny_config


def _model(seed, lora=True):
    cfg = tiny_config("llama", hidden_size=64, num_layers=2, vocab_size=512)
    return build_model(cfg, lora=LoraSpec(8, 16) if lora else None, seed=seed)


@pytest.mark.parametrize("lora", [True, False])
def test_estimate_and_measure_match_adamw_state(fresh_seed, lora):
    """World 1, no ZeRO partitioning, fp32: weights + gradients + AdamW's two moments, as
    a plain torch AdamW really holds them (bench.scope counts them storage by storage)."""
    print("seed", fresh_seed)
    model = _model(fresh_seed, lora)
    params = [p for p in model.parameters() if p.requires_grad]
    est = estimate_resident(model, world=1, zero_stage=0)
    opt = make_optimizer(params)
    for p in params:
        p.grad = torch.ones_like(p)
    real = resident_bytes(model, opt) + grad_bytes(params)
    assert est == pytest.approx(real, rel=2e-3)  # AdamW's per-parameter step counters are not estimated
    assert resident_now("cpu", model, opt) == real
    assert estimate_resident(model, world=4, zero_stage=2) < est  # partitions shrink with ranks


def test_auto_on_cpu_falls_back_to_a_ratio_and_rebase_follows_measured_bytes():
    assert auto_budget("cpu") is None and CPU_AUTO_RATIO > 1
    info = {"budget_scope": "device", "budget_spec": "1.10", "gc_peak_bytes": 1000, "resident_bytes": 500}
    plan = RankPlanner(int(1.1 * 1500), dict(info), log=lambda *_: None)
    assert plan.resident_bytes == 500
    assert plan.rebase(700) and plan.budget == int(1.1 * 1700) and plan.resident_bytes == 700
    assert plan.info["resident_estimate_bytes"] == 500
    fixed = RankPlanner(4000, dict(info, budget_spec="4000"), log=lambda *_: None)
    assert not fixed.rebase(900) and fixed.budget == 4000 and fixed.resident_bytes == 900
    # never below the estimate: optimizer state may come at the first step
    assert not fixed.rebase(100) and fixed.resident_bytes == 900
    act = RankPlanner(1100, dict(info, budget_scope="activations"), log=lambda *_: None)
    assert act.resident_bytes == 0 and not act.rebase(900) and act.budget == 1100


def test_auto_budget_in_both_scopes_on_cpu():
    from hilore_actor.learner.plan import _budget
    from hilore_actor.learner.settings import hilore_settings

    logs = []
    dev = _budget(hilore_settings(budget="auto"), 1000, 500, 500, "cpu", logs.append)
    act = _budget(hilore_settings(budget="auto", budget_scope="activations"), 1000, 500, 0, "cpu", logs.append)
    assert dev == int(CPU_AUTO_RATIO * 1500) and act == dev - 500 and "auto on CPU" in logs[0]
    assert _budget(hilore_settings(budget="1.10"), 1000, 500, 500, "cpu", logs.append) == int(1.1 * 1500)
    assert _budget(hilore_settings(budget="1.10", budget_scope="activations"), 1000, 500, 0, "cpu", logs.append) == 1100


@pytest.mark.parametrize("zero_stage, world", [(0, 1), (2, 4), (3, 4)])
def test_the_floor_from_shapes_alone_is_the_estimate_without_its_buffers(zero_stage, world, fresh_seed):
    """``resident_floor`` of the model built on the meta device (no memory, no weights) against
    the real model's ``estimate_resident``: equal but for the buffers below ZeRO-3, and under
    ZeRO-3 lower by the weights the other ranks hold."""
    from hilore_actor.learner.scope import resident_floor

    print("seed", fresh_seed)
    real = _model(fresh_seed)
    with torch.device("meta"):
        meta = _model(None)
    assert next(meta.parameters()).is_meta
    buffers = sum(b.numel() * b.element_size() for b in real.buffers())
    weights = sum(p.numel() * p.element_size() for p in real.parameters())
    floor = resident_floor(meta, world=world, zero_stage=zero_stage)
    est = estimate_resident(real, world=world, zero_stage=zero_stage)
    others = weights * (1 - 1 / world) if zero_stage == 3 else 0
    assert floor == pytest.approx(est - buffers - others, abs=1)  # each rounds to whole bytes once
