"""Benchmark command line (see ``python -m benchmarks.bench --help``).

One run: build the model and microbatches (``inputs``), measure the run that defines B
(``--budget-from``, in ``--budget-scope``), calibrate once, prepare every method at every
budget (HiLoRe's unit costs and calibration are shared across budgets), time them interleaved
(``timing``), measure their peaks and gradient errors, and write the records (``records``,
``outputs``). With ``--json``, the file is rewritten after each finished piece of work, and on
SIGTERM the run stops and writes why (``partial``), so a run cut short keeps what it finished.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from hilore_actor.recovery.codecs import DEFAULT_CODECS
from .workloads import WORKLOADS

DEFAULT_METHODS = "no-gc,gc,gc+full,sac,sac-budget,compile-budget,all-l,hilore-hr,hilore-static,hilore"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="cpu-small", choices=sorted(WORKLOADS), help="pinned workload")
    p.add_argument(
        "--arch", choices=("qwen2", "llama", "phi3"), help="override a random-weight workload's model family"
    )
    p.add_argument(
        "--model-config", help="any HF causal-LM config.json (random weights) instead of the workload's shape"
    )
    p.add_argument(
        "--methods",
        default=DEFAULT_METHODS,
        help="comma list: no-gc, gc, gc-aa (a second gc: the A/A floor, added to every timed run with gc), sac, "
        "sac-budget, compile-budget, compile-fp8, all-h, all-r, all-l, all-p, all-p:core, "
        "hilore-hr, hilore-static, hilore-coarse, hilore-p, hilore-hr-p, hilore; a '+full' suffix runs "
        "that method with full float32 logits (gc+full: the OpenRLHF default); a '+compile' suffix runs "
        "it on a copy of the model whose recovery units are compiled (gc+compile, hilore+compile)",
    )
    p.add_argument(
        "--head",
        default="chunked",
        choices=("chunked", "full"),
        help="LM head of every method: chunked token log-probs (what the product runs) or full logits",
    )
    p.add_argument(
        "--budget-from",
        default="gc",
        choices=("gc", "gc+full"),
        help="the run whose peak is B at ratio 1: gc with the same head as everyone (the paper's B_GC), "
        "or gc with full float32 logits (what an OpenRLHF user's gc needs today)",
    )
    p.add_argument(
        "--budget-scope",
        default="device",
        choices=("device", "activations"),
        help="device: weights, gradients, AdamW state, activations and head (the paper's B_GC); "
        "activations: bytes allocated inside a microbatch",
    )
    p.add_argument("--budgets", default="1.10", help="comma list of budgets as ratios of the --budget-from peak")
    p.add_argument("--repeats", type=int, default=7, help="interleaved timing repeats per method (>= 7 on noisy CPUs)")
    p.add_argument(
        "--no-aa", action="store_true", help="do not add gc-aa (the A/A floor) to a run with gc and several repeats"
    )
    p.add_argument(
        "--updates", type=int, default=3, help="distinct measured updates (each = the workload's microbatches)"
    )
    p.add_argument("--calib", type=int, default=16, help="calibration microbatches for HiLoRe's risk (C)")
    p.add_argument(
        "--calibration", default=None, help="calibration JSON: reused when it exists, written after calibrating"
    )
    p.add_argument(
        "--calib-tokens", type=int, default=None, help="tokens per calibration microbatch (default: the workload's)"
    )
    p.add_argument("--no-loo", action="store_true", help="skip HiLoRe's leave-one-out validation (faster preparation)")
    p.add_argument(
        "--bisect-steps", type=int, default=4, help="compile-budget: bisection steps of activation_memory_budget"
    )
    p.add_argument(
        "--compile-activation-budget",
        type=float,
        default=1.0,
        help="+compile methods: torch's activation_memory_budget for each compiled unit's graph, in [0, 1] "
        "(1: the partitioner's fastest cut; lower: it recomputes cheap fused ops and H keeps less)",
    )
    p.add_argument(
        "--compile-layer-regions",
        action="store_true",
        help="+compile methods: also one compiled region per decoder layer, run where a planned microbatch keeps "
        "the layer's units all H or all R, and by gc+compile (docs/compile.md)",
    )
    p.add_argument(
        "--codec",
        default=DEFAULT_CODECS,
        help="L codec(s), a comma list (hilore_actor.recovery.CODECS): int8, int8-g64, "
        "int8-g128, int8-outlier, bf16, fp8-e4m3, fp8-e4m3-b32, fp8-e5m2; each one after the first is one more L "
        "level per unit for HiLoRe's knapsack (all-l uses the first)",
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument(
        "--cpu-meter",
        default="profiler",
        choices=("profiler", "storage"),
        help="how CPU peaks are measured: the torch profiler's allocation events, or live tensor storages "
        "(no event log; for models whose CPU path is a long loop of small ops, e.g. state-space "
        "scans; misses ops' internal buffers). Compare peaks from one meter only",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write records here")
    p.add_argument("--plot", default=None, help="write the frontier plot (PNG) here")
    p.add_argument("--markdown", default=None, help="write a markdown table here")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args, argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _log(msg: str) -> None:
    print(msg, flush=True)


def _rss() -> str:
    """This process's resident memory, for the progress lines: a run of several methods in one
    process once grew to 24 GB and was killed (cpu-ref-a piece 5; the CPU meter's profiler
    outliving it, ``runtime/memory.py``); empty where /proc is absent."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return ""
    return f", RSS {pages * os.sysconf('SC_PAGE_SIZE') / 2**30:.1f} GiB"


