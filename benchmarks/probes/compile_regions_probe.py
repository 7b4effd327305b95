"""How much of compile-budget's lead over hilore+compile is the size of the compiled region,
how much is the recovery engine, and whether the whole-decoder graph slows down after another
compiled copy ran (its times in `cpu-real-compile` were bimodal with the phase's order).

No-gc update times of one workload's microbatches on copies of the model (some timed twice),
interleaved in alternating order (A B C ..., ... C B A), every copy warmed up on every microbatch first:

- ``decoder``: the whole decoder compiled, as the compile-budget peer builds it
  (``peers.compiled_runner`` at activation_memory_budget 1.0);
- ``decoder-aa``: the same copy timed again in its own slot, the A/A floor of the ratios;
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
time, the order and the in-microbatch peaks go to the JSON. ``--copies`` times a subset (every
copy is warmed up and held in memory, so on cpu-real a few copies are what fits the time);
``--decoder-budget`` builds ``decoder`` at the activation_memory_budget compile-budget chose in a
benchmark run (1.0: the compiled model's own no-gc); ``--region-budget`` builds the unit and
layer-region copies at an activation_memory_budget of their own (``compile_units``'s
``activation_budget``), so the regions can be timed at the decoder's memory trade.

python -m benchmarks.probes.compile_regions_probe --workload cpu-small --repeats 6 --json OUT
python -m benchmarks.probes.compile_regions_probe --workload cpu-real --repeats 8 \
    --copies decoder,decoder-aa,regions,regions+engine-H --decoder-budget 0.9375 --json OUT
python -m benchmarks.probes.compile_regions_probe --workload cpu-real --repeats 6 \
    --copies decoder,decoder-aa,regions,regions+engine-H --decoder-budget 0.9375 --region-budget 0.9375 --json OUT

Frozen evidence, not maintained against the engine or the benchmark: its runs
(``benchmarks/results/compile-regions/``) are what ``docs/compile.md`` quotes in "How much a
larger region buys" (section "Benchmark rows"). It compiles every copy it times (minutes), so no
test runs it; it may need changes to run against later code.
"""

import argparse
import copy
import json
import statistics
import subprocess
import time
import types
from functools import partial

import torch

from benchmarks.bench.inputs import build_inputs
from benchmarks.bench.methods import head_runners
from benchmarks.bench.peers import compiled_runner
from benchmarks.bench.workloads import WORKLOADS
from hilore_actor.allocation import Runner
from hilore_actor.recovery import RecoveryEngine
from hilore_actor.recovery.compiled import compile_units
from hilore_actor.runtime import MemoryMeter


def without_hooks(model):
    """A copy of ``model`` with no module hooks (the benchmark's engine left its hooks on it)."""
    m = copy.deepcopy(model)
    for sub in m.modules():
        for d in (
            "_forward_hooks",
            "_forward_pre_hooks",
            "_forward_hooks_with_kwargs",
            "_forward_pre_hooks_with_kwargs",
            "_forward_hooks_always_called",
        ):
            getattr(sub, d).clear()
    return m


def plain(model, loss_fn):
    """One microbatch's forward and backward with plain autograd on ``model``."""

    def run(mb):
        loss_fn(model, mb).loss.backward()

    return run


COPIES = ("decoder", "decoder-aa", "layers", "units", "units+engine-H", "regions", "regions+engine-H")


