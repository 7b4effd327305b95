"""How much of compile-budget's lead over hilore+compile is the size of the compiled region,
how much is the recovery engine, and whether the whole-decoder graph slows down after another
compiled copy ran (its times in `cpu-real-compile` were bimodal with the phase's order).

No-gc update times of one workload's microbatches, five copies of the model (two runs of one),
interleaved in alternating order (A B C ..., ... C B A), every copy warmed up on every microbatch first:

- ``decoder``: the whole decoder compiled, as the compile-budget peer builds it
  (``peers.compiled_runner`` at activation_memory_budget 1.0);
- ``layers``: each decoder layer's ``forward`` compiled in place, no engine hooks;
- ``units``: each recovery unit's module ``forward`` compiled (``compile_units``), the engine
  attached but idle (plain autograd through per-unit graphs);
- ``units+engine-H``: the same copy under an engine step with every unit H (what an all-H
  HiLoRe plan runs without layer regions);
- ``regions``: units and layers compiled (``compile_units(layer_regions=True)``), the engine
  idle: each layer runs its region, as the compiled model's no-gc does;
- ``regions+engine-H``: the same copy under an engine step with every unit H and regions on
  (what an all-H HiLoRe plan runs with ``--hilore.compile_layer_regions``).

Run it with ``TORCH_LOGS=recompiles`` to see whether a copy recompiles between repeats. Every
time, the order and the in-microbatch peaks go to the JSON.

python benchmarks/compile_regions_probe.py --workload cpu-small --repeats 6 --json OUT
"""
import argparse
import copy
import json
import statistics
import subprocess
import time
import types

import torch

from hilore_actor.allocation import Runner
from hilore_actor.bench.inputs import build_inputs
from hilore_actor.bench.methods import head_runners
from hilore_actor.bench.peers import compiled_runner
from hilore_actor.bench.workloads import WORKLOADS
from hilore_actor.recovery import RecoveryEngine
from hilore_actor.recovery.compiled import compile_units
from hilore_actor.runtime import MemoryMeter


def without_hooks(model):
    """A copy of ``model`` with no module hooks (the benchmark's engine left its hooks on it)."""
    m = copy.deepcopy(model)
    for sub in m.modules():
        for d in ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs",
                  "_forward_hooks_always_called"):
            getattr(sub, d).clear()
    return m


def plain(model, loss_fn):
    """One microbatch's forward and backward with plain autograd on ``model``."""
    def run(mb):
        loss_fn(model, mb).loss.backward()
    return run


def variants(runner):
    """name -> (run one microbatch, the copy's model, whose gradients ``update`` zeroes); built after ``compiled_runner``'s
    ``torch._dynamo.reset()``, so every copy's graphs stay cached."""
    loss_fn = runner.loss_fn
    dec = compiled_runner(runner, 1.0, head="chunked")
    layers_model = without_hooks(runner.model)
    for layer in layers_model.get_decoder().layers:
        layer.forward = torch.compile(layer.forward)
    units_model = without_hooks(runner.model)
    engine = RecoveryEngine(units_model, codec=runner.engine.codec.name)
    compile_units(engine)
    twin = Runner(units_model, engine, loss_fn=loss_fn)
    regions_model = without_hooks(runner.model)
    regions_engine = RecoveryEngine(regions_model, codec=runner.engine.codec.name)
    compile_units(regions_engine, layer_regions=True)
    regions_twin = Runner(regions_model, regions_engine, loss_fn=loss_fn)
    out = {"decoder": (lambda mb: dec.run(mb, "as-is", accumulate=True), dec.model),
           "layers": (plain(layers_model, loss_fn), layers_model),
           "units": (plain(units_model, loss_fn), units_model),
           "units+engine-H": (lambda mb: twin.run(mb, "all-h", accumulate=True), units_model),
           "regions": (plain(regions_model, loss_fn), regions_model),
           "regions+engine-H": (lambda mb: regions_twin.run(mb, "all-h", accumulate=True, regions=True), regions_model)}
    return out


def update(run, model, mbs) -> float:
    for p in model.parameters():
        p.grad = None
    t = time.perf_counter()
    for mb in mbs:
        run(mb)
    return time.perf_counter() - t


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--workload", default="cpu-small")
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--json", required=True)
    a = p.parse_args()
    torch.manual_seed(0)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()  # the code that runs
    args = types.SimpleNamespace(updates=1, calib_tokens=None, seed=0, model_config=None, arch=None)
    inputs = build_inputs(WORKLOADS[a.workload], args, torch.device("cpu"), 0)
    runner = head_runners(inputs.model, RecoveryEngine(inputs.model))["chunked"]
    vs = variants(runner)
    mbs = inputs.updates[0]
    peaks = {}
    for name, (run, model) in vs.items():
        for _ in range(2):  # compiles: a static graph, then (units) a dynamic one
            update(run, model, mbs + inputs.dev)
        with MemoryMeter(torch.device("cpu")) as m:
            run(mbs[0])
        peaks[name] = m.report.peak_bytes
        print(f"[probe] {name}: warmed up, peak {peaks[name]} B", flush=True)
    names, times, order = list(vs), {n: [] for n in vs}, []
    for rep in range(a.repeats):
        for name in (names if rep % 2 == 0 else names[::-1]):
            run, model = vs[name]
            times[name].append(update(run, model, mbs))
            order.append(name)
            print(f"[probe] repeat {rep + 1} {name}: {times[name][-1]:.3f} s", flush=True)
    med = {n: statistics.median(t) for n, t in times.items()}
    paired = {n: statistics.median(x / y for x, y in zip(times[n], times["decoder"])) for n in names}
    out = {"workload": a.workload, "torch": torch.__version__, "threads": torch.get_num_threads(), "git_commit": commit,
           "command": f"python benchmarks/compile_regions_probe.py --workload {a.workload} --repeats {a.repeats}",
           "tokens_per_update": sum(mb.num_tokens for mb in mbs), "order": order, "times": times,
           "median_seconds": med, "paired_median_over_decoder": paired, "peak_bytes_one_microbatch": peaks}
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)
    for n in names:
        print(f"[probe] {n:16s} median {med[n]:.3f} s, time / decoder's (paired median) {paired[n]:.3f}, peak {peaks[n]} B")


if __name__ == "__main__":
    main()
