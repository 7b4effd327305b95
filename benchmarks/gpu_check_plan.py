"""The time plan of ``benchmarks/gpu_check.sh``: every stage's estimate, timeout and headroom.

The rule: each stage's timeout is at least twice its estimate, and the timeouts add up to at
most 540 s (one command on the lent machine runs for at most 600 s). A stage that times out
loses the one GPU check a task may get, so every estimate here errs long.

Estimates (docs/benchmark.md, "One GPU check"):

- ``selfcheck``, ``cuda-tests`` and the CPU side of ``verl``: measured on a CPU (2 cores,
  loaded), plus CUDA's start-up.
- ``gpu-ref``: counted from the benchmark's code (``gpu_ref_passes``: every forward and
  backward pass of ``python -m benchmarks.bench`` with the stage's arguments), each pass
  costed from its FLOPs at a conservative achieved rate, plus fixed costs. The count follows
  the arguments, so ``GPU_CHECK_BENCH_ARGS="--repeats 5"`` moves the estimate too.

Only the standard library is imported: the script runs this with any Python, before its
self-check. ``python benchmarks/gpu_check_plan.py [--timeouts | --check] [--explain] -- BENCH
ARGS``: ``--timeouts`` prints ``stage timeout estimate`` lines for the script, otherwise the
table is printed; ``--check`` exits 1 where a headroom is under 2 or the total over 540 s.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, NamedTuple, Tuple

MAX_TOTAL = 540  # seconds of timeouts, all stages together
MIN_HEADROOM = 2.0  # timeout / estimate, every stage

# the gpu-ref workload (benchmarks/bench/workloads.py) and the benchmark's defaults of the counted arguments
# (benchmarks/bench/cli.py); tests/benchmarks/test_gpu_check.py keeps both equal to the benchmark's own
GPU_REF = dict(
    num_layers=36,
    hidden_size=2048,
    intermediate_size=11008,
    num_heads=16,
    num_kv_heads=2,
    vocab_size=151936,
    microbatches=4,
    tokens=4096,
    calib_tokens=1024,
)
BENCH_DEFAULTS = dict(
    methods="no-gc,gc,gc+full,sac,sac-budget,compile-budget,all-l,hilore-hr,hilore-static,hilore",
    budgets="1.10",
    repeats=7,
    updates=3,
    calib=16,
    calib_tokens=None,
    codec="int8-g64,bf16",
)

# ---- what one pass costs ----
TFLOPS = 150.0  # achieved bf16 TFLOP/s of an eager HF model on an H100: the low end of 150-250 (big matmuls: ~800)
PASS_OVERHEAD_S = 0.1  # per pass: hooks on 72 units, peak-meter resets and synchronisations, gradient copies
START_S = 15.0  # python, torch, transformers and peft imports, the CUDA context, cuBLAS
MODEL_S = 30.0  # the 3B model's random init on the CPU (~25 s), LoRA, 6.2 GB copied to the GPU
# ---- how many passes (the loops of hilore_actor/allocation/planner.py and profiling.py) ----
PROFILE_REPEATS = 3  # bench.methods.PROFILE_REPEATS (the benchmark's Planner.Config.profile_repeats)
PROBES = 4  # prefix probes: probe_bytes stops at three of one bundle structure; one more if the structure changes
FIT_ATTEMPTS = 5  # Planner._fit(attempts=5), per risk scale
VALIDATIONS = 2  # Planner._validate: the first check and one re-plan (six failing ones end the run)
LOO_UNITS, LOO_REPEATS = 4, 3  # Planner.Config.loo_units, Planner._drop_useless(repeats=3)
P_LEVELS, UNIT_KINDS = 2, 2  # profiling.P_LABELS ("P", "P:core"); attention and MLP units
RISK_SCALES = {"hilore": 4, "hilore-static": 2, "hilore-hr": 1}  # len(Planner.scales) per mode
HILORE = {
    "hilore-hr": ("hilore-hr", False),
    "hilore-static": ("hilore-static", False),
    "hilore-coarse": ("hilore", False),
    "hilore": ("hilore", True),
    "hilore-hr-p": ("hilore-hr", True),
    "hilore-p": ("hilore", True),
}  # bench/methods.py VARIANTS: mode, P offered
PLAIN = {"no-gc", "gc", "gc-aa", "all-h", "all-r", "all-l", "all-p", "all-p:core"}  # nothing to prepare

# ---- the stages: estimate and timeout, in one place ----
SELFCHECK_EST = 12.0  # the dry run's self-check: 4.4 s of CPU (7-29 s wall at load 5-9); + CUDA, mem_get_info
CUDA_TESTS_EST = 25.0  # TestCuda: 2.3-3.4 s collecting here (load 2-6); + the CUDA context (~8 s), 6 tests at ~2 s
# verl: the wheels (8 s); verl's engine path, torch.distributed and CUDA imported (20 s: 26 s wall, 6 s of CPU
# here, loaded); the random Qwen2 written (10 s: 18 s wall here, loaded); 4 engines built (20 s); HiLoRe's
# planning in two of them (15 s); one gradient and one timed batch each (2 s)
VERL_EST = 75.0
TIMEOUTS = {"selfcheck": 30, "gpu-ref": 290, "verl": 160, "cuda-tests": 60}


class Stage(NamedTuple):
    name: str
    estimate: float
    timeout: int
    how: str


class Passes(NamedTuple):
    what: str
    count: int
    tokens: int
    kind: str  # "fwd": forward without gradients; "train": forward, backward and a recompute


def params(w=GPU_REF) -> float:
    """Matmul parameters of the gpu-ref shape (Qwen2.5-3B): the tied embedding counted once, as
    the LM head's matmul."""
    h, kv = w["hidden_size"], w["hidden_size"] // w["num_heads"] * w["num_kv_heads"]
    layer = 2 * h * h + 2 * h * kv + 3 * h * w["intermediate_size"]
    return w["vocab_size"] * h + w["num_layers"] * layer


