"""The study's command line: runs in order, each resumed where it stopped, then evaluation
and the report. Re-running the same command continues an unfinished study; ``--pilot`` runs
gc alone on the first seed to check that the model learns the task before the study's hours
are spent on it."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .runs import (
    INSTRUCTION,
    JOB,
    METHODS,
    TASK,
    TASK_OPTIONS,
    Run,
    StudyError,
    arm_flags,
    digest,
    train,
    write_config,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.fidelity",
        description=(
            "Paired GRPO runs on a real model (gc, hilore and a positive control per seed), held-out accuracy every "
            "few steps and of every final policy, the KL of each arm's final policy to gc's, and the report. "
            "Resumable: re-run the same command to continue."
        ),
    )
    p.add_argument("--out", default="benchmarks/results/fidelity", help="results: metrics, evaluations, report")
    p.add_argument("--runs", default="runs/fidelity", help="the runs' working folders (checkpoints, weights, logs)")
    p.add_argument("--seeds", default="0,1,2", help="training seeds, comma-separated")
    p.add_argument("--steps", type=int, default=40, help="GRPO steps per run")
    p.add_argument(
        "--methods", default="gc,hilore,control", help=f"arms run for every seed, gc among them ({', '.join(METHODS)})"
    )
    p.add_argument(
        "--exact-check",
        default="",
        help="an arm run for the first seed only, e.g. hilore-hr, which must reproduce gc's metrics exactly",
    )
    p.add_argument("--pilot", action="store_true", help="train only gc on the first seed; say whether it learns")
    p.add_argument("--task", default=TASK, help="the task (the job's --data.prompt_dataset), e.g. rg:basic_arithmetic")
    p.add_argument(
        "--task-options",
        default=None,
        help=f"the task's options as JSON (--data.task_options; default for {TASK}: {json.dumps(TASK_OPTIONS)})",
    )
    p.add_argument(
        "--instruction",
        default=None,
        help=f"appended to every prompt (--data.instruction; default for {TASK}: {INSTRUCTION!r}, for other "
        "reasoning-gym tasks the job's <answer> tag request)",
    )
    p.add_argument("--lr", type=float, default=None, help=f"learning rate (--actor.adam.lr; {JOB['actor.adam.lr']})")
    p.add_argument(
        "--eval-every", type=int, default=5, help="held-out accuracy every N steps in each run (0: only the final one)"
    )
    p.add_argument("--eval-samples", type=int, default=64, help="held-out problems of those evaluations (greedy)")
    p.add_argument("--heldout", type=int, default=300, help="held-out problems of the final evaluation (greedy)")
    p.add_argument("--hilore-budget", default=None, help="the hilore arm's --hilore.budget (default: the job's)")
    p.add_argument(
        "--control-budget", default="1.30", help="the control's --hilore.budget: room to store every unit, many as L"
    )
    p.add_argument("--control-codec", default="int2", help="the control's (deliberately coarse) --hilore.codec")
    p.add_argument("--model", default="smollm2", help="policy model (--pretrain of the job); tiny:qwen2 for tests")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one of the job's shared flags (YAML value), e.g. --set rollout.max_new_tokens=48",
    )
    p.add_argument("--report-only", action="store_true", help="rebuild the report from what is finished; train nothing")
    p.add_argument("--max-runs", type=int, default=None, help="stop after this many runs were trained or continued")
    return p


def _study_command(argv: List[str]) -> str:
    """The command that makes the study, without the flags that only say how much of it to do
    now (``--max-runs N``, ``--report-only``, ``--pilot``): every piece writes the same command."""
    kept, skip = [], False
    for a in argv:
        if skip or a in ("--report-only", "--pilot") or a.startswith("--max-runs"):
            skip = a == "--max-runs"
            continue
        kept.append(a)
    return " ".join(["python -m benchmarks.fidelity", *kept]) + "\n"


def _seeds(args) -> List[int]:
    return [int(s) for s in args.seeds.split(",") if s.strip()]


def _instruction(args) -> str:
    """Always explicit in the shared flags: the held-out file (a dataset file, which gets no
    default instruction) must be asked the way the training prompts are."""
    if args.instruction is not None:
        return args.instruction
    if args.task == TASK:
        return INSTRUCTION
    from hilore_actor.data.tasks import ANSWER_FORMAT

    return ANSWER_FORMAT if args.task.startswith("rg:") else ""


def shared_flags(args, out: Path, overrides: Dict) -> Dict:
    """The flags every run shares (``study.yaml``): ``JOB``, the task, learning rate and
    in-run held-out evaluation from the study's command line, then ``--set``."""
    options = (
        args.task_options if args.task_options is not None else json.dumps(TASK_OPTIONS if args.task == TASK else {})
    )
    try:
        options = json.dumps(json.loads(options))
    except json.JSONDecodeError as e:
        raise StudyError(f"--task-options {args.task_options!r}: not JSON ({e})") from None
    shared = dict(JOB, **{"data.prompt_dataset": args.task, "data.instruction": _instruction(args)})
    shared["data.task_options"] = options
    if args.lr is not None:
        shared["actor.adam.lr"] = args.lr
    if args.eval_every > 0:
        shared.update(
            {
                "eval.dataset": str(out / "heldout.jsonl"),
                "eval.steps": args.eval_every,
                "eval.max_samples": args.eval_samples,
            }
        )
    return dict(shared, **overrides)


