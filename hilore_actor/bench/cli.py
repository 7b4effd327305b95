"""Benchmark command line (see ``python -m hilore_actor.bench --help``)."""
from __future__ import annotations

import argparse
import shlex
from pathlib import Path
import sys
import time
from collections import Counter

from .workloads import WORKLOADS

DEFAULT_METHODS = "no-gc,gc,sac,compile-budget,all-l,hilore-hr,hilore-static,hilore"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hilore_actor.bench", description=__doc__ or "")
    p.add_argument("--workload", default="cpu-small", choices=sorted(WORKLOADS), help="pinned workload")
    p.add_argument("--arch", choices=("qwen2", "llama", "phi3"), help="override the workload's model family")
    p.add_argument("--model-config", help="any HF causal-LM config.json (random weights) instead of the workload's shape")
    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help="comma list: no-gc, gc, sac, compile-budget, compile-fp8, all-h, all-r, all-l, hilore-hr, hilore-static, hilore")
    p.add_argument("--budgets", default="1.10", help="comma list of budgets as ratios of the measured gc peak")
    p.add_argument("--repeats", type=int, default=7, help="interleaved timing repeats per method (>= 7 on noisy CPUs)")
    p.add_argument("--updates", type=int, default=2, help="distinct replayed updates (each = the workload's microbatches)")
    p.add_argument("--calib", type=int, default=16, help="calibration microbatches for HiLoRe's risk (C)")
    p.add_argument("--calibration", default=None, help="calibration JSON: reused when it exists, written after calibrating")
    p.add_argument("--calib-tokens", type=int, default=None, help="tokens per calibration microbatch (default: the workload's calib_tokens)")
    p.add_argument("--no-loo", action="store_true", help="skip HiLoRe's leave-one-out validation (faster preparation)")
    p.add_argument("--codec", default="int8", help="L codec: int8, fp8-e4m3, fp8-e5m2")
    p.add_argument("--std-head", action="store_true",
                   help="run HiLoRe through the model's full-logits head too (default: the chunked head; "
                        "any method can take it with a +lean suffix, e.g. gc+lean)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
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


def run(args, argv) -> int:
    import torch

    from ..allocation import Calibration, Runner, calibrate
    from ..models import LoraSpec, build_model, load_model, tiny_config
    from ..recovery import RecoveryEngine
    from ..workloads import replayed_microbatches
    from . import report
    from functools import partial

    from ..grpo.microbatch import microbatch_loss
    from .methods import OURS, is_budgeted, make_method, median
    from .peers import PeerUnavailable

    wl = WORKLOADS[args.workload]
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    budgets = [float(b) for b in args.budgets.split(",")]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    torch.manual_seed(args.seed)
    lora = LoraSpec(wl.lora_rank, wl.lora_alpha)
    if args.model_config:
        model = load_model(args.model_config, dtype=wl.torch_dtype, lora=lora, seed=args.seed)
    else:
        model = build_model(tiny_config(args.arch or wl.arch, **wl.model), dtype=wl.torch_dtype, lora=lora, seed=args.seed)
    model.to(device).train()
    loss_opts = dict(clip_eps_low=0.2, kl_coef=wl.kl_coef, kl_estimator=wl.kl_estimator)
    n_upd = wl.microbatches * args.updates
    mbs = replayed_microbatches(model, n_upd + 2, wl.tokens, group_size=wl.group_size, prompt_frac=wl.prompt_frac,
                                seed=args.seed, loss_options=loss_opts)
    updates = [mbs[i * wl.microbatches:(i + 1) * wl.microbatches] for i in range(args.updates)]
    dev = mbs[n_upd:]
    runner = Runner(model, RecoveryEngine(model, codec=args.codec))
    lean_runner = Runner(model, runner.engine, loss_fn=partial(microbatch_loss, lean_head=True))
    tokens_per_update = wl.microbatches * wl.tokens

    gc_peak = max(runner.run(mb, "gc", measure_peak=True).peak_bytes for mb in mbs[: wl.microbatches])
    log(f"[bench] {wl.name}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, gc peak {gc_peak / 2**20:.1f} MiB")
    ctx = {"gc_peak": gc_peak, "costs_cache": {}, "dev": dev, "log": log, "loo": not args.no_loo, "calibration": None,
           "lean_runner": lean_runner, "ours_lean": not args.std_head}
    if any(m.startswith("hilore") for m in methods) and args.calibration and Path(args.calibration).is_file():
        ctx["calibration"] = Calibration.load(args.calibration)
        log(f"[bench] calibration reused from {args.calibration}")
    elif any(m.startswith("hilore") for m in methods):
        t = time.perf_counter()
        cal_mbs = replayed_microbatches(model, args.calib, args.calib_tokens or wl.calib_tokens, seed=args.seed + 1, loss_options=loss_opts)
        ctx["calibration"] = calibrate(runner if args.std_head else lean_runner, cal_mbs, progress=lambda d, n: log(f"[bench] calibration {d}/{n}") if d % 10 == 0 else None)
        log(f"[bench] calibrated on {args.calib} microbatches in {time.perf_counter() - t:.0f}s")
        if args.calibration:
            ctx["calibration"].save(args.calibration)

    entries, unavailable = [], []
    for name in methods:
        for b in (budgets if is_budgeted(name) else [None]):
            t = time.perf_counter()
            try:
                m = make_method(name, runner, b, ctx)
                if m.hilore is not None:
                    m.hilore.prepare(dev)
            except PeerUnavailable as e:
                unavailable.append({"method": name, "budget_ratio": b, "unavailable": str(e)})
                log(f"[bench] {name}: not run: {e}")
                continue
            m.prepare_seconds = time.perf_counter() - t
            entries.append(m)
            log(f"[bench] ready: {name}{'' if b is None else f' @ {b:.2f}'} ({m.prepare_seconds:.0f}s)")

    ref_grads = [sum(runner.run(mb, "no-gc", grads=True, seed=i).grad for i, mb in enumerate(u)) for u in updates]
    times = {id(m): [] for m in entries}
    extra = {id(m): {"cpu": [], "overhead": [], "actions": Counter()} for m in entries}
    gc_entry = next((m for m in entries if m.name == "gc"), None)
    paired_gc = {}  # isolated peer -> gc times of its own phase

    def timing_phase(group, label):
        for m in group:  # warm-up
            m.update(updates[0])
        for rep in range(args.repeats):
            order = group if rep % 2 == 0 else list(reversed(group))  # A B ... B A: drift cancels
            for m in order:
                u = m.update(updates[rep % len(updates)])
                times[id(m)].append(u["seconds"])
                extra[id(m)]["cpu"].append(u["cpu_seconds"])
                extra[id(m)]["overhead"].append(u["overhead"])
                extra[id(m)]["actions"].update(u["actions"])
            log(f"[bench] {label}: repeat {rep + 1}/{args.repeats} done")

    timing_phase([m for m in entries if not m.isolated], "main phase")
    for m in [m for m in entries if m.isolated]:
        m.rebuild()  # one compiled peer live at a time
        if gc_entry is not None:
            before = len(times[id(gc_entry)])
            timing_phase([gc_entry, m], f"{m.name} phase")
            paired_gc[id(m)] = times[id(gc_entry)][before:]
            del times[id(gc_entry)][before:]
        else:
            timing_phase([m], f"{m.name} phase")

    gc_time = median(times[id(gc_entry)]) if gc_entry is not None else None
    records = []
    for m in entries:
        if m.isolated:
            m.rebuild()
        peak = max(m.peak(u) for u in updates)
        errs = [float((m.grad(u) - g).norm() / g.norm()) for u, g in zip(updates, ref_grads)]
        acts = extra[id(m)]["actions"]
        total = sum(acts.values())
        frac = {"H": 1.0, "L": 0.0, "R": 0.0} if m.name == "no-gc" else {"H": 0.0, "L": 0.0, "R": 1.0} if m.name == "gc" else (
            {k: acts[k] / total for k in "HLR"} if total else {k: None for k in "HLR"})
        t_med = median(times[id(m)])
        rec = {
            "method": m.name, "budget_ratio": m.budget_ratio, "update_seconds": t_med,
            "update_seconds_all": times[id(m)], "cpu_seconds_median": median(extra[id(m)]["cpu"]),
            "tokens_per_second": tokens_per_update / t_med, "peak_bytes": peak, "peak_over_gc": peak / gc_peak,
            "grad_rel_err_mean": sum(errs) / len(errs), "grad_rel_err_max": max(errs),
            "h_frac": frac["H"], "l_frac": frac["L"], "r_frac": frac["R"],
            "online_overhead_seconds": median(extra[id(m)]["overhead"]) if m.name.startswith("hilore") else None,
            "prepare_seconds": m.prepare_seconds,
            "speed_over_gc": (median(paired_gc[id(m)]) if id(m) in paired_gc else gc_time) / t_med if gc_time else None,
            **m.extra,
        }
        rec["fits_budget"] = [b for b in budgets if peak <= b * gc_peak] if m.budget_ratio is None else peak <= m.budget_ratio * gc_peak
        if m.hilore is not None:
            sp = next(iter(m.hilore.plans.values()))
            rec["plan"] = sp.plan
            rec["validation"] = sp.report
        rec["head"] = "chunked" if (m.name.endswith("+lean") or (m.name in OURS and not args.std_head)) else "full logits"
        if gc_time and m.name.startswith("hilore"):
            nogc = next((median(times[id(x)]) for x in entries if x.name == "no-gc"), None)
            if nogc and gc_time > nogc:
                rec["gap_recovered"] = (gc_time - t_med) / (gc_time - nogc)
        records.append(rec)
    records += unavailable
    header = {"workload": wl.describe(), "torch": torch.__version__, "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
              "gc_peak_bytes": gc_peak, "repeats": args.repeats, "budgets": budgets, "codec": args.codec,
              "command": "python -m hilore_actor.bench " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
              "threads": torch.get_num_threads()}
    print(report.table(records))
    if args.json:
        report.write_json(args.json, header, records)
    if args.markdown:
        Path(args.markdown).write_text(report.markdown(records, header))
    if args.plot:
        report.plot(args.plot, records, budgets, f"{wl.name}: throughput vs peak memory, relative to gc")
    return 0