def pass_seconds(kind: str, tokens: int, w=GPU_REF) -> float:
    """One pass over a packed row of ``tokens`` tokens. Matmuls: 2 x params x tokens forward;
    "train" is 6 x params x tokens: forward, the backward's input gradients and one recompute
    (LoRA freezes the base weights: no weight-gradient matmuls; no-gc's 4 x is under it).
    Attention: 4 x layers x hidden x tokens per token forward (the whole square: SDPA under a
    packed row's mask skips nothing), 4 x that for "train"."""
    n, attn = params(w), 4 * w["num_layers"] * w["hidden_size"] * tokens
    flops = tokens * ((2 * n + attn) if kind == "fwd" else (6 * n + 4 * attn))
    return flops / (TFLOPS * 1e12) + PASS_OVERHEAD_S


def bench_args(argv: List[str]) -> argparse.Namespace:
    """The counted arguments of ``python -m benchmarks.bench`` (others are ignored)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--workload", default="cpu-small")
    p.add_argument("--methods", default=BENCH_DEFAULTS["methods"])
    p.add_argument("--budgets", default=BENCH_DEFAULTS["budgets"])
    for flag in ("repeats", "updates", "calib", "calib_tokens"):
        p.add_argument("--" + flag.replace("_", "-"), type=int, default=BENCH_DEFAULTS[flag])
    p.add_argument("--codec", default=BENCH_DEFAULTS["codec"])
    p.add_argument("--no-loo", action="store_true")
    p.add_argument("--no-aa", action="store_true")
    return p.parse_known_args(argv)[0]


def gpu_ref_passes(argv: List[str], w=GPU_REF) -> List[Passes]:
    """Every pass of the benchmark with arguments ``argv``, in its order (``bench/cli.py``, ``run_measured``)."""
    a = bench_args(argv)
    if a.workload != "gpu-ref":
        raise ValueError(f"only --workload gpu-ref is modelled, not {a.workload}")
    names = [m.strip() for m in a.methods.split(",") if m.strip()]
    other = [m for m in names if m not in PLAIN and m not in HILORE]
    if other:
        raise ValueError(f"not modelled (compiled, SAC or +full methods): {', '.join(other)}")
    if "gc" in names and "gc-aa" not in names and a.repeats > 1 and not a.no_aa:
        names.insert(names.index("gc") + 1, "gc-aa")  # cli.method_names
    n_budgets = len([b for b in a.budgets.split(",") if b.strip()])
    levels = len([c for c in a.codec.split(",") if c.strip()])
    units, T, mbs = 2 * w["num_layers"], w["tokens"], w["microbatches"]
    calib_tokens = a.calib_tokens or w["calib_tokens"]
    calibrates = any(n in HILORE and HILORE[n][0] != "hilore-hr" for n in names)  # cli.needs_calibration
    probe_tokens = T // 4  # the longest prefix whose all-H peak fits B: a few hundred tokens at 1.10 x B_gc
    out = [Passes("inputs: the replayed microbatches' log-probs", mbs * a.updates + 2, T, "fwd")]
    if calibrates:
        out.append(Passes("inputs: the calibration microbatches' log-probs", a.calib, calib_tokens, "fwd"))
    out.append(Passes("B: gc's peaks over one update", mbs, T, "train"))
    if calibrates:  # calibration.calibrate: per level and batch, all-R and one L intervention per unit
        out.append(
            Passes(
                f"calibration: {levels} L level(s) x {a.calib} batch(es) x (1 + {units} units)",
                levels * a.calib * (1 + units),
                calib_tokens,
                "train",
            )
        )
    profiled = None  # (L levels, P) the cached unit costs cover: Planner.prepare profiles again for more
    entries = 0
    for n in names:
        if n not in HILORE:
            entries += 1
            continue
        entries += n_budgets
        mode, partial = HILORE[n]
        lv = 0 if mode == "hilore-hr" else levels
        if profiled is None or lv > profiled[0] or (partial and not profiled[1]):
            profiled = (lv, partial)
            out.append(
                Passes(f"{n}: profile, all-R warm-up, {PROFILE_REPEATS} timed, peak", 2 + PROFILE_REPEATS, T, "train")
            )
            each = 3 + lv * (1 + PROFILE_REPEATS) + (P_LEVELS + 3 * PROFILE_REPEATS if partial else 0)
            out.append(Passes(f"{n}: profile, {PROBES} prefix probes x {each}", PROBES * each, probe_tokens, "train"))
            if partial:  # profiling._partial_shares, on the whole microbatch
                out.append(
                    Passes(f"{n}: profile, P's shares", P_LEVELS * UNIT_KINDS * (1 + 2 * PROFILE_REPEATS), T, "train")
                )
        scales = RISK_SCALES[mode]
        out.append(
            Passes(
                f"{n}: fits, {scales} risk scale(s) x {FIT_ATTEMPTS} candidates x 2, {n_budgets} B",
                n_budgets * scales * FIT_ATTEMPTS * 2,
                T,
                "train",
            )
        )
        out.append(
            Passes(
                f"{n}: validation, {VALIDATIONS} x (2 peaks + 2 x 2 gradients), {n_budgets} B",
                n_budgets * VALIDATIONS * 6,
                T,
                "train",
            )
        )
        if not a.no_loo:
            out.append(
                Passes(
                    f"{n}: leave-one-out, {LOO_UNITS} units", n_budgets * LOO_UNITS * (1 + 2 * LOO_REPEATS), T, "train"
                )
            )
    out.append(
        Passes(
            f"timing: {entries} methods x (1 warm-up + {a.repeats} repeats) x {mbs} microbatches",
            entries * (1 + a.repeats) * mbs,
            T,
            "train",
        )
    )
    measured = entries - ("gc-aa" in names)  # gc-aa takes gc's peaks and errors
    out.append(
        Passes(
            f"records: no-gc's gradients, {measured} methods x (peaks + gradients), {a.updates} update(s)",
            a.updates * mbs * (1 + 2 * measured),
            T,
            "train",
        )
    )
    return out


def gpu_ref_estimate(argv: List[str]) -> Tuple[float, List[str]]:
    """(seconds, one line per row) of the gpu-ref stage."""
    lines = [
        f"    {START_S:6.1f}s  start: python, torch, transformers, CUDA",
        f"    {MODEL_S:6.1f}s  model: the 3B random init on the CPU, LoRA, the copy to the GPU",
    ]
    total = START_S + MODEL_S
    for r in gpu_ref_passes(argv):
        one = pass_seconds(r.kind, r.tokens)
        total += r.count * one
        lines.append(
            f"    {r.count * one:6.1f}s  {r.count:4d} x {r.kind:5s} @ {r.tokens:4d} tokens ({one:.2f}s)  {r.what}"
        )
    return total, lines


def stages(bench_argv: List[str]) -> List[Stage]:
    try:
        gpu_ref = gpu_ref_estimate(bench_argv)[0]
        how = f"counted passes x FLOPs at {TFLOPS:.0f} TFLOP/s + {PASS_OVERHEAD_S}s a pass, + start and model"
    except ValueError as e:
        gpu_ref, how = float("inf"), f"not estimated: {e}"
    return [
        Stage("selfcheck", SELFCHECK_EST, TIMEOUTS["selfcheck"], "imports measured (4.4 s of CPU) + CUDA start"),
        Stage("gpu-ref", gpu_ref, TIMEOUTS["gpu-ref"], how),
        Stage("verl", VERL_EST, TIMEOUTS["verl"], "CPU side measured (loaded CPU) + 4 engines and planning"),
        Stage(
            "cuda-tests",
            CUDA_TESTS_EST,
            TIMEOUTS["cuda-tests"],
            "TestCuda only: collection measured (2.3-3.4 s) + CUDA start + 6 tests",
        ),
    ]


def problems(plan: List[Stage]) -> List[str]:
    out = [
        f"{s.name}: headroom {s.timeout / s.estimate:.2f} < {MIN_HEADROOM:g} (timeout {s.timeout}s, estimate "
        f"{s.estimate:.0f}s)"
        for s in plan
        if s.timeout < MIN_HEADROOM * s.estimate
    ]
    total = sum(s.timeout for s in plan)
    if total > MAX_TOTAL:
        out.append(f"the stage timeouts sum to {total}s, over {MAX_TOTAL}s")
    return out


def table(plan: List[Stage]) -> str:
    lines = [f"  {'stage':<11} {'estimate':>8} {'timeout':>7} {'headroom':>8}  how estimated"]
    for s in plan:
        lines.append(f"  {s.name:<11} {s.estimate:>7.0f}s {s.timeout:>6d}s {s.timeout / s.estimate:>7.2f}x  {s.how}")
    est, total = sum(s.estimate for s in plan), sum(s.timeout for s in plan)
    lines.append(
        f"  {'total':<11} {est:>7.0f}s {total:>6d}s {total / est:>7.2f}x  the rule: timeouts at most "
        f"{MAX_TOTAL}s in all, each at least {MIN_HEADROOM:g} x its estimate"
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(prog="python benchmarks/gpu_check_plan.py", description=__doc__.splitlines()[0])
    p.add_argument("--timeouts", action="store_true", help="print 'stage timeout estimate' lines (for the script)")
    p.add_argument("--check", action="store_true", help="exit 1 where a headroom is under 2 or the total over 540 s")
    p.add_argument("--explain", action="store_true", help="also print gpu-ref's estimate row by row")
    args = p.parse_args(argv[:cut])
    bench = argv[cut + 1 :]
    plan = stages(bench)
    if args.timeouts:
        fmt = lambda x: f"{x:.0f}" if x < float("inf") else "null"  # noqa: E731 - JSON's, in summary.json
        print("\n".join(f"{s.name} {s.timeout} {fmt(s.estimate)}" for s in plan))
        return 0
    print(table(plan))
    if args.explain:
        try:
            print("  gpu-ref's estimate, row by row:\n" + "\n".join(gpu_ref_estimate(bench)[1]))
        except ValueError as e:
            print(f"  gpu-ref: {e}")
    bad = problems(plan)
    for b in bad:
        print(f"  plan problem: {b}")
    return 1 if bad and args.check else 0


if __name__ == "__main__":
    raise SystemExit(main())