def _check(args) -> None:
    """The study's own flags, before anything is trained: the arms' budgets and codec as the
    job would refuse them, and the held-out sizes."""
    from hilore_actor.learner.settings import hilore_errors, hilore_settings

    errors = []
    if args.eval_every > 0 and not 1 <= args.eval_samples <= args.heldout:
        errors.append(f"--eval-samples {args.eval_samples}: between 1 and --heldout ({args.heldout})")
    if args.steps < 1:
        errors.append(f"--steps {args.steps}: at least 1")
    arms = _methods(args)
    if "control" in arms:
        cfg = hilore_settings(mode="hilore-static", budget=args.control_budget, codec=args.control_codec)
        errors += [f"the control: {e}" for e in hilore_errors(cfg)]
    if "hilore" in arms and args.hilore_budget:
        errors += [f"the hilore arm: {e}" for e in hilore_errors(hilore_settings(budget=args.hilore_budget))]
    if errors:
        raise StudyError("; ".join(errors))


def _methods(args) -> List[str]:
    if args.pilot:
        return ["gc"]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods + ([args.exact_check] if args.exact_check else []) if m not in METHODS]
    if bad or "gc" not in methods:
        raise StudyError(
            f"--methods must include gc and name arms among {', '.join(METHODS)}; got {args.methods!r}"
            + (f" and --exact-check {args.exact_check!r}" if args.exact_check else "")
        )
    return ["gc"] + [m for m in methods if m != "gc"]  # gc first: the pilot's run, and every pair's reference


def _runs(args, root: Path, out: Optional[Path] = None) -> List[Run]:
    seeds = _seeds(args)
    if not seeds:
        raise StudyError(f"--seeds {args.seeds!r}: name at least one")
    out = Path(args.out) if out is None else out
    flags = lambda m: arm_flags(m, out, args.hilore_budget, args.control_budget, args.control_codec)  # noqa: E731
    runs = []
    for i, s in enumerate(seeds[:1] if args.pilot else seeds):
        runs += [Run(m, s, root, flags(m)) for m in _methods(args)]
        if i == 0 and args.exact_check and not args.pilot:
            runs.append(Run(args.exact_check, s, root, flags(args.exact_check)))
    return runs


def _overrides(pairs: List[str]):
    import yaml

    out = {}
    for kv in pairs:
        key, sep, value = kv.partition("=")
        if (
            not sep
            or key not in JOB
            and not key.startswith(("hilore.", "actor.", "rollout.", "train.", "algo.", "data.", "eval."))
        ):
            raise StudyError(
                f"--set {kv!r}: expected KEY=VALUE with a job flag as KEY (e.g. rollout.max_new_tokens=48)"
            )
        out[key] = yaml.safe_load(value)
    return out


