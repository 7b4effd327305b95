"""``python -m benchmarks.planning_scale``: what planning and the hooks cost as models get deeper and
microbatches longer, on this CPU.

Two parts, each written to ``--out`` (``planning-scale.json``) as it finishes, so a stopped run resumes
where it stopped (``--redo`` measures again):

- ``depth``: a thin random-weight model of ``--depth-layers`` decoder layers (hidden 64, LoRA r8 on all
  linear layers), where the hooks' per-tensor host work is largest against the compute. Paired and
  interleaved rounds time one microbatch (forward, GRPO loss, backward) under five methods:
  ``no-gc``, ``no-gc'`` (the A/A floor: the same method again), ``engine all-H`` (every unit through
  the recovery engine's hooks, nothing recomputed: the same arithmetic as no-gc), ``gc`` (transformers'
  per-layer checkpointing) and ``engine all-R`` (every unit replayed by the engine: gc's arithmetic).
  The hooks' overhead is the median over rounds of (engine - its twin) / gc, with a bootstrap
  interval; the floor is the same statistic for no-gc' - no-gc.
- ``length``: SmolLM2-135M-Instruct (real weights, LoRA r16 all-linear, the chunked head) planned by the
  learner's own planning (``learner.plan.plan_before_wrapping``: gc's reference pass, calibration,
  profiling, fits, leave-one-out, validation; mode ``hilore``, B = 1.10 x gc's peak in device scope) on
  microbatches of 512, 2048 and 8192 tokens (4 sequences each), then gc's update of the planning
  microbatch timed ``--gc-repeats`` times. Reported: planning's wall time over gc's median update,
  planning's highest pass over B (``plan_peak_over_budget``, the resident bytes counted), and the plan.

Aims: hooks' overhead at most 3% of gc's update time; planning at most 10 gc updates of its
microbatch; planning's peak at most B at 8192 tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import torch

AIMS = {"hook_overhead": 0.03, "plan_over_gc_updates": 10.0, "plan_peak_over_budget": 1.0}
DEPTH_METHODS = ("no-gc", "no-gc'", "engine all-H", "gc", "engine all-R")
TWINS = {"engine all-H": "no-gc", "engine all-R": "gc", "no-gc'": "no-gc"}


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def _key(tokens: int, calibrate: str) -> str:
    return str(tokens) if calibrate == "later" else f"{tokens}+calibration"


def _save(out: Path, data: dict) -> None:
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(out)


def depth(layers: int, tokens: int, rounds: int, seed: int, log) -> dict:
    from benchmarks.bench.stats import bootstrap_ci
    from hilore_actor.allocation import Runner
    from hilore_actor.learner.plan import planning_microbatches
    from hilore_actor.models import LoraSpec, build_model, tiny_config

    cfg = tiny_config("qwen2", hidden_size=64, num_layers=layers, num_heads=4, vocab_size=512)
    model = build_model(cfg, lora=LoraSpec(8, 16, 0.0), seed=seed)
    model.train()
    (mb,) = planning_microbatches(
        model, 1, tokens=tokens, seqs_per_microbatch=4, group_size=4, seed=seed, loss_options={}, device="cpu"
    )
    runner = Runner(model)
    units = runner.engine.unit_names
    method = {
        "no-gc": "no-gc",
        "no-gc'": "no-gc",
        "engine all-H": {n: "H" for n in units},
        "gc": "gc",
        "engine all-R": {n: "R" for n in units},
    }
    for name in DEPTH_METHODS:  # warm-up
        runner.run(mb, method[name], timed=True)
    times = {name: [] for name in DEPTH_METHODS}
    for r in range(rounds):
        order = list(DEPTH_METHODS) if r % 2 == 0 else list(reversed(DEPTH_METHODS))
        for name in order:
            times[name].append(runner.run(mb, method[name], timed=True).seconds)
        log(f"depth round {r + 1}/{rounds}: " + ", ".join(f"{n} {times[n][-1] * 1e3:.0f} ms" for n in DEPTH_METHODS))
    overhead = {}
    for name, twin in TWINS.items():
        rel = [(a - b) / g for a, b, g in zip(times[name], times[twin], times["gc"])]
        lo, hi = bootstrap_ci(rel)
        overhead[name] = {"against": twin, "median": statistics.median(rel), "ci95": [lo, hi]}
    return {
        "layers": layers,
        "units": len(units),
        "tokens": tokens,
        "rounds": rounds,
        "seconds": {n: statistics.median(v) for n, v in times.items()},
        "times": times,
        "overhead_of_gc": overhead,
    }


def length(tokens: int, gc_repeats: int, seed: int, calibrate: str, log) -> dict:
    from hilore_actor.allocation import Runner
    from hilore_actor.grpo.microbatch import microbatch_loss
    from hilore_actor.learner.plan import plan_before_wrapping, planning_microbatches
    from hilore_actor.learner.settings import hilore_settings
    from hilore_actor.models import LoraSpec, apply_lora
    from hilore_actor.models.smollm2 import load_smollm2

    model, _ = load_smollm2()
    model = apply_lora(model, LoraSpec(16, 32, 0.0))
    model.train()
    loss_fn = partial(microbatch_loss, chunked_head=True)
    hcfg = hilore_settings(mode="hilore", budget="1.10", budget_scope="device")
    kw = dict(tokens=tokens, seqs_per_microbatch=4, group_size=4, loss_options={}, seed=seed)
    t0 = time.perf_counter()
    rp = plan_before_wrapping(
        model,
        hcfg,
        backend="hilore",
        loss_fn=loss_fn,
        std_loss_fn=loss_fn,
        device=torch.device("cpu"),
        calibrate_later=calibrate == "later",
        log=lambda *a: log(" ".join(map(str, a))),
        **kw,
    )
    plan_wall = time.perf_counter() - t0
    info = rp.info
    (mb,) = planning_microbatches(model, 1, device="cpu", **kw)  # the planning microbatch (same seed)
    runner = Runner(model, loss_fn=loss_fn)
    runner.run(mb, "gc", timed=True)  # warm-up
    gc = []
    for i in range(gc_repeats):
        gc.append(runner.run(mb, "gc", timed=True).seconds)
        log(f"length {tokens}: gc update {i + 1}/{gc_repeats} {gc[-1]:.1f} s")
    gc_s = statistics.median(gc)
    return {
        "tokens": tokens,
        "seqs": 4,
        "calibration": info.get("calibration"),
        "plan_seconds": info["plan_seconds"],
        "plan_wall_seconds": plan_wall,
        "gc_update_seconds": gc_s,
        "gc_times": gc,
        "plan_over_gc_updates": info["plan_seconds"] / gc_s,
        "plan_peak_over_budget": info["plan_peak_over_budget"],
        "plan_peak_phase": info["plan_peak_phase"],
        "budget_bytes": info["budget_bytes"],
        "gc_peak_bytes": info["gc_peak_bytes"],
        "plan": info.get("plan"),
        "phases": info.get("plan_phases"),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.planning_scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="depth,length", help="depth, length or both")
    p.add_argument("--depth-layers", type=int, default=80)
    p.add_argument("--depth-tokens", type=int, default=512)
    p.add_argument("--rounds", type=int, default=15, help="paired rounds of the depth part")
    p.add_argument("--lengths", default="512,2048,8192")
    p.add_argument("--gc-repeats", type=int, default=3)
    p.add_argument(
        "--calibrate",
        choices=("later", "now"),
        default="later",
        help="later: as the training job under ZeRO-0..2 (start-up plans H/R, L's calibration runs on the first "
        "step's rollouts); now: calibration on synthetic microbatches inside planning (ZeRO-3)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/planning-scale.json")
    p.add_argument("--redo", action="store_true", help="measure again what --out already holds")
    p.add_argument(
        "--untimed",
        action="store_true",
        help="the machine is not quiet: record the lengths' peaks and plans, and mark their times as not timings",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.exists() and not args.redo else {}
    data.setdefault("length", {})
    data["aims"] = AIMS
    command = "python -m benchmarks.planning_scale " + " ".join(argv if argv is not None else sys.argv[1:])
    data["machine"] = f"{platform.machine()}, {os.cpu_count()} CPU threads, torch {torch.__version__}"

    def log(msg):
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    parts = args.parts.split(",")
    if "depth" in parts and "depth" not in data:
        data["depth"] = depth(args.depth_layers, args.depth_tokens, args.rounds, args.seed, log)
        data["depth"].update(commit=_commit(), command=command)
        _save(out, data)
    if "depth" in data:
        d = data["depth"]
        for name, o in d["overhead_of_gc"].items():
            log(f"depth {d['layers']} layers: {name} - {o['against']} = {o['median']:+.2%} of gc ({o['ci95']})")
    for t in map(int, args.lengths.split(",")) if "length" in parts else ():
        k = _key(t, args.calibrate)
        if k in data["length"]:
            continue
        data["length"][k] = dict(
            length(t, args.gc_repeats, args.seed, args.calibrate, log),
            commit=_commit(),
            command=command,
            timed=not args.untimed,
        )
        _save(out, data)
        r = data["length"][k]
        log(
            f"length {t}: planning {r['plan_seconds']:.0f} s = {r['plan_over_gc_updates']:.1f} gc updates; "
            f"peak/B {r['plan_peak_over_budget']:.3f} ({r['plan_peak_phase']}); plan {r['plan']}"
        )
    _save(out, data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
