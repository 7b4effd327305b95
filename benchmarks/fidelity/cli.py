"""The study's command line: runs in order, each resumed where it stopped, then evaluation
and the report. Re-running the same command continues an unfinished study."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .runs import INSTRUCTION, JOB, METHODS, TASK, TASK_OPTIONS, Run, StudyError, train, write_config


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.fidelity",
        description=(
            "Paired GRPO runs on a real model (gc and hilore per seed, hilore-hr once), held-out accuracy of every "
            "final policy, the KL between paired policies, and the report. Resumable: re-run the same command to "
            "continue."
        ),
    )
    p.add_argument("--out", default="benchmarks/results/fidelity", help="results: metrics, evaluations, report")
    p.add_argument("--runs", default="runs/fidelity", help="the runs' working folders (checkpoints, weights, logs)")
    p.add_argument("--seeds", default="0,1,2", help="training seeds, comma-separated")
    p.add_argument("--steps", type=int, default=30, help="GRPO steps per run")
    p.add_argument("--methods", default="gc,hilore", help=f"methods run for every seed ({', '.join(METHODS)})")
    p.add_argument(
        "--exact-check",
        default="hilore-hr",
        help="method run for the first seed only, which must reproduce gc's metrics exactly ('' to skip)",
    )
    p.add_argument("--heldout", type=int, default=300, help="held-out problems per evaluation (greedy)")
    p.add_argument("--model", default="smollm2", help="policy model (--pretrain of the job); tiny:qwen2 for tests")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one of the job's shared flags (YAML value), e.g. --set hilore.budget=1.25",
    )
    p.add_argument("--report-only", action="store_true", help="rebuild the report from what is finished; train nothing")
    p.add_argument("--max-runs", type=int, default=None, help="stop after this many runs were trained or continued")
    return p


def _study_command(argv: List[str]) -> str:
    """The command that makes the study, without the flags that only say how much of it to do
    now (``--max-runs N``, ``--report-only``): every piece writes the same command."""
    kept, skip = [], False
    for a in argv:
        if skip or a == "--report-only" or a.startswith("--max-runs"):
            skip = a == "--max-runs"
            continue
        kept.append(a)
    return " ".join(["python -m benchmarks.fidelity", *kept]) + "\n"


def _runs(args, root: Path) -> List[Run]:
    seeds = _seeds(args)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods + ([args.exact_check] if args.exact_check else []) if m not in METHODS]
    if bad or not seeds or "gc" not in methods:
        raise StudyError(
            f"--methods must include gc and name methods among {', '.join(METHODS)}; got {args.methods!r}"
            + (f" and --exact-check {args.exact_check!r}" if args.exact_check else "")
        )
    runs = []
    for i, s in enumerate(seeds):  # hilore first: its plan (how much L) shows early
        runs += [Run(m, s, root) for m in sorted(methods, key=lambda m: m != "hilore")]
        if i == 0 and args.exact_check:
            runs.append(Run(args.exact_check, s, root))
    return runs


def _overrides(pairs: List[str]):
    import yaml

    out = {}
    for kv in pairs:
        key, sep, value = kv.partition("=")
        if (
            not sep
            or key not in JOB
            and not key.startswith(("hilore.", "actor.", "rollout.", "train.", "algo.", "data."))
        ):
            raise StudyError(f"--set {kv!r}: expected KEY=VALUE with a job flag as KEY (e.g. hilore.budget=1.25)")
        out[key] = yaml.safe_load(value)
    return out


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    out, root = Path(args.out), Path(args.runs)
    try:
        runs = _runs(args, root)
        overrides = _overrides(args.set)
        config = write_config(out / "study.yaml", overrides)
        (out / "command.txt").write_text(_study_command(sys.argv[1:] if argv is None else argv))
        if not args.report_only:
            _train_and_evaluate(args, runs, config, overrides, out)
    except StudyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1 if "exited with" in str(e) else 2
    except KeyboardInterrupt as e:
        print(f"[fidelity] stopped ({e}); re-run the same command to continue", flush=True)
        _report(args, runs, out)
        return 130
    _report(args, runs, out)
    return 0


def _recorded(args, run: Run, runs: List[Run], key: Dict, out: Path) -> bool:
    """Whether ``out`` already holds everything the report needs from ``run``: its metrics for
    every step, a current evaluation and every KL it is part of. Such a run needs no weights
    on disk, so a study survives the loss of its runs' folder between pieces (a fresh
    machine); a run that is not recorded and whose weights are gone trains again (same seed,
    same data: the same run)."""
    rows = out / "runs" / f"{run.name}.metrics.jsonl"
    if not rows.is_file() or len([ln for ln in rows.read_text().splitlines() if ln.strip()]) < args.steps:
        return False
    pairs = [path for gc, r, path in _kl_pairs(runs, out) if run in (gc, r)]
    return _fresh(out / "eval" / f"{run.name}.json", key) and all(_fresh(p, key) for p in pairs)


def _train_and_evaluate(args, runs: List[Run], config: Path, overrides, out: Path) -> None:
    trained = 0
    key = _eval_key(args, dict(JOB, **overrides))
    _evaluate(args, None, overrides, out)  # the base model: the accuracy every run starts from
    for k, run in enumerate(runs):
        if _recorded(args, run, runs, key, out):
            print(f"[fidelity] run {k + 1}/{len(runs)}: {run.name} recorded in {out}; skipped", flush=True)
            continue
        state = run.state(args.steps)
        if state != "done":
            if args.max_runs is not None and trained >= args.max_runs:
                print(f"[fidelity] --max-runs {args.max_runs} reached; re-run the command to continue", flush=True)
                return
            t = time.perf_counter()
            print(
                f"[fidelity] run {k + 1}/{len(runs)}: {run.name} ({state}; {args.steps} steps) -> {run.dir}", flush=True
            )
            train(run, run.command(config, args.steps, out / "calibration.json", args.model, []))
            trained += 1
            print(f"[fidelity] {run.name} trained in {time.perf_counter() - t:.0f}s", flush=True)
        out.joinpath("runs").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(run.dir / "metrics.jsonl", out / "runs" / f"{run.name}.metrics.jsonl")
        _evaluate(args, run, overrides, out)
        _pair_kls(args, runs, overrides, out)  # each pair as soon as both of its runs are evaluated


def _fresh(path: Path, key: Dict) -> bool:
    """A saved evaluation (or KL) that was made with ``key`` (steps, held-out set): reusable."""
    return path.is_file() and all(json.loads(path.read_text()).get(k) == v for k, v in key.items())


def _seeds(args) -> List[int]:
    return [int(s) for s in args.seeds.split(",") if s.strip()]


def _eval_key(args, cfg: Dict) -> Dict:
    """What a held-out evaluation depends on: the run's steps and which problems are held out
    (the study's training seeds and pool size exclude theirs; ``--heldout`` of them)."""
    return {
        "steps": args.steps,
        "heldout": args.heldout,
        "train_seeds": sorted(_seeds(args)),
        "train_pool": int(cfg.get("data.max_samples", 1024)),
    }


def _evaluate(args, run: Optional[Run], overrides, out: Path) -> None:
    """Held-out greedy accuracy of ``run``'s final policy, or of the base model (step 0: where
    every run starts) when ``run`` is None."""
    from .evaluate import greedy_accuracy, heldout_examples, load_final_policy, save

    cfg = dict(JOB, **overrides)
    key = _eval_key(args, cfg)
    name = run.name if run else "base"
    path = out / "eval" / f"{name}.json"
    if _fresh(path, key):
        return
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    examples, pool = heldout_examples(
        args.heldout,
        key["train_seeds"],
        key["train_pool"],
        cfg.get("data.prompt_dataset", TASK),
        json.loads(cfg.get("data.task_options", json.dumps(TASK_OPTIONS))),
        cfg.get("data.instruction", INSTRUCTION),
    )
    print(f"[fidelity] evaluating {name} on {len(examples)} held-out problems (greedy)", flush=True)
    seed = run.seed if run else _seeds(args)[0]
    model, tok = load_final_policy(args.model, seed, run.final if run else None)
    res = greedy_accuracy(model, tok, pool, examples, int(cfg["rollout.max_new_tokens"]))
    save(path, dict(res, run=name, method=run.method if run else "base", seed=seed, **key))


def _kl_pairs(runs: List[Run], out: Path) -> List[Tuple[Run, Optional[Run], Path]]:
    """Every KL the report holds, as (gc run, other run or None for the base model, file):
    KL(gc || other run of the same seed), and KL(gc || base model), the yardstick: how far
    training moved gc's policy."""
    pairs = []
    for gc in (r for r in runs if r.method == "gc"):
        pairs.append((gc, None, out / "kl" / f"gc-base-seed{gc.seed}.json"))
        pairs += [(gc, r, out / "kl" / f"gc-{r.name}.json") for r in runs if r.seed == gc.seed and r.method != "gc"]
    return pairs


def _pair_kls(args, runs: List[Run], overrides, out: Path) -> None:
    """KL(gc || q) on gc's held-out responses for every pair whose runs' evaluations are
    current and whose weights are here."""
    from .evaluate import load_final_policy, response_kl, save

    key = _eval_key(args, dict(JOB, **overrides))
    for gc, r, path in _kl_pairs(runs, out):
        if _fresh(path, key) or not all(
            _fresh(out / "eval" / f"{x.name}.json", key) and x.final.is_dir() for x in (gc, r) if x is not None
        ):
            continue
        ev = json.loads((out / "eval" / f"{gc.name}.json").read_text())
        p, tok = load_final_policy(args.model, gc.seed, gc.final)
        q, _ = load_final_policy(args.model, gc.seed, r.final if r else None)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        kl = response_kl(p, q, ev["sequences"], ev["prompt_lens"], pad)
        q_name = r.name if r else "base"
        print(
            f"[fidelity] KL(gc || {q_name}) seed {gc.seed}: {kl['kl_mean_per_token']:.3e} per response token",
            flush=True,
        )
        save(path, dict(kl, p=gc.name, q=q_name, **key))


def _report(args, runs: List[Run], out: Path) -> None:
    from .report import write_report

    others = [r.method for r in runs if r.method not in ("gc", "hilore-hr")]
    write_report(out, runs, args.steps, treat=others[0] if others else "hilore")