def heldout_key(args, shared: Dict) -> Dict:
    """What the held-out problems and the base model's evaluation depend on: the task, the
    training seeds and pool size (their problems are excluded), how many, and how a policy is
    asked (model, instruction, response length, chat template). All seeds of the study, even
    in a pilot, so the pilot's run serves the study."""
    return {
        "heldout": args.heldout,
        "train_seeds": sorted(_seeds(args)),
        "train_pool": int(shared.get("data.max_samples", 1024)),
        "task": shared["data.prompt_dataset"],
        "task_options": shared.get("data.task_options"),
        "instruction": shared.get("data.instruction"),
        "model": args.model,
        "max_new_tokens": int(shared["rollout.max_new_tokens"]),
        "chat_template": bool(shared.get("data.apply_chat_template", True)),
    }


def eval_keys(args, runs: List[Run], shared: Dict) -> Dict[str, Dict]:
    """Per run name (and ``base``), what a current evaluation of it was made with: a saved
    one with other keys (another study, task, learning rate, arm flags) is made again."""
    base = heldout_key(args, shared)
    keys = {"base": base}
    for r in runs:
        keys[r.name] = dict(base, steps=args.steps, run_flags=digest(r.key(shared, args.model)))
    return keys


def _fresh(path: Path, key: Dict) -> bool:
    """A saved evaluation (or KL, or metrics record) that was made with ``key``: reusable."""
    return path.is_file() and all(json.loads(path.read_text()).get(k) == v for k, v in key.items())


def kl_pairs(runs: List[Run], out: Path) -> List[Tuple[Optional[Run], Run, Path]]:
    """Every KL the report holds, as (p, gc run, file), KL(p || gc) on p's held-out greedy
    responses: p another arm's run of gc's seed, or None for the base model: the yardstick,
    how far training moved gc's policy from where every run starts."""
    pairs = []
    for gc in (r for r in runs if r.method == "gc"):
        pairs.append((None, gc, out / "kl" / f"base-seed{gc.seed}.json"))
        pairs += [(r, gc, out / "kl" / f"{r.name}.json") for r in runs if r.seed == gc.seed and r.method != "gc"]
    return pairs


def _kl_key(keys: Dict, p: Optional[Run], gc: Run) -> Dict:
    return {"p_eval": digest(keys[p.name if p else "base"]), "q_eval": digest(keys[gc.name])}


def _recorded(args, run: Run, runs: List[Run], keys: Dict, out: Path, shared: Dict) -> bool:
    """Whether ``out`` already holds everything the report needs from ``run``: its metrics for
    every step (made with its flags), a current evaluation and every KL it is part of. Such a
    run needs no weights on disk, so a study survives the loss of its runs' folder between
    pieces (a fresh machine); a run that is not recorded and whose weights are gone trains
    again (same seed, same data: the same run)."""
    rows = out / "runs" / f"{run.name}.metrics.jsonl"
    if not rows.is_file() or len([ln for ln in rows.read_text().splitlines() if ln.strip()]) < args.steps:
        return False
    if not _fresh(out / "runs" / f"{run.name}.json", run.key(shared, args.model)):
        return False
    pairs = [(p, gc, path) for p, gc, path in kl_pairs(runs, out) if run in (p, gc)]
    return _fresh(out / "eval" / f"{run.name}.json", keys[run.name]) and all(
        _fresh(path, _kl_key(keys, p, gc)) for p, gc, path in pairs
    )


def write_heldout(args, shared: Dict, out: Path):
    """The held-out problems (``evaluate.heldout_examples``: none a run trains on), written to
    ``heldout.jsonl`` as the job reads a dataset (``prompt`` without the instruction, which the
    job appends as it does to training prompts; ``answer``) for its every-few-steps
    evaluation, whose first ``--eval-samples`` it scores. Written once: rewritten only when the
    problems change. Returns (examples, task) for the final evaluation."""
    from .evaluate import heldout_examples

    key = heldout_key(args, shared)
    instruction = key["instruction"]
    try:
        examples, pool = heldout_examples(
            args.heldout,
            key["train_seeds"],
            key["train_pool"],
            key["task"],
            json.loads(key["task_options"]),
            instruction,
        )
    except ValueError as e:  # too few problems, or a task that cannot be loaded (DatasetError)
        raise StudyError(f"--task {key['task']}: {e}") from None
    rows = []
    for e in examples:
        question = e.metadata.get("row", {}).get("question") if isinstance(e.metadata.get("row"), dict) else None
        if question is None:
            question = (
                e.prompt[: len(e.prompt) - len(instruction)]
                if instruction and e.prompt.endswith(instruction)
                else e.prompt
            )
        rows.append(json.dumps({"prompt": question, "answer": e.answer}))
    text = "\n".join(rows) + "\n"
    path = out / "heldout.jsonl"
    if not path.is_file() or path.read_text() != text:
        out.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return examples, pool


