"""Probe compile-budget's peak at several activation_memory_budget values on a workload's
development microbatches (the same inputs the benchmark builds for that seed), for a result
whose compile-budget search only tried the ends of [0, 1].

python -m benchmarks.probes.compile_probe --workload cpu-ref --room BYTES [--known 1.0=PEAK,0.0=PEAK] --json OUT

Maintained with the benchmark: ``tests/benchmarks/test_benchmarks_probes.py`` runs it on cpu-small with a known
peak that fits, so the search ends without compiling.
"""

import argparse
import json
import types

import torch

from benchmarks.bench.inputs import build_inputs
from benchmarks.bench.methods import head_runners
from benchmarks.bench.peers import PeerUnavailable, tune_compile_budget
from benchmarks.bench.workloads import WORKLOADS
from hilore_actor.recovery import RecoveryEngine

p = argparse.ArgumentParser()
p.add_argument("--workload", default="cpu-ref")
p.add_argument("--room", type=int, required=True, help="in-microbatch room of the budget (from the run's log)")
p.add_argument("--known", default="", help="value=peak pairs already measured by the run")
p.add_argument("--steps", type=int, default=2)
p.add_argument("--head", default="chunked")
p.add_argument("--json", required=True)
a = p.parse_args()
args = types.SimpleNamespace(updates=3, calib_tokens=None, seed=0, model_config=None, arch=None)
inputs = build_inputs(WORKLOADS[a.workload], args, torch.device("cpu"), 0)
runners = head_runners(inputs.model, RecoveryEngine(inputs.model))
cache = {float(k): int(v) for k, v in (kv.split("=") for kv in a.known.split(",") if kv)}
try:
    value, tried = tune_compile_budget(runners[a.head], a.head, a.room, inputs.dev, a.steps, print, cache=cache)
    result = {"fits_at": value}
except PeerUnavailable as e:
    tried, result = dict(cache), {"unavailable": str(e)}
out = {
    "workload": a.workload,
    "head": a.head,
    "room_bytes": a.room,
    "known_from_run": a.known,
    "steps": a.steps,
    "peaks": {f"{k:.4f}": v for k, v in sorted(cache.items())},
    **result,
}
json.dump(out, open(a.json, "w"), indent=1)
print(out)