def method_names(args) -> List[str]:
    from hilore_actor.recovery.policies import ENGINE_POLICIES
    from .methods import COMPILABLE, COMPILE, OURS, PEERS, split_name
    from .timing import AA

    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    known = {"no-gc", "gc", AA, *ENGINE_POLICIES, *PEERS, *OURS}
    for n in names:
        if n.endswith(COMPILE) and n[: -len(COMPILE)] not in COMPILABLE:
            raise ValueError(f"{n!r}: {COMPILE} applies to {', '.join(COMPILABLE)}")
        if not n.endswith(COMPILE) and split_name(n)[0] not in known:
            raise ValueError(
                f"unknown method {n!r}; known: {', '.join(sorted(known))}, each optionally with the suffix +full"
            )
    if args.repeats < 1 or args.updates < 1:
        raise ValueError("--repeats and --updates must be at least 1")
    if not 0.0 <= args.compile_activation_budget <= 1.0:
        raise ValueError(f"--compile-activation-budget must lie in [0, 1], got {args.compile_activation_budget}")
    if "gc" in names and AA not in names and args.repeats > 1 and not args.no_aa:
        names.insert(names.index("gc") + 1, AA)
    return names


def measure_budget(runners, inputs, args):
    """B at ratio 1: the ``--budget-from`` run's peak over the first update, in the scope."""
    from .methods import Budget, MethodContext, make_method
    from .scope import resident_bytes

    head = "full" if args.budget_from == "gc+full" else args.head
    probe = MethodContext(runners, head, Budget(args.budget_scope, args.budget_from, 1, 0), None, inputs.dev)
    gc = make_method("gc", None, probe)
    peaks = gc.peaks(inputs.updates[0])
    runner = runners[head]
    if args.budget_scope == "device":
        trainable = sum(p.numel() * p.element_size() for p in runner.params)
        offset = resident_bytes(runner.model, gc.optimizer) + trainable
        return Budget("device", args.budget_from, peaks.device_peak, offset)
    return Budget("activations", args.budget_from, max(peaks.activations), 0)


def needs_calibration(names) -> bool:
    """Every HiLoRe mode but hilore-hr uses L's calibrated risk."""
    return any(n.startswith("hilore") and not n.startswith("hilore-hr") for n in names)


def calibration_for(args, runner, inputs, names):
    """``{L level: calibration}`` for every codec of ``--codec`` (a comma list), or None."""
    from hilore_actor.allocation.calibration import calibrate_levels, check_levels, load_levels, save_levels
    from hilore_actor.recovery.labels import codec_levels

    if not needs_calibration(names):
        return None
    levels = codec_levels(args.codec)[1]
    if args.calibration and Path(args.calibration).is_file():
        _log(f"[bench] calibration reused from {args.calibration}")
        cal = load_levels(args.calibration)
        check_levels(cal, args.codec, args.calibration)
        return cal
    t = time.perf_counter()
    cal = calibrate_levels(
        runner,
        inputs.calib,
        levels,
        progress=lambda d, n: _log(f"[bench] calibration {d}/{n}") if d % 10 == 0 else None,
    )
    _log(
        f"[bench] calibrated {', '.join(levels)} on {len(inputs.calib)} microbatches in {time.perf_counter() - t:.0f}s"
    )
    if args.calibration:
        save_levels(cal, args.calibration)
    return cal