def main(argv=None) -> int:
    from hilore_actor.train.run_dir import release_all

    try:
        return _main(argv)
    finally:
        release_all()  # --out, for the next study


def _main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    out, root = Path(args.out), Path(args.runs)
    runs: List[Run] = []
    study: List[Run] = []
    keys: Optional[Dict] = None
    shared: Dict = {}
    try:
        _check(args)
        if not args.report_only:  # one study at a time in --out (each run's job also holds its own folder)
            _claim(out)
        runs = _runs(args, root, out)
        study = _runs(argparse.Namespace(**dict(vars(args), pilot=False)), root, out)  # what the report waits for
        shared = shared_flags(args, out, _overrides(args.set))
        keys = eval_keys(args, study, shared)
        config = write_config(out / "study.yaml", shared)
        (out / "command.txt").write_text(_study_command(sys.argv[1:] if argv is None else argv))
        if not args.report_only:
            _train_and_evaluate(args, runs, config, shared, keys, out)
    except StudyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1 if "exited with" in str(e) else 2
    except KeyboardInterrupt as e:
        print(f"[fidelity] stopped ({e}); re-run the same command to continue", flush=True)
        _report(args, study, keys, shared, out)
        return 130
    _report(args, study, keys, shared, out)
    if args.pilot:
        print(pilot_summary(out, runs[0]), flush=True)
    return 0


def _claim(out: Path) -> None:
    from hilore_actor.train.run_dir import RunDirError, claim

    try:
        out.mkdir(parents=True, exist_ok=True)
        claim(out, flag="--out")
    except (RunDirError, OSError) as e:
        raise StudyError(str(e)) from None


def _train_and_evaluate(args, runs: List[Run], config: Path, shared: Dict, keys: Dict, out: Path) -> None:
    trained = 0
    examples, pool = write_heldout(args, shared, out)
    _evaluate(args, None, shared, keys, examples, pool, out)  # the base model: the accuracy every run starts from
    for k, run in enumerate(runs):
        if _recorded(args, run, runs, keys, out, shared):
            print(f"[fidelity] run {k + 1}/{len(runs)}: {run.name} recorded in {out}; skipped", flush=True)
            continue
        key = run.key(shared, args.model)
        state = run.state(args.steps, key)
        if state == "stale":
            raise StudyError(
                f"{run.dir} holds a run made with other flags than this study's (see its study-run.json): "
                "remove that folder or choose another --runs"
            )
        if state != "done":
            if args.max_runs is not None and trained >= args.max_runs:
                print(f"[fidelity] --max-runs {args.max_runs} reached; re-run the command to continue", flush=True)
                return
            t = time.perf_counter()
            print(
                f"[fidelity] run {k + 1}/{len(runs)}: {run.name} ({state}; {args.steps} steps) -> {run.dir}", flush=True
            )
            train(run, run.command(config, args.steps, args.model, []), key)
            trained += 1
            print(f"[fidelity] {run.name} trained in {time.perf_counter() - t:.0f}s", flush=True)
        out.joinpath("runs").mkdir(parents=True, exist_ok=True)  # committed as soon as the run finishes
        shutil.copyfile(run.dir / "metrics.jsonl", out / "runs" / f"{run.name}.metrics.jsonl")
        (out / "runs" / f"{run.name}.json").write_text(json.dumps(key, sort_keys=True))
        print(run_line(run.name, run.metrics()), flush=True)
        _evaluate(args, run, shared, keys, examples, pool, out)
        _pair_kls(args, runs, keys, out)  # each pair as soon as both of its runs are evaluated