def variants(runner, copies=COPIES, decoder_budget: float = 1.0, region_budget: float = 1.0):
    """name -> (run one microbatch, the copy's model, whose gradients ``update`` zeroes), for
    ``copies`` (only those are built); built after ``compiled_runner``'s ``torch._dynamo.reset()``,
    so every copy's graphs stay cached."""
    loss_fn = runner.loss_fn
    dec = compiled_runner(runner, decoder_budget, head="chunked")
    out = {"decoder": (lambda mb: dec.run(mb, "as-is", accumulate=True), dec.model)}
    out["decoder-aa"] = out["decoder"]  # the same copy timed again: the A/A floor
    if "layers" in copies:
        layers_model = without_hooks(runner.model)
        for layer in layers_model.get_decoder().layers:
            layer.forward = torch.compile(layer.forward)
        out["layers"] = (plain(layers_model, loss_fn), layers_model)
    for regions in (False, True):
        name = "regions" if regions else "units"
        if name not in copies and f"{name}+engine-H" not in copies:
            continue
        model = without_hooks(runner.model)
        engine = RecoveryEngine(model, codec=runner.engine.codec.name)
        compile_units(engine, activation_budget=region_budget, layer_regions=regions)
        twin = Runner(model, engine, loss_fn=loss_fn)
        out[name] = (plain(model, loss_fn), model)
        out[f"{name}+engine-H"] = (partial(twin.run, method="all-h", accumulate=True, regions=regions), model)
    return {n: out[n] for n in copies}


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
    p.add_argument("--copies", default=",".join(COPIES), help="comma list, decoder first: " + ", ".join(COPIES))
    p.add_argument("--decoder-budget", type=float, default=1.0, help="activation_memory_budget of the decoder copy")
    p.add_argument(
        "--region-budget", type=float, default=1.0, help="activation_memory_budget of the units and regions copies"
    )
    p.add_argument("--json", required=True)
    a = p.parse_args()
    copies = [c.strip() for c in a.copies.split(",") if c.strip()]
    if not copies or copies[0] != "decoder" or set(copies) - set(COPIES):
        p.error(f"--copies: a comma list that starts with decoder, of {', '.join(COPIES)}")
    torch.manual_seed(0)
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()  # the code that runs
    args = types.SimpleNamespace(updates=1, calib_tokens=None, seed=0, model_config=None, arch=None)
    inputs = build_inputs(WORKLOADS[a.workload], args, torch.device("cpu"), 0)
    runner = head_runners(inputs.model, RecoveryEngine(inputs.model))["chunked"]
    if not (0.0 <= a.decoder_budget <= 1.0 and 0.0 <= a.region_budget <= 1.0):
        p.error("--decoder-budget and --region-budget: values within [0, 1]")
    vs = variants(runner, copies, a.decoder_budget, a.region_budget)
    mbs = inputs.updates[0]
    peaks = {}
    warmed = {}
    for name, (run, model) in vs.items():
        if id(run) in warmed:  # decoder-aa: the decoder's copy, warmed up once
            peaks[name] = peaks[warmed[id(run)]]
            continue
        for _ in range(2):  # compiles: a static graph, then (units) a dynamic one
            update(run, model, mbs + inputs.dev)
        with MemoryMeter(torch.device("cpu")) as m:
            run(mbs[0])
        peaks[name], warmed[id(run)] = m.report.peak_bytes, name
        print(f"[probe] {name}: warmed up, peak {peaks[name]} B", flush=True)
    names, times, order = list(vs), {n: [] for n in vs}, []
    for rep in range(a.repeats):
        for name in names if rep % 2 == 0 else names[::-1]:
            run, model = vs[name]
            times[name].append(update(run, model, mbs))
            order.append(name)
            print(f"[probe] repeat {rep + 1} {name}: {times[name][-1]:.3f} s", flush=True)
    med = {n: statistics.median(t) for n, t in times.items()}
    paired = {n: statistics.median(x / y for x, y in zip(times[n], times["decoder"])) for n in names}
    out = {
        "workload": a.workload,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "git_commit": commit,
        "command": f"python -m benchmarks.probes.compile_regions_probe --workload {a.workload} --repeats {a.repeats}"
        f" --copies {','.join(copies)} --decoder-budget {a.decoder_budget} --region-budget {a.region_budget}",
        "decoder_budget": a.decoder_budget,
        "region_budget": a.region_budget,
        "tokens_per_update": sum(mb.num_tokens for mb in mbs),
        "order": order,
        "times": times,
        "median_seconds": med,
        "paired_median_over_decoder": paired,
        "peak_bytes_one_microbatch": peaks,
    }
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)
    for n in names:
        print(
            f"[probe] {n:16s} median {med[n]:.3f} s, time / decoder's (paired median) {paired[n]:.3f}, "
            f"peak {peaks[n]} B"
        )


if __name__ == "__main__":
    main()
