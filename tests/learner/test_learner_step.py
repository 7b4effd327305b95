"""The learner room's microbatch sequence: gradients as without it, the actions the plan set,
the peak the meter measures, and the coordinator's tighten reaching the plan."""

import torch

from hilore_actor.learner.coordinator import BudgetCoordinator
from hilore_actor.learner.microbatch_run import MicrobatchRecord, report, run_microbatch
from hilore_actor.models import LoraSpec, build_model, tiny_config
from hilore_actor.recovery import RecoveryEngine
from hilore_actor.runtime import MemoryMeter

from conftest import FixedPlan as _Plan, grads, grpo_loss, packed_microbatch


def _setup(seed):
    model = build_model(
        tiny_config("qwen2", hidden_size=64, num_layers=3, vocab_size=256), lora=LoraSpec(8, 16), seed=seed
    )
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=1e-2, generator=torch.Generator().manual_seed(seed))
    return model, packed_microbatch(96, 256, seed=seed)


def _plain_grads(model, ids, pos, seed):
    """Gradients without the sequence (the reference), leaving none behind."""
    grpo_loss(model, ids, pos, seed=seed).backward()
    ref = grads(model)
    model.zero_grad(set_to_none=True)
    return ref


def test_sequence_keeps_gradients_and_records_actions_and_peak(fresh_seed):
    print("seed", fresh_seed)
    model, (ids, pos) = _setup(fresh_seed)
    ref = _plain_grads(model, ids, pos, fresh_seed)

    engine = RecoveryEngine(model)
    rng = torch.Generator().manual_seed(fresh_seed)
    plan = _Plan(
        {n: ("exact", "checkpoint")[int(torch.randint(0, 2, (1,), generator=rng))] for n in engine.unit_names}, 10**12
    )
    with run_microbatch(plan, engine, torch.device("cpu"), ids.numel()) as rec:
        loss = grpo_loss(model, ids, pos, seed=fresh_seed)
        rec.set_actions(plan, None)
        loss.backward()
    got = grads(model)
    assert all(torch.equal(got[n], ref[n]) for n in ref)  # H and R are exact
    assert rec.actions == plan.actions(None, None)
    assert rec.counts == {
        "H": sum(q == "exact" for q in plan.sp.plan.values()),
        "L": 0,
        "P": 0,
        "R": sum(q == "checkpoint" for q in plan.sp.plan.values()),
    }
    assert rec.peak_bytes > 0


def test_without_engine_the_sequence_only_measures(fresh_seed):
    print("seed", fresh_seed)
    model, (ids, pos) = _setup(fresh_seed)
    plan = _Plan({}, 10**12)
    with run_microbatch(plan, None, torch.device("cpu"), ids.numel()) as rec:
        grpo_loss(model, ids, pos, seed=fresh_seed).backward()
    model.zero_grad(set_to_none=True)
    with MemoryMeter(torch.device("cpu")) as meter:
        grpo_loss(model, ids, pos, seed=fresh_seed).backward()
    assert rec.step is None and rec.actions == {} and rec.counts == {"H": 0, "L": 0, "P": 0, "R": 0}
    assert rec.peak_bytes == meter.report.peak_bytes  # the same program measures the same peak


def test_report_tightens_the_plan_only_over_budget():
    co = BudgetCoordinator(margin=0.05)
    co.register(0, 1000)
    plan = _Plan({}, 1000)
    rec = MicrobatchRecord(tokens=512, peak_bytes=900, actions={"a": "H", "b": "R", "c": "R"})
    assert report(plan, co, 0, 0, 0, rec)["action"] == "ok" and plan.tightened == []
    rec.peak_bytes = 1200
    assert report(plan, co, 0, 0, 1, rec)["action"] == "tighten" and plan.tightened == [(int(200 * 1.05), 512)]
    assert co.step_record(0)["0"]["actions"] == {"H": 2, "L": 0, "P": 0, "R": 4}
    assert report(plan, None, 0, 0, 2, rec) is None
    assert plan.observed == []  # no prediction: nothing to observe
    rec.predicted_bytes, rec.peak_bytes = 800, 700
    report(plan, None, 0, 0, 3, rec)
    assert plan.observed == [(800, 700)]


def test_a_plan_that_stores_nothing_runs_plain_layer_checkpointing(fresh_seed):
    print("seed", fresh_seed)
    model, (ids, pos) = _setup(fresh_seed)
    ref = _plain_grads(model, ids, pos, fresh_seed)
    engine = RecoveryEngine(model)
    plan = _Plan({n: "checkpoint" for n in engine.unit_names}, 10**12)
    calls = []
    checkpointing = lambda: any(getattr(m, "gradient_checkpointing", False) for m in model.modules())  # noqa: E731
    with run_microbatch(plan, engine, torch.device("cpu"), ids.numel()) as rec:
        calls.append(checkpointing())
        loss = grpo_loss(model, ids, pos, seed=fresh_seed)
        rec.set_actions(plan, None)  # nothing to set: no engine step
        loss.backward()
    got = grads(model)
    assert rec.step is None and set(rec.actions.values()) == {"R"} and rec.counts["R"] == len(engine.unit_names)
    assert calls == [True] and not checkpointing()  # HF's checkpointing on inside the block only
    assert all(torch.equal(got[n], ref[n]) for n in ref)
