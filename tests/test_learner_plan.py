"""A rank's planning on a tiny model: every planning pass (the gc pass that sets B,
profiling, candidate fitting, validation, calibration, leave-one-out) peaks within B, where
the old references (all-H) alone would not fit."""
from functools import partial

import torch

from hilore_actor.allocation import Runner
from hilore_actor.grpo.microbatch import microbatch_loss
from hilore_actor.learner.plan import plan_before_wrapping
from hilore_actor.learner.settings import hilore_settings
from hilore_actor.models import LoraSpec, build_model, tiny_config
from hilore_actor.workloads import replayed_microbatches


def test_planning_stays_within_the_budget(fresh_seed):
    print("seed", fresh_seed)
    cfg = tiny_config("qwen2", hidden_size=128, intermediate_size=704, num_layers=4, num_heads=4, num_kv_heads=2, vocab_size=1024)
    model = build_model(cfg, lora=LoraSpec(8, 16), seed=fresh_seed)
    model.train()
    chunked = partial(microbatch_loss, chunked_head=True)
    hcfg = hilore_settings(budget="1.10", mode="hilore", calibration_batches=2, profile_repeats=1, loo=True)
    lines = []
    plan = plan_before_wrapping(model, hcfg, backend="hilore", tokens=1024, seqs_per_microbatch=8, group_size=4,
                                loss_options={}, loss_fn=chunked, std_loss_fn=microbatch_loss, device=torch.device("cpu"),
                                seed=fresh_seed, log=lines.append)
    info = plan.info
    print("\n".join(lines), f"\nplan {info['plan']}; planning peak {info['plan_peak_over_budget']:.3f} B")
    assert 0 < info["plan_peak_over_budget"] <= 1.0
    assert all(p.grad is None for p in model.parameters())  # nothing left for the first real update
    assert info["plan_peak_bytes"] >= info["gc_peak_bytes"]  # the gc pass is one of them
    # what planning used to run as its references would not have fitted
    mb = replayed_microbatches(model, 1, 1024, seed=fresh_seed)[0]
    assert Runner(model, loss_fn=chunked).run(mb, "all-h", measure_peak=True).peak_bytes > info["budget_bytes"]
    assert plan.sp.costs.probe_tokens and max(plan.sp.costs.probe_tokens) < 1024

    # a shorter microbatch gets a plan sized to it: it stores more, and stays within B
    from functools import partial as bind

    short = replayed_microbatches(model, 1, 512, seed=fresh_seed + 1)[0]
    sized = plan.for_tokens(short.num_tokens)
    stored = lambda sp: sum(q != "checkpoint" for q in sp.plan.values())  # noqa: E731
    print(f"stored units: {stored(plan.sp)} at 1024 tokens, {stored(sized)} at 512 (of {len(sized.plan)})")
    assert sized is not plan.sp and sized.costs.tokens == 512
    assert stored(sized) > stored(plan.sp) or stored(plan.sp) == len(plan.sp.plan)
    runner = Runner(model, loss_fn=chunked)
    peaks = {}
    for name, sp in (("sized", sized), ("planning-size", plan.sp)):
        peaks[name] = runner.run(short, sp.plan, bind(plan.actions, sp=sp), track_tokens=plan.track_tokens,
                                 measure_peak=True).peak_bytes / info["budget_bytes"]
    print(f"peak / B on the 512-token microbatch: {peaks}")
    assert peaks["planning-size"] <= peaks["sized"] <= 1.0