def run_line(name: str, rows: List[Dict]) -> str:
    """One line per finished run: its held-out curve and, for an arm with L, how much L it used
    and what that did to the gradient (what a pilot of the budgets needs to see)."""
    curve = [f"{r['step']}: {r['eval_accuracy']:.3f}" for r in rows if "eval_accuracy" in r]
    parts = [f"[fidelity] {name}: held-out accuracy by step {', '.join(curve) or '-'}"]
    err = [r for r in rows if "grad_rel_error" in r]
    if err:
        parts.append(
            f"L on {statistics.fmean(r.get('fraction_L', 0.0) for r in err):.0%} of unit actions, gradient error "
            f"mean {statistics.fmean(r['grad_rel_error'] for r in err):.4f}, lowest cosine "
            f"{min(r['grad_cosine_min'] for r in err):.5f}"
        )
    return "; ".join(parts)


def _evaluate(args, run: Optional[Run], shared: Dict, keys: Dict, examples, pool, out: Path) -> None:
    """Held-out greedy accuracy of ``run``'s final policy, or of the base model (step 0: where
    every run starts) when ``run`` is None."""
    from .evaluate import greedy_accuracy, load_final_policy, save

    name = run.name if run else "base"
    path = out / "eval" / f"{name}.json"
    if _fresh(path, keys[name]):
        return
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    print(f"[fidelity] evaluating {name} on {len(examples)} held-out problems (greedy)", flush=True)
    seed = run.seed if run else _seeds(args)[0]
    model, tok = load_final_policy(args.model, seed, run.final if run else None)
    res = greedy_accuracy(
        model, tok, pool, examples, int(shared["rollout.max_new_tokens"]), chat_template=keys["base"]["chat_template"]
    )
    save(path, dict(res, run=name, method=run.method if run else "base", seed=seed, **keys[name]))


def _pair_kls(args, runs: List[Run], keys: Dict, out: Path) -> None:
    """KL(p || gc) on p's held-out responses for every pair whose evaluations are current and
    whose weights are here."""
    from .evaluate import load_final_policy, response_kl, save

    for p, gc, path in kl_pairs(runs, out):
        key = _kl_key(keys, p, gc)
        p_name = p.name if p else "base"
        if (
            _fresh(path, key)
            or not all(_fresh(out / "eval" / f"{n}.json", keys[n]) for n in (p_name, gc.name))
            or not all(x.final.is_dir() for x in (p, gc) if x is not None)
        ):
            continue
        ev = json.loads((out / "eval" / f"{p_name}.json").read_text())
        pm, tok = load_final_policy(args.model, gc.seed, p.final if p else None)
        qm, _ = load_final_policy(args.model, gc.seed, gc.final)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        kl = response_kl(pm, qm, ev["sequences"], ev["prompt_lens"], pad)
        print(f"[fidelity] KL({p_name} || gc) seed {gc.seed}: {kl['kl_mean_per_token']:.3e} per response token")
        save(path, dict(kl, p=p_name, q=gc.name, seed=gc.seed, **key))


def pilot_summary(out: Path, run: Run) -> str:
    """Base against final held-out accuracy of the pilot's gc run, and whether the aim holds."""
    from .report import AIM_GAIN, AIM_RATIO, accuracy, aim_met

    paths = [out / "eval" / f"{n}.json" for n in ("base", run.name)]
    if not all(p.is_file() for p in paths):
        return f"[fidelity] pilot: {run.name} is not evaluated yet; re-run the command to continue"
    base, final = (accuracy(json.loads(p.read_text())) for p in paths)
    met = aim_met(base, final)
    return (
        f"[fidelity] pilot: {run.name} held-out accuracy {final:.3f} against the base model's {base:.3f} "
        f"({100 * (final - base):+.1f} pp); aim (>= base + {100 * AIM_GAIN:.0f} pp, or >= {AIM_RATIO:g} x base): "
        + ("met" if met else "NOT met: try another task, learning rate or more steps")
    )


def _report(args, runs: List[Run], keys: Dict, shared: Dict, out: Path) -> None:
    from .report import write_report

    if runs and keys is not None:
        samples = shared.get("eval.max_samples") if shared.get("eval.dataset") else None
        write_report(out, runs, args.steps, keys=keys, eval_samples=samples)
