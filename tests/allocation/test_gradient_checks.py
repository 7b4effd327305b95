"""Planning's gradient checks compared parameter by parameter (``runner.GradOp``): validation's
accumulated error and calibration's gradient errors are those of the flattened float32
gradients they used to build (the reference here, evaluated in float64), on a full fine-tuning
of a tiny model, with the runner's own backward and with ``torch.autograd.grad``; nothing is
left in ``.grad`` or held afterwards."""

import pytest
import torch

from hilore_actor.allocation import Planner, Runner, ShapePlan, calibrate
from hilore_actor.allocation.calibration import EPS_NUM, INTERVENTION, Calibration
from hilore_actor.allocation.runner import GradOp, HeldGradients, _add_into
from hilore_actor.models import build_model, tiny_config
from hilore_actor.workloads import replayed_microbatches


def _full(seed):
    model = build_model(tiny_config("llama", hidden_size=64, num_layers=2, vocab_size=256), lora=None, seed=seed)
    model.train()
    return model


def _runner(model, captured: bool):
    params = [p for p in model.parameters() if p.requires_grad]
    back = (lambda loss: torch.autograd.grad(loss, params, allow_unused=True)) if captured else None
    return Runner(model, backward=back)


def _static_planner(runner):
    """hilore-static: the plan's own actions (L where it compresses), no online chooser."""
    names = runner.engine.unit_names
    cal = Calibration("int8-g64", {}, dict.fromkeys(names, 0.0), dict.fromkeys(names, 0.0), dict.fromkeys(names, "g"))
    return Planner(runner, 10**12, cal, Planner.Config(mode="hilore-static", loo=False), log=lambda *_: None)


def _flat_error(runner, planner, sp, dev, accumulate):
    """The old computation: flattened float32 gradients summed per update, then the norm."""
    worst = 0.0
    for i in range(0, len(dev), accumulate):
        g = g_ex = None
        for j, mb in enumerate(dev[i : i + accumulate]):
            a = planner._run(sp, mb, grads=True, seed=j).grad
            b = runner.run(mb, "all-r", grads=True, seed=j).grad
            g, g_ex = (a, b) if g is None else (g + a, g_ex + b)
        worst = max(worst, float((g.double() - g_ex.double()).norm() / g_ex.double().norm()))
    return worst


@pytest.mark.parametrize("captured", [False, True], ids=["backward", "autograd.grad"])
def test_validation_error_is_the_flattened_one(fresh_seed, captured):
    print("seed", fresh_seed)
    model = _full(fresh_seed)
    runner = _runner(model, captured)
    planner = _static_planner(runner)
    names = runner.engine.unit_names
    plan = {n: ("compressed", "exact", "checkpoint")[i % 3] for i, n in enumerate(names)}
    sp = ShapePlan("s", None, plan, 0.0, 0.0, 0.0)
    dev = replayed_microbatches(model, 3, 128, seed=fresh_seed)
    for accumulate in (1, 2):  # one microbatch per update; two (the plan's sum built in two rounds)
        got = planner.accumulated_error(sp, dev, accumulate)
        assert runner.held.sets == {} and all(p.grad is None for p in runner.params)
        want = _flat_error(runner, planner, sp, dev, accumulate)
        print(accumulate, got, want)
        assert want > 0 and got == pytest.approx(want, rel=1e-10)


def test_calibration_errors_are_the_flattened_ones(fresh_seed):
    print("seed", fresh_seed)
    model = _full(fresh_seed)
    runner = Runner(model)
    mbs = replayed_microbatches(model, 2, 128, seed=fresh_seed)
    cal = calibrate(runner, mbs)
    assert runner.held.sets == {} and all(p.grad is None for p in runner.params)
    all_r = {n: "R" for n in runner.engine.unit_names}
    for s in cal.samples:
        mb = mbs[s["batch"]]
        ref = runner.run(mb, "all-r", grads=True, seed=s["batch"]).grad.double()
        res = runner.run(mb, dict(all_r, **{s["unit"]: "L"}), **INTERVENTION, grads=True, seed=s["batch"]).grad
        want = float((res.double() - ref).norm()) / (float(ref.norm()) + EPS_NUM)
        assert want > 0 and s["grad_err"] == pytest.approx(want, rel=1e-10), (s, want)


def test_held_sums_add_as_flattened_float32_did(fresh_seed):
    """A bfloat16 gradient summed into a float32 held one (chunk by chunk) is the float32 sum of
    the two cast gradients, bitwise; parameter parts cover every parameter once, in order."""
    import hilore_actor.allocation.runner as runner_mod

    print("seed", fresh_seed)
    gen = torch.Generator().manual_seed(fresh_seed)
    a, b = (torch.randn(3000, generator=gen).to(torch.bfloat16) for _ in range(2))
    old = runner_mod.CHUNK
    runner_mod.CHUNK = 512
    try:
        got = _add_into(_add_into(None, a, torch.float32), b, torch.float32)
    finally:
        runner_mod.CHUNK = old
    assert got.dtype == torch.float32 and torch.equal(got, a.float() + b.float())
    params = [torch.zeros(n) for n in (5, 300, 7, 200, 1)]
    parts = HeldGradients(params).parts(2)
    assert sorted(parts[0] + parts[1]) == list(range(5)) and parts[0] == sorted(parts[0]) and parts[0][-1] < parts[1][0]


def test_a_pass_streams_its_gradient_into_the_held_sum(fresh_seed):
    """``GradOp(add=...)`` keeps the pass's gradient per parameter (the tensor autograd made, no
    copy), ``.grad`` empty; a comparing pass against it gives zero difference."""
    print("seed", fresh_seed)
    model = _full(fresh_seed)
    runner = Runner(model)
    mb = replayed_microbatches(model, 1, 128, seed=fresh_seed)[0]
    flat = runner.run(mb, "all-r", grads=True, seed=1).grad
    runner.run(mb, "all-r", grad_op=GradOp(add="x", restart=True), seed=1)
    assert all(p.grad is None for p in runner.params)
    held = runner.held.sets["x"]
    assert torch.equal(torch.cat([t.reshape(-1) for t in held]), flat)
    res = runner.run(mb, "gc", grad_op=GradOp(compare="x", drop=("x",)), seed=1)
    diff, dot, na, nb = res.grad_sums
    assert diff == 0.0 and na == nb == pytest.approx(float(flat.double().pow(2).sum()), rel=1e-12)
    assert runner.held.sets == {}