def prepare_methods(names, budgets, ctx, on_ready=None):
    """``on_ready(entry)`` after each method (``partial``): its name, budget, preparation time
    and HiLoRe's plan with its validation, or why it did not run."""
    from .methods import is_budgeted, make_method
    from .peers import PeerUnavailable
    from .records import plan_evidence

    entries, unavailable = [], []
    for name in names:
        for b in budgets if is_budgeted(name) else [None]:
            t = time.perf_counter()
            try:
                m = make_method(name, b, ctx)
                if m.hilore is not None:
                    m.hilore.prepare(ctx.dev)
            except (PeerUnavailable, RuntimeError, ValueError) as e:  # names are valid: this is a result
                unavailable.append({"method": name, "budget_ratio": b, "unavailable": str(e)})
                _log(f"[bench] {name}: not run: {e}")
                if on_ready is not None:
                    on_ready(dict(unavailable[-1]))
                continue
            m.prepare_seconds = time.perf_counter() - t
            entries.append(m)
            _log(f"[bench] ready: {name}{'' if b is None else f' @ {b:.2f}'} ({m.prepare_seconds:.0f}s{_rss()})")
            if on_ready is not None:
                on_ready(
                    {
                        "method": name,
                        "budget_ratio": b,
                        "prepare_seconds": m.prepare_seconds,
                        **(plan_evidence(m.hilore) if m.hilore is not None else {}),
                    }
                )
    return entries, unavailable


def measure_records(entries, timings, inputs, budget, budgets, ref_runner, on_record=None) -> List[Dict]:
    """``on_record(record)`` after each method (``partial``)."""
    from .records import add_gap_recovered, method_record
    from .timing import AA

    ref_grads = [
        sum(ref_runner.run(mb, "no-gc", grads=True, seed=i).grad for i, mb in enumerate(u)) for u in inputs.updates
    ]
    records, measured = [], {}
    for m in sorted(entries, key=lambda m: m.name == AA):  # gc-aa runs gc's code: it takes gc's peaks and errors
        if m.isolated:
            m.rebuild()
        if m.name == AA and "gc" in measured:
            peaks, errs = measured["gc"]
        else:
            peaks = [m.peaks(u) for u in inputs.updates]
            errs = [float((m.grad(u) - g).norm() / g.norm()) for u, g in zip(inputs.updates, ref_grads)]
        measured[m.name] = peaks, errs
        records.append(method_record(m, timings[id(m)], peaks, errs, budget, budgets, inputs.tokens_per_update))
        if on_record is not None:
            on_record(records[-1])
        _log(f"[bench] measured {m.name}{'' if m.budget_ratio is None else f' @ {m.budget_ratio:.2f}'}{_rss()}")
    add_gap_recovered(records)
    return records


def git_state() -> Tuple[Optional[str], Optional[bool]]:
    """(commit, package tree dirty?) of the code that runs: read at the start, since a run
    lasts hours and the tree may change before it ends."""
    here = Path(__file__).parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=here).stdout.strip()
        dirty = bool(
            subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no", "--", "."],
                capture_output=True,
                text=True,
                cwd=here.parent,
            ).stdout.strip()
        )
    except OSError:
        return None, None
    return commit or None, dirty


