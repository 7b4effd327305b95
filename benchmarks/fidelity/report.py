"""The study's report from whatever is finished: ``fidelity.json`` (every number the claims
use, recomputable from the committed metrics and evaluations), ``fidelity.md`` and
``fidelity.png`` (paired reward curves; held-out accuracy differences per seed).

Statistics follow the paper's: per method the mean and sample SD across seeds; per seed the
paired difference hilore - gc (same seed: same prompts, same first rollouts), then the mean
and sample SD of those differences.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Dict, List, Optional

# metrics a run that trains exactly like gc reproduces bit for bit
EXACT_KEYS = ("loss", "policy_loss", "kl", "grad_norm", "reward_mean", "accuracy", "response_length")


def _load(path: Path):
    if not path.is_file():
        return None
    if path.suffix == ".jsonl":
        return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    return json.loads(path.read_text())


def _mean_sd(xs: List[float]) -> Dict:
    return {
        "n": len(xs),
        "mean": statistics.fmean(xs) if xs else None,
        "sd": statistics.stdev(xs) if len(xs) > 1 else None,
        "values": xs,
    }


def accuracy(ev: Dict) -> float:
    """The share of held-out problems answered exactly (verifier score 1). The task's verifier
    also gives small partial credit to wrong numbers (reasoning-gym), which the mean score
    would count; evaluations without per-problem scores give their stored figure."""
    from .evaluate import exact_share

    scores = ev.get("scores")
    return exact_share(scores) if scores else ev["accuracy"]


def discordant(gc: Dict, other: Dict) -> Optional[Dict]:
    """On the same held-out problems (same order), how many only ``other`` answers exactly and
    how many only gc does: the paired accuracy difference is (other_only - gc_only) / n, and
    a handful of discordant problems is within what sampling noise of the evaluation allows."""
    a, b = gc.get("scores"), other.get("scores")
    if not a or not b or len(a) != len(b):
        return None
    return {
        "n": len(a),
        "other_only": sum(y >= 1.0 > x for x, y in zip(a, b)),
        "gc_only": sum(x >= 1.0 > y for x, y in zip(a, b)),
    }


def exact_match(a: List[Dict], b: List[Dict]) -> Dict:
    """Whether run ``b`` reproduces run ``a`` step by step on ``EXACT_KEYS``. A metric missing
    from either side is a difference (two runs that both lack it prove nothing), and so is
    an empty run."""
    first = next(
        (
            (r["step"], k if k in r and k in s else f"{k} (missing)")
            for r, s in zip(a, b)
            for k in EXACT_KEYS
            if k not in r or k not in s or r[k] != s[k]
        ),
        None,
    )
    return {
        "steps_compared": min(len(a), len(b)),
        "identical": first is None and len(a) == len(b) and len(a) > 0,
        "first_difference": None if first is None else {"step": first[0], "metric": first[1]},
    }


def summarize(out: Path, runs, steps: int, treat: str = "hilore") -> Dict:
    """``treat``: the method paired against gc (``hilore``; ``replay`` in a replay study)."""
    metrics = {r.name: _load(out / "runs" / f"{r.name}.metrics.jsonl") for r in runs}
    evals = {r.name: _load(out / "eval" / f"{r.name}.json") for r in runs}
    done = [r.name for r in runs if metrics[r.name] and len(metrics[r.name]) >= steps and evals[r.name]]
    acc = {r.name: accuracy(evals[r.name]) for r in runs if r.name in done}
    methods = sorted({r.method for r in runs})
    seeds = sorted({r.seed for r in runs})
    rep: Dict = {
        "steps": steps,
        "treatment": treat,
        "complete": len(done) == len(runs),
        "finished_runs": done,
        "missing_runs": [r.name for r in runs if r.name not in done],
    }
    rep["heldout_accuracy"] = {
        m: _mean_sd([acc[f"{m}-seed{s}"] for s in seeds if f"{m}-seed{s}" in acc]) for m in methods
    }
    base = _load(out / "eval" / "base.json")
    rep["base_heldout_accuracy"] = accuracy(base) if base else None  # step 0, where every run starts
    last10 = lambda rows: statistics.fmean(x["reward_mean"] for x in rows[-10:])  # noqa: E731
    rep["reward_last10"] = {
        m: _mean_sd([last10(metrics[f"{m}-seed{s}"]) for s in seeds if f"{m}-seed{s}" in done]) for m in methods
    }
    paired = [s for s in seeds if f"gc-seed{s}" in acc and f"{treat}-seed{s}" in acc]
    rep["paired_accuracy_difference_pp"] = _mean_sd(
        [100 * (acc[f"{treat}-seed{s}"] - acc[f"gc-seed{s}"]) for s in paired]
    )
    rep["paired_accuracy_difference_pp"]["seeds"] = paired
    rep["discordant_problems"] = {s: discordant(evals[f"gc-seed{s}"], evals[f"{treat}-seed{s}"]) for s in paired}
    rep["paired_reward_last10_difference"] = _mean_sd(
        [last10(metrics[f"{treat}-seed{s}"]) - last10(metrics[f"gc-seed{s}"]) for s in paired]
    )
    errs = [(r.seed, x) for r in runs if r.method == "hilore" and metrics[r.name] for x in metrics[r.name]]
    with_err = [x for _, x in errs if "grad_rel_error" in x]
    with_l = [x for x in with_err if x.get("fraction_L", 0) > 0]
    with_grad = [x for x in with_err if x.get("grad_norm", 1.0) > 0]  # a zero gradient (no signal) has error 0
    rep["gradient_error"] = {
        "steps_measured": len(with_err),
        "mean": statistics.fmean(x["grad_rel_error"] for x in with_err) if with_err else None,
        "max": max((x["grad_rel_error_max"] for x in with_err), default=None),
        "mean_over_steps_with_L": statistics.fmean(x["grad_rel_error"] for x in with_l) if with_l else None,
        "steps_with_a_gradient": len(with_grad),
        "mean_over_steps_with_a_gradient": statistics.fmean(x["grad_rel_error"] for x in with_grad)
        if with_grad
        else None,
        "cosine_min": min((x["grad_cosine_min"] for x in with_err), default=None),
        "fraction_L_mean": statistics.fmean(x["fraction_L"] for _, x in errs) if errs else None,
        "per_seed": {s: [x.get("grad_rel_error") for t, x in errs if t == s] for s in seeds},
    }
    rep["kl_gc_to"] = {}
    for name in [r.name for r in runs] + [f"base-seed{s}" for s in seeds]:  # base: how far training moved gc
        kl = _load(out / "kl" / f"gc-{name}.json")
        if kl:
            rep["kl_gc_to"][name] = kl["kl_mean_per_token"]
    rep["exact_check"] = {}
    for r in runs:
        if r.method == "hilore-hr" and metrics[r.name] and metrics.get(f"gc-seed{r.seed}"):
            rep["exact_check"][r.name] = exact_match(metrics[f"gc-seed{r.seed}"], metrics[r.name])
    d, g = rep["paired_accuracy_difference_pp"], rep["gradient_error"]
    rep["aims"] = {
        "accuracy_difference_within_0.5pp_or_1sd": None
        if d["mean"] is None
        else abs(d["mean"]) <= 0.5 or (d["sd"] is not None and abs(d["mean"]) <= d["sd"]),
        # judged on the steps with a gradient: a zero-gradient step's error of 0 would flatter the mean
        "mean_gradient_error_le_0.015": (
            None if g["mean_over_steps_with_a_gradient"] is None else g["mean_over_steps_with_a_gradient"] <= 0.015
        ),
    }
    return rep


def write_report(out: Path, runs, steps: int, treat: str = "hilore") -> Dict:
    rep = summarize(out, runs, steps, treat)
    (out / "fidelity.json").write_text(json.dumps(rep, indent=1))
    (out / "fidelity.md").write_text(markdown(rep, out))
    _plot(out, runs, rep)
    status = "complete" if rep["complete"] else f"partial: missing {', '.join(rep['missing_runs'])}"
    print(f"[fidelity] report ({status}): {out / 'fidelity.md'}", flush=True)
    return rep


def _fmt(x: Optional[float], spec: str = ".4f") -> str:
    return "-" if x is None else format(x, spec)


def markdown(rep: Dict, out: Path) -> str:
    cmd = (
        (out / "command.txt").read_text().strip()
        if (out / "command.txt").is_file()
        else "python -m benchmarks.fidelity"
    )
    treat = rep.get("treatment", "hilore")
    title = (
        "Training fidelity: HiLoRe against gradient checkpointing"
        if treat == "hilore"
        else f"{treat} against gc (both gradient checkpointing)"
    )
    lines = [
        f"# {title} ({rep['steps']} GRPO steps per run)",
        "",
        f"`{cmd}` (flags shared by every run: `study.yaml`). "
        + ("All runs finished." if rep["complete"] else f"**Partial**: missing {', '.join(rep['missing_runs'])}."),
        "",
        "| method | seeds | held-out accuracy, mean (SD) | reward, last 10 steps, mean (SD) |",
        "|---|---|---|---|",
    ]
    for m, a in rep["heldout_accuracy"].items():
        r = rep["reward_last10"][m]
        lines.append(
            f"| {m} | {a['n']} | {_fmt(a['mean'], '.3f')} ({_fmt(a['sd'], '.3f')}) | "
            f"{_fmt(r['mean'], '.3f')} ({_fmt(r['sd'], '.3f')}) |"
        )
    if rep.get("base_heldout_accuracy") is not None:
        lines.append(f"| base model (step 0) | - | {rep['base_heldout_accuracy']:.3f} | - |")
    d, g = rep["paired_accuracy_difference_pp"], rep["gradient_error"]
    lines += [
        "",
        f"Paired held-out accuracy difference {treat} - gc over seeds {d['seeds']}: "
        f"{_fmt(d['mean'], '+.2f')} pp (SD {_fmt(d['sd'], '.2f')} pp; per seed {[round(v, 2) for v in d['values']]}). "
        f"Problems only one of the pair answers exactly ({treat} only / gc only), per seed: "
        + (
            ", ".join(
                f"seed {s}: {c['other_only']} / {c['gc_only']} of {c['n']}"
                for s, c in rep.get("discordant_problems", {}).items()
                if c
            )
            or "-"
        )
        + ".",
        f"Per-step relative gradient error of hilore's updates ({g['steps_measured']} steps): mean {_fmt(g['mean'])}, "
        f"max {_fmt(g['max'])}, mean over the {g['steps_with_a_gradient']} steps with a nonzero gradient "
        f"{_fmt(g['mean_over_steps_with_a_gradient'])}, over steps that used L {_fmt(g['mean_over_steps_with_L'])}; "
        "lowest cosine "
        f"{_fmt(g['cosine_min'], '.6f')}; share of units L, mean {_fmt(g['fraction_L_mean'], '.3f')}.",
        "KL(gc || run) per response token on gc's held-out responses (base-seedS: the base model, "
        "how far training moved gc): " + (", ".join(f"{k} {v:.2e}" for k, v in rep["kl_gc_to"].items()) or "-") + ".",
    ]
    for name, c in rep["exact_check"].items():
        lines.append(
            f"Exactness: {name} reproduces gc's metrics ({', '.join(EXACT_KEYS)}) at every one of "
            f"{c['steps_compared']} steps: **{'yes' if c['identical'] else 'no'}**"
            + ("" if c["identical"] else f" (first difference: {c['first_difference']})")
            + "."
        )
    lines += ["", "Aims: " + ", ".join(f"{k}: {v}" for k, v in rep["aims"].items()), ""]
    return "\n".join(lines)


def _plot(out: Path, runs, rep: Dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    seeds = sorted({r.seed for r in runs})
    styles = {"gc": "-", "hilore": "--", "hilore-hr": ":", "replay": "--"}
    for r in runs:
        rows = _load(out / "runs" / f"{r.name}.metrics.jsonl") or []
        if rows:
            a.plot(
                [x["step"] for x in rows],
                [x["reward_mean"] for x in rows],
                styles.get(r.method, "-"),
                color=f"C{seeds.index(r.seed)}",
                label=r.name,
            )
    a.set(xlabel="step", ylabel="mean reward", title="paired reward curves (same seed, same colour)")
    if a.get_lines():
        a.legend(fontsize=7)
    d = rep["paired_accuracy_difference_pp"]
    b.bar([str(s) for s in d["seeds"]], d["values"], color=[f"C{seeds.index(s)}" for s in d["seeds"]])
    if d["mean"] is not None:
        b.axhline(d["mean"], color="k", lw=1, label=f"mean {d['mean']:+.2f} pp")
        b.legend()
    b.axhline(0, color="grey", lw=0.5)
    b.set(
        xlabel="seed",
        ylabel=f"{rep.get('treatment', 'hilore')} - gc (pp)",
        title="held-out accuracy, paired difference",
    )
    fig.tight_layout()
    fig.savefig(out / "fidelity.png", dpi=110)
    plt.close(fig)
