"""Budget-tuned peers fit B on every development microbatch, and compiled peers honour the
runner's head (tiny random models: mechanism checks, not performance)."""
from functools import partial

import pytest
import torch

from hilore_actor.allocation import Runner
from hilore_actor.bench.inputs import init_lora_b
from hilore_actor.bench.methods import Budget, MethodContext, make_method
from hilore_actor.bench.peers import compiled_peak, every_kth, tune_sac_layers
from hilore_actor.grpo.microbatch import microbatch_loss
from hilore_actor.models import LoraSpec, build_model, tiny_config
from hilore_actor.recovery import RecoveryEngine
from hilore_actor.workloads import replayed_microbatches


@pytest.fixture(scope="module")
def setup():
    seed = torch.seed() % 2**31
    print("seed", seed)
    model = build_model(tiny_config("llama", hidden_size=64, num_layers=4, vocab_size=4096), lora=LoraSpec(8, 16), seed=seed)
    init_lora_b(model, 1e-2, seed)
    model.train()
    dev = replayed_microbatches(model, 2, 256, seed=seed)
    engine = RecoveryEngine(model)
    runners = {"full": Runner(model, engine), "chunked": Runner(model, engine, loss_fn=partial(microbatch_loss, lean_head=True))}
    return runners, dev


def _peak(runner, dev, method="as-is"):
    return max(runner.run(mb, method, measure_peak=True).peak_bytes for mb in dev)


def test_sac_budget_fits_on_every_dev_microbatch(setup):
    runners, dev = setup
    gc = _peak(runners["chunked"], dev, "gc")
    for ratio in (1.05, 1.3, 3.0):
        ctx = MethodContext(runners, "chunked", Budget("activations", "gc", gc, 0), None, dev, log=lambda m: None)
        m = make_method("sac-budget", ratio, ctx)
        peaks = [m.run(mb, measure_peak=True).peak_bytes for mb in dev]
        assert max(peaks) <= ctx.budget.room(ratio), (ratio, m.extra)
    assert m.extra["sac_layers"] == every_kth(4, 1)  # 3 x gc holds SAC everywhere here


def test_tune_sac_layers_takes_the_most_layers_that_fit():
    peak = lambda layers: 100 + 10 * len(layers)  # noqa: E731
    layers, _ = tune_sac_layers(peak, 12, 145, lambda m: None)
    assert layers == every_kth(12, 3)  # 4 layers: 140 <= 145; every 2nd (6 layers) would be 160


@pytest.mark.filterwarnings("ignore")
def test_compiled_peer_uses_the_chunked_head(setup):
    runners, dev = setup
    _, full = compiled_peak(runners["full"], 1.0, "full", dev[:1])
    r, chunked = compiled_peak(runners["chunked"], 1.0, "chunked", dev[:1])
    assert chunked < 0.8 * full
    g = r.run(dev[0], "as-is", grads=True).grad
    ref = runners["chunked"].run(dev[0], "no-gc", grads=True).grad
    assert float((g - ref).norm() / ref.norm()) < 1e-3


@pytest.mark.filterwarnings("ignore")
def test_compile_budget_fits_on_every_dev_microbatch(setup):
    runners, dev = setup
    gc = _peak(runners["chunked"], dev, "gc")
    ctx = MethodContext(runners, "chunked", Budget("activations", "gc", gc, 0), None, dev, log=lambda m: None, bisect_steps=2)
    m = make_method("compile-budget", 1.5, ctx)
    assert m.extra["tried"] and 0.0 <= m.extra["activation_memory_budget"] <= 1.0
    assert max(m.run(mb, measure_peak=True).peak_bytes for mb in dev) <= ctx.budget.room(1.5)
