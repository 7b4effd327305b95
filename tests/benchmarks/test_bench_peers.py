"""Budget-tuned peers fit B on every development microbatch, and compiled peers honour the
runner's head (tiny random models: mechanism checks, not performance)."""

import pytest
from conftest import bench_setup

from benchmarks.bench.methods import Budget, MethodContext, make_method
from benchmarks.bench.peers import compiled_peak, every_kth, tune_sac_layers


@pytest.fixture(scope="module")
def setup():
    return bench_setup("llama", 4, 2)


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


@pytest.mark.slow  # torch.compile: 75 s on 2 cores (pytest -m slow)
@pytest.mark.filterwarnings("ignore")
def test_compiled_peer_uses_the_chunked_head_and_compile_budget_fits(setup):
    """Default suite, so few compiles: the full head's compiled peak sets the room, and
    compile-budget on the chunked head must land under it on every development microbatch
    (its first grid value fits, so no bisection: one compile to measure it, and the same graph
    again for the method, which inductor's cache serves; the bisection is checked on a fake
    below and on real compiles in the slow test)."""
    runners, dev = setup
    gc = _peak(runners["chunked"], dev, "gc")
    _, full = compiled_peak(runners["full"], 1.0, "full", dev)
    ctx = MethodContext(
        runners, "chunked", Budget("activations", "gc", gc, 0), None, dev, log=lambda m: None, bisect_steps=0
    )
    m = make_method("compile-budget", full / gc, ctx)
    assert m.extra["activation_memory_budget"] == 1.0
    assert m.extra["tried"]["1.0000"] < 0.8 * full  # the chunked head's compiled graph skips the logits
    assert max(m.run(mb, measure_peak=True).peak_bytes for mb in dev) <= ctx.budget.room(full / gc)
    g = m.runner.run(dev[0], "as-is", grads=True).grad
    ref = runners["chunked"].run(dev[0], "no-gc", grads=True).grad
    assert float((g - ref).norm() / ref.norm()) < 1e-3


def test_compiled_peer_on_the_chunked_head_runs_the_decoder_it_compiled(setup, monkeypatch):
    """Without compiling (torch.compile as the identity, so in the default suite): the compiled
    peer's chunked-head path calls the decoder it was given and gives the eager chunked head's
    gradient exactly (it once fell through to calling the wrapper as a model)."""
    import torch

    from benchmarks.bench.peers import compiled_runner

    runners, dev = setup
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda m, **kw: compiled.append(m) or m)
    r = compiled_runner(runners["chunked"], 1.0, head="chunked")
    g = r.run(dev[0], "as-is", grads=True).grad
    assert compiled == [r.model.get_decoder()]
    assert torch.equal(g, runners["chunked"].run(dev[0], "no-gc", grads=True).grad)


def test_tune_compile_budget_scans_down_then_bisects(monkeypatch):
    """The grid from the top down to the first value that fits, then the interval above it
    bisected; when no grid value fits (0 peaks highest here, as on CPU inductor), a clear error."""
    import benchmarks.bench.peers as peers

    peak = lambda b: 300 if b == 0.0 else int(100 + 100 * b)  # noqa: E731 - 0 recomputes up front
    monkeypatch.setattr(peers, "compiled_peak", lambda runner, b, head, dev: (None, peak(b)))
    value, tried = peers.tune_compile_budget(None, "chunked", 160, [None], 2, lambda m: None)
    assert sorted(tried) == [0.5, 0.5625, 0.625, 0.75, 1.0] and value == 0.5625  # 156 fits, 162 not
    with pytest.raises(peers.PeerUnavailable, match="no activation_memory_budget"):
        peers.tune_compile_budget(None, "chunked", 99, [None], 3, lambda m: None)


@pytest.mark.slow  # torch.compile: 70-90 s on 2 cores (pytest -m slow tests/benchmarks/test_bench_peers.py)
@pytest.mark.filterwarnings("ignore")
def test_compile_budget_fits_on_every_dev_microbatch_after_bisection(setup):
    runners, dev = setup
    gc = _peak(runners["chunked"], dev, "gc")
    ctx = MethodContext(
        runners, "chunked", Budget("activations", "gc", gc, 0), None, dev, log=lambda m: None, bisect_steps=2
    )
    m = make_method("compile-budget", 1.5, ctx)
    assert m.extra["tried"] and 0.0 <= m.extra["activation_memory_budget"] <= 1.0
    assert max(m.run(mb, measure_peak=True).peak_bytes for mb in dev) <= ctx.budget.room(1.5)