def header(args, argv, wl, device, budget, inputs, git: Tuple[Optional[str], Optional[bool]]) -> Dict:
    import torch

    commit, dirty = git
    workload = wl.describe()
    if args.model_config:  # the model is the config file's, not the workload's shape: record it
        import json

        cfg = json.loads(Path(args.model_config).read_text())
        workload.update(arch=cfg.get("model_type"), model=cfg)
    return {
        "workload": workload,
        "torch": torch.__version__,
        "git_commit": commit,
        "git_dirty": dirty,
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "threads": torch.get_num_threads(),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
        "head": args.head,
        "budget_from": budget.base_run,
        "budget_scope": budget.scope,
        "budget_base_bytes": budget.peak,
        "budget_offset_bytes": budget.offset,
        "budgets": [float(b) for b in args.budgets.split(",")],
        "repeats": args.repeats,
        "updates": args.updates,
        "calib": args.calib,
        "calib_tokens": args.calib_tokens or wl.calib_tokens,
        "loo": not args.no_loo,
        "codec": args.codec,
        "inputs": inputs.provenance,
        "cpu_meter": args.cpu_meter if device.type == "cpu" else None,
        "command": command(argv),
    }


def command(argv) -> str:
    return "python -m benchmarks.bench " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )


def run(args, argv) -> int:
    """``run_measured`` with the ``--json`` file kept current (``partial``); SIGTERM stops the
    run with exit status 143 and the file saying where it stopped."""
    from .partial import Progress, Stopped, stop_on_sigterm

    method_names(args)  # a bad argument is an error before any file is written
    progress = Progress(args.json, command(argv), args.workload)
    with stop_on_sigterm():
        try:
            return run_measured(args, argv, progress)
        except Stopped as e:
            progress.stopped(f"{e} during {progress.doc['partial']['stage']}")
            _log(
                f"[bench] stopped ({e}) during {progress.doc['partial']['stage']}"
                + (f"; {args.json} keeps what finished" if args.json else "")
            )
            return 143
        except Exception as e:
            progress.stopped(f"{type(e).__name__}: {e}")
            raise


def run_measured(args, argv, progress) -> int:
    import torch

    from hilore_actor.recovery import RecoveryEngine
    from hilore_actor.recovery.labels import codec_levels
    from hilore_actor.runtime import memory
    from . import outputs
    from .inputs import build_inputs
    from .methods import MethodContext, head_runners

    git = git_state()
    memory.CPU_METER = args.cpu_meter
    names = method_names(args)
    budgets = [float(b) for b in args.budgets.split(",")]
    wl = WORKLOADS[args.workload]
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(args.seed)
    inputs = build_inputs(wl, args, device, args.calib if needs_calibration(names) else 0, log=_log)
    runners = head_runners(inputs.model, RecoveryEngine(inputs.model, codec=codec_levels(args.codec)[0]))
    progress.stage("measuring B", done="model and microbatches built")
    budget = measure_budget(runners, inputs, args)
    _log(
        f"[bench] {wl.name}: {sum(p.numel() for p in inputs.model.parameters()) / 1e6:.1f}M params; B at 1.00 = "
        f"{budget.peak / 2**20:.1f} MiB ({budget.base_run}, {budget.scope} scope, head {args.head})"
    )
    head = header(args, argv, wl, device, budget, inputs, git)
    progress.stage("calibration" if needs_calibration(names) else "preparing methods", done="B measured", **head)
    cal = calibration_for(args, runners[args.head], inputs, names)
    progress.stage("preparing methods", done="calibration" if cal is not None else None)
    ctx = MethodContext(
        runners,
        args.head,
        budget,
        cal,
        inputs.dev,
        log=_log,
        loo=not args.no_loo,
        bisect_steps=args.bisect_steps,
        compile_activation_budget=args.compile_activation_budget,
        compile_layer_regions=args.compile_layer_regions,
    )
    entries, unavailable = prepare_methods(names, budgets, ctx, on_ready=progress.prepared)
    from .timing import time_methods

    timings, phases = time_methods(entries, inputs.updates, args.repeats, _log, progress=progress.phase_times)
    progress.stage("measuring peaks and gradients", done="timing")
    records = (
        measure_records(entries, timings, inputs, budget, budgets, runners[args.head], on_record=progress.record)
        + unavailable
    )
    head["phases"] = [{"label": p.label, "times": p.times} for p in phases]
    print(outputs.table(records))
    if args.json:
        outputs.write_json(args.json, head, records)
    progress.finished()
    if args.markdown:
        Path(args.markdown).write_text(outputs.markdown(records, head))
    if args.plot:
        outputs.plot(
            args.plot, records, budgets, f"{wl.name}: throughput vs peak ({budget.scope} scope), relative to gc"
        )
    return 0
