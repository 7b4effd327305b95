"""The study's report from whatever is finished: ``fidelity.json`` (every number the claims
use, recomputable from the committed ``runs/*.metrics.jsonl``, ``eval/`` and ``kl/``),
``fidelity.md`` and ``fidelity.png`` (held-out learning curves, paired differences, the
gradient error and L share per step).

The comparison is paired: each arm's run of a seed against gc's run of the same seed (same
prompts, same first rollouts, same held-out problems). Per seed the accuracy difference gets a
bootstrap interval over problems (the evaluation's noise); over seeds the mean difference gets
a t interval (training's noise too), and the study's power is the smallest difference its
seeds could detect. A positive control whose interval excludes 0 shows the study can see a
degradation; an arm within 0.5 pp of gc beside it is then a statement, not an artefact of a
study that sees nothing.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Dict, List, Optional

from . import stats
from .runs import USES_L, digest

SCHEMA = 2  # the results page renders this report's form; an earlier one it reports as not run
AIM_GAIN, AIM_RATIO = 0.15, 2.0  # the task is learnt: final held-out accuracy >= base + 15 pp, or >= 2 x base
WITHIN_PP = 0.5  # the paper's claim: training quality within about half a point of gc's
# metrics a run that trains exactly like gc reproduces bit for bit
EXACT_KEYS = ("loss", "policy_loss", "kl", "grad_norm", "reward_mean", "accuracy", "response_length")
GRADIENT_KEYS = ("fraction_L", "grad_rel_error", "grad_rel_error_max", "grad_cosine_min")


def _load(path: Path):
    if not path.is_file():
        return None
    if path.suffix == ".jsonl":
        return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    return json.loads(path.read_text())


def aim_met(base: float, final: float) -> bool:
    """Whether a policy learnt the task: +15 pp over the base model, or double its accuracy."""
    return final >= base + AIM_GAIN - 1e-12 or (base > 0 and final >= AIM_RATIO * base)


def exact(scores: List[float]) -> List[float]:
    """1 per problem the verifier scores 1, else 0: the task's verifier gives wrong numbers
    small partial credit, which accuracy must not count."""
    return [float(s >= 1.0) for s in scores]


def accuracy(ev: Dict) -> float:
    """The share of held-out problems answered exactly (verifier score 1); evaluations without
    per-problem scores give their stored figure."""
    scores = ev.get("scores")
    return statistics.fmean(exact(scores)) if scores else ev["accuracy"]


def discordant(gc: Dict, other: Dict) -> Optional[Dict]:
    """On the same held-out problems (same order), how many only ``other`` answers exactly and
    how many only gc does: the paired accuracy difference is (other_only - gc_only) / n."""
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


def _current(out: Path, name: str, keys: Optional[Dict]):
    """(metrics rows, evaluation) of a run as the results folder holds them, each None where
    absent or made with other flags than ``keys[name]`` says (another study's files)."""
    rows, ev = _load(out / "runs" / f"{name}.metrics.jsonl"), _load(out / "eval" / f"{name}.json")
    if keys is not None and name in keys:
        made = _load(out / "runs" / f"{name}.json")
        if made is None or digest(made) != keys[name].get("run_flags"):
            rows = None
        if ev is not None and any(ev.get(k) != v for k, v in keys[name].items()):
            ev = None
    return rows, ev


def _kl(out: Path, p: str, gc: str, file: str, keys: Optional[Dict]) -> Optional[float]:
    kl = _load(out / "kl" / file)
    if kl is None:
        return None
    if keys is not None and (p in keys and gc in keys):
        if kl.get("p_eval") != digest(keys[p]) or kl.get("q_eval") != digest(keys[gc]):
            return None
    return kl["kl_mean_per_token"]


def _task(out: Path) -> Optional[Dict]:
    """The task and learning rate every run shared, from ``study.yaml``."""
    p = out / "study.yaml"
    if not p.is_file():
        return None
    import yaml

    cfg = yaml.safe_load(p.read_text())
    return {
        "dataset": cfg.get("data.prompt_dataset"),
        "options": cfg.get("data.task_options"),
        "instruction": cfg.get("data.instruction"),
        "lr": cfg.get("actor.adam.lr"),
    }


def task_line(rep: Dict) -> str:
    """What the runs learn and what their reward measures (shared with the results page)."""
    t = rep.get("task")
    if not t:
        return ""
    return (
        f"Task `{t['dataset']}` (options `{t['options']}`, instruction {t['instruction']!r}), learning rate {t['lr']}; "
        "reward: the task's own verifier (1 for the correct answer; reasoning-gym gives a wrong one small partial "
        "credit, which accuracy does not count), no format reward."
    )


def _gradient(by_seed_rows: Dict[str, List[Dict]]) -> Dict:
    """Per step (over seeds: the mean, or the extreme of a ``_max``/``_min`` metric) and overall:
    L's share of unit actions, the relative error of the update's gradient against the exact
    one on the same microbatches, and the lowest cosine, from the job's ``--measure_grad_error``
    metrics."""
    by_seed = {
        s: {k: [r.get(k) for r in rows if "grad_rel_error" in r] for k in ("step",) + GRADIENT_KEYS}
        for s, rows in by_seed_rows.items()
    }
    steps = sorted({st for v in by_seed.values() for st in v["step"]})
    by_step = []
    for st in steps:
        at = [{k: v[k][v["step"].index(st)] for k in GRADIENT_KEYS} for v in by_seed.values() if st in v["step"]]
        row = {"step": st, "seeds": len(at)}
        for k in GRADIENT_KEYS:
            vals = [a[k] for a in at if a[k] is not None]
            pick = min if k.endswith("_min") else max if k.endswith("_max") else statistics.fmean
            row[k] = pick(vals) if vals else None
        by_step.append(row)
    allv = lambda k: [x for v in by_seed.values() for x in v[k] if x is not None]  # noqa: E731
    return {
        "steps_measured": len(allv("grad_rel_error")),
        "fraction_L_mean": statistics.fmean(allv("fraction_L")) if allv("fraction_L") else None,
        "grad_rel_error_mean": statistics.fmean(allv("grad_rel_error")) if allv("grad_rel_error") else None,
        "grad_rel_error_max": max(allv("grad_rel_error_max"), default=None),
        "grad_cosine_min": min(allv("grad_cosine_min"), default=None),
        "by_step": by_step,
        "by_seed": by_seed,
    }


def _curves(by_seed_rows: Dict[str, List[Dict]]) -> Dict:
    """Held-out accuracy every ``--eval.steps`` steps (the job's ``eval_accuracy``): per seed,
    and the mean over seeds at the steps every seed evaluated."""
    by_seed = {
        s: [[r["step"], r["eval_accuracy"]] for r in rows if "eval_accuracy" in r] for s, rows in by_seed_rows.items()
    }
    common = sorted(set.intersection(*[{st for st, _ in v} for v in by_seed.values()])) if by_seed else []
    mean = [statistics.fmean(dict(map(tuple, v))[st] for v in by_seed.values()) for st in common]
    return {"steps": common, "mean": mean, "by_seed": by_seed}


def _paired(evals: Dict[str, Dict], arm: str, seeds: List[int]) -> Dict:
    """``arm`` - gc in held-out accuracy (pp): per seed with its bootstrap interval over
    problems and what that evaluation could resolve; over seeds the mean, its t interval and
    the smallest difference the seeds could detect (80% power, two-sided 5%)."""
    by_seed, diffs, pairs = {}, [], []
    for s in seeds:
        g, a = evals.get(f"gc-seed{s}"), evals.get(f"{arm}-seed{s}")
        if g is None or a is None:
            continue
        d = 100 * (accuracy(a) - accuracy(g))
        row = {"difference_pp": d, "ci95_pp": None, "discordant": discordant(g, a), "detectable_pp": None}
        if row["discordant"]:
            ea, eg = exact(a["scores"]), exact(g["scores"])
            row["ci95_pp"] = [100 * x for x in stats.paired_bootstrap(ea, eg)]
            row["detectable_pp"] = 100 * stats.discordance_detectable(ea, eg)
            pairs.append((ea, eg))
        by_seed[str(s)] = row
        diffs.append(d)
    ms = stats.mean_sd(diffs)
    ci = stats.t_interval(diffs)
    return {
        "seeds": [int(s) for s in by_seed],
        "by_seed": by_seed,
        "mean_pp": ms["mean"],
        "sd_pp": ms["sd"],
        "ci95_pp": list(ci) if ci else None,  # t over seeds
        "problems_ci95_pp": [100 * x for x in stats.pooled_paired_bootstrap(pairs)] if pairs else None,
        "detectable_pp": stats.detectable_difference(ms["sd"], len(diffs)) if ms["sd"] is not None else None,
        "within_0.5pp": None if ms["mean"] is None else abs(ms["mean"]) <= WITHIN_PP,
        "ci_within_0.5pp": None if ci is None else -WITHIN_PP <= ci[0] and ci[1] <= WITHIN_PP,
        "ci_excludes_0": None if ci is None else ci[0] > 0 or ci[1] < 0,
    }


def summarize(out: Path, runs, steps: int, keys: Optional[Dict] = None, eval_samples: Optional[int] = None) -> Dict:
    """Everything the claims use, from the results folder. ``keys`` (``cli.eval_keys``): what
    each run's files must have been made with (files of another study count as missing);
    ``eval_samples``: how many of the held-out problems the in-run evaluations score (the
    base model's accuracy on those is the curves' step 0)."""
    arms = list(dict.fromkeys(r.method for r in runs))
    seeds = sorted({r.seed for r in runs})
    metrics, evals = {}, {}
    for r in runs:
        metrics[r.name], evals[r.name] = _current(out, r.name, keys)
    done = [r.name for r in runs if metrics[r.name] and len(metrics[r.name]) >= steps and evals[r.name]]
    evals = {n: evals[n] for n in done}
    metrics = {n: metrics[n] for n in done}
    base = _load(out / "eval" / "base.json")
    if base is not None and keys is not None and any(base.get(k) != v for k, v in keys.get("base", {}).items()):
        base = None
    rep: Dict = {
        "schema": SCHEMA,
        "steps": steps,
        "complete": len(done) == len(runs),
        "finished_runs": done,
        "missing_runs": [r.name for r in runs if r.name not in done],
        "arms": arms,
        "seeds": seeds,
        "flags": {m: next(r.job_flags for r in runs if r.method == m) for m in arms},
        "heldout": base.get("heldout", base.get("n")) if base else None,
        "eval_samples": eval_samples,
        "task": _task(out),
    }
    rep["task_line"] = task_line(rep)
    acc = {n: accuracy(ev) for n, ev in evals.items()}
    rep["base_accuracy"] = accuracy(base) if base else None
    rep["accuracy"] = {}
    for m in arms:
        by = {str(s): acc[f"{m}-seed{s}"] for s in seeds if f"{m}-seed{s}" in acc}
        rep["accuracy"][m] = dict(stats.mean_sd(list(by.values())), by_seed=by)
    b = rep["base_accuracy"]
    gc_by = rep["accuracy"].get("gc", {}).get("by_seed", {})
    rep["gc_learns"] = {
        "aim": f"final >= base + {100 * AIM_GAIN:.0f} pp, or >= {AIM_RATIO:g} x base",
        "by_seed": {s: {"gain_pp": 100 * (a - b), "met": aim_met(b, a)} for s, a in gc_by.items()}
        if b is not None
        else {},
    }
    met = [v["met"] for v in rep["gc_learns"]["by_seed"].values()]
    # no if a finished seed missed the aim; not yet known (None) while seeds are missing and the rest met it
    rep["gc_learns"]["all_seeds"] = False if not all(met) else True if met and len(met) == len(seeds) else None
    rep["paired"] = {m: _paired(evals, m, seeds) for m in arms if m != "gc"}
    rows_by = lambda m: {str(s): metrics[f"{m}-seed{s}"] for s in seeds if f"{m}-seed{s}" in metrics}  # noqa: E731
    rep["gradient"] = {
        m: _gradient(rows_by(m))
        for m in arms
        if m in USES_L or any("grad_rel_error" in x for rows in rows_by(m).values() for x in rows)
    }
    rep["curves"] = {m: _curves(rows_by(m)) for m in arms}
    rep["curves_step0"] = (
        statistics.fmean(exact(base["scores"][:eval_samples])) if base and eval_samples and base.get("scores") else None
    )
    last10 = lambda rows: statistics.fmean(x["reward_mean"] for x in rows[-10:])  # noqa: E731
    rep["reward_last10"] = {m: stats.mean_sd([last10(rows) for rows in rows_by(m).values()]) for m in arms}
    rep["kl_to_gc"] = {"base": {}}
    for s in seeds:
        kl = _kl(out, "base", f"gc-seed{s}", f"base-seed{s}.json", keys)
        if kl is not None:
            rep["kl_to_gc"]["base"][str(s)] = kl
    for r in runs:
        if r.method != "gc":
            kl = _kl(out, r.name, f"gc-seed{r.seed}", f"{r.name}.json", keys)
            if kl is not None:
                rep["kl_to_gc"].setdefault(r.method, {})[str(r.seed)] = kl
    rep["exact_check"] = {
        r.name: exact_match(metrics[f"gc-seed{r.seed}"], metrics[r.name])
        for r in runs
        if r.method == "hilore-hr" and r.name in metrics and f"gc-seed{r.seed}" in metrics
    }
    return rep


def write_report(out: Path, runs, steps: int, keys: Optional[Dict] = None, eval_samples: Optional[int] = None) -> Dict:
    rep = summarize(out, runs, steps, keys, eval_samples)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fidelity.json").write_text(json.dumps(rep, indent=1))
    (out / "fidelity.md").write_text(markdown(rep, out))
    _plot(out, rep)
    status = "complete" if rep["complete"] else f"partial: missing {', '.join(rep['missing_runs'])}"
    print(f"[fidelity] report ({status}): {out / 'fidelity.md'}", flush=True)
    return rep


def _fmt(x: Optional[float], spec: str = ".4f") -> str:
    return "-" if x is None else format(x, spec)


def _ci(ci: Optional[List[float]]) -> str:
    return "-" if not ci else f"[{ci[0]:+.2f}, {ci[1]:+.2f}]"


def _yes(x: Optional[bool]) -> str:
    return "-" if x is None else "yes" if x else "no"


def verdict(arm: str, p: Dict) -> str:
    """One plain sentence per arm: its difference to gc, the interval, within 0.5 pp or not,
    and whether the interval excludes 0 (a detected difference)."""
    if p["mean_pp"] is None:
        return f"{arm} - gc: no paired seed finished yet."
    return (
        f"{arm} - gc: {p['mean_pp']:+.2f} pp over seeds {p['seeds']} (95% t interval over seeds {_ci(p['ci95_pp'])}; "
        f"problems resampled within each seed {_ci(p['problems_ci95_pp'])}). Within {WITHIN_PP} pp of gc: "
        f"mean {_yes(p['within_0.5pp'])}, whole interval {_yes(p['ci_within_0.5pp'])}; "
        f"the interval excludes 0 (a difference detected): {_yes(p['ci_excludes_0'])}."
    )


def power_line(arm: str, p: Dict) -> str:
    seeds = ", ".join(
        f"seed {s} {_fmt(v['detectable_pp'], '.1f')} pp"
        for s, v in p["by_seed"].items()
        if v["detectable_pp"] is not None
    )
    return (
        f"Power ({arm}): at 80% power and two-sided alpha 0.05, {len(p['seeds'])} seeds with the observed SD of "
        f"the paired differences ({_fmt(p['sd_pp'], '.2f')} pp) detect a difference of "
        f"{_fmt(p['detectable_pp'], '.2f')} pp; one seed's held-out evaluation alone resolves "
        f"{seeds or '-'} (from its discordant problems)."
    )


def result_tables(rep: Dict) -> List[str]:
    """Final accuracy per arm and seed, whether gc learns, and the paired differences to gc: the
    tables of fidelity.md and of the results page's section."""
    seeds = [str(s) for s in rep["seeds"]]
    lines = [
        "| final held-out accuracy | " + " | ".join(f"seed {s}" for s in seeds) + " | mean (SD) |",
        "|---" * (len(seeds) + 2) + "|",
    ]
    for m, a in rep["accuracy"].items():
        lines.append(
            f"| {m} | "
            + " | ".join(_fmt(a["by_seed"].get(s), ".3f") for s in seeds)
            + f" | {_fmt(a['mean'], '.3f')} ({_fmt(a['sd'], '.3f')}) |"
        )
    lines.append(f"| base model (step 0) | {_fmt(rep['base_accuracy'], '.3f')} |" + " |" * len(seeds))
    g = rep["gc_learns"]
    lines += [
        "",
        f"gc learns the task ({g['aim']}) on every seed: "
        + ("not yet known" if g["all_seeds"] is None and g["by_seed"] else _yes(g["all_seeds"]))
        + " ("
        + (", ".join(f"seed {s} {v['gain_pp']:+.1f} pp" for s, v in g["by_seed"].items()) or "-")
        + ").",
        "",
        "| arm - gc, pp | " + " | ".join(f"seed {s} [bootstrap 95%]" for s in seeds) + " | mean [t 95% over seeds] |"
        " within 0.5 pp | detectable at 80% power |",
        "|---" * (len(seeds) + 4) + "|",
    ]
    for m, p in rep["paired"].items():
        cells = [
            f"{v['difference_pp']:+.2f} {_ci(v['ci95_pp'])}" if v else "-" for v in (p["by_seed"].get(s) for s in seeds)
        ]
        lines.append(
            f"| {m} | " + " | ".join(cells) + f" | {_fmt(p['mean_pp'], '+.2f')} {_ci(p['ci95_pp'])} | "
            f"{_yes(p['within_0.5pp'])} | {_fmt(p['detectable_pp'], '.2f')} |"
        )
    lines.append("")
    for m, p in rep["paired"].items():
        lines += [verdict(m, p), power_line(m, p)]
    return lines


def markdown(rep: Dict, out: Path) -> str:
    cmd = (
        (out / "command.txt").read_text().strip()
        if (out / "command.txt").is_file()
        else "python -m benchmarks.fidelity"
    )
    lines = [
        f"# Training fidelity: {', '.join(rep['arms'])} ({rep['steps']} GRPO steps per run)",
        "",
        f"`{cmd}` (flags shared by every run: `study.yaml`). "
        + ("All runs finished." if rep["complete"] else f"**Partial**: missing {', '.join(rep['missing_runs'])}."),
        "",
        *([rep["task_line"], ""] if rep["task_line"] else []),
        "Arms' own flags: " + "; ".join(f"{m} `{' '.join(f)}`" for m, f in rep["flags"].items()) + ".",
        "",
        "Final held-out accuracy (greedy, exact answers, "
        f"{rep['heldout'] or '-'} problems no run trained on), per seed; paired differences to gc (per seed: "
        "bootstrap 95% interval over problems; mean: t interval over seeds):",
        "",
        *result_tables(rep),
    ]
    kl = rep["kl_to_gc"]
    lines += [
        "",
        "KL(arm || gc) per response token on the arm's held-out greedy responses (base: the base model, how far "
        "training moved gc): "
        + "; ".join(f"{m} " + ", ".join(f"seed {s} {v:.2e}" for s, v in by.items()) for m, by in kl.items() if by)
        + ".",
    ]
    for m, gr in rep["gradient"].items():
        lines.append(
            f"{m}: L on {_fmt(gr['fraction_L_mean'], '.1%')} of unit actions (mean over {gr['steps_measured']} "
            f"measured steps); relative gradient error mean {_fmt(gr['grad_rel_error_mean'])}, max "
            f"{_fmt(gr['grad_rel_error_max'])}; lowest cosine {_fmt(gr['grad_cosine_min'], '.6f')}."
        )
    if rep["gradient"]:
        arms = list(rep["gradient"])
        lines += [
            "",
            "Per step, mean over seeds (L share, relative gradient error, lowest cosine):",
            "",
            "| step | " + " | ".join(f"{m} L | {m} error | {m} cosine" for m in arms) + " |",
            "|---" * (3 * len(arms) + 1) + "|",
        ]
        steps = sorted({r["step"] for m in arms for r in rep["gradient"][m]["by_step"]})
        at = {m: {r["step"]: r for r in rep["gradient"][m]["by_step"]} for m in arms}
        for st in steps:
            cells = []
            for m in arms:
                r = at[m].get(st, {})
                cells += [
                    _fmt(r.get("fraction_L"), ".2f"),
                    _fmt(r.get("grad_rel_error")),
                    _fmt(r.get("grad_cosine_min"), ".5f"),
                ]
            lines.append(f"| {st} | " + " | ".join(cells) + " |")
    for name, c in rep["exact_check"].items():
        lines.append(
            f"Exactness: {name} reproduces gc's metrics ({', '.join(EXACT_KEYS)}) at every one of "
            f"{c['steps_compared']} steps: **{'yes' if c['identical'] else 'no'}**"
            + ("" if c["identical"] else f" (first difference: {c['first_difference']})")
            + "."
        )
    lines += [
        "",
        "Learning curves (`fidelity.png`): the job's held-out evaluation every few steps on the first "
        f"{rep['eval_samples'] or '-'} of the held-out problems (greedy; scored by math-verify against the answer, as "
        "the job scores a dataset file), step 0 the base model's accuracy on them.",
        "",
    ]
    return "\n".join(lines)


def _plot(out: Path, rep: Dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4))
    colors = {m: f"C{i}" for i, m in enumerate(rep["arms"])}
    step0 = rep.get("curves_step0")
    for m, cv in rep["curves"].items():
        for s, pts in cv["by_seed"].items():
            if pts:
                xs, ys = zip(*([[0, step0]] if step0 is not None else []) + pts)
                a.plot(xs, ys, color=colors[m], lw=0.6, alpha=0.35)
        if cv["steps"]:
            xs, ys = [0] * (step0 is not None) + cv["steps"], [step0] * (step0 is not None) + cv["mean"]
            a.plot(xs, ys, "o-", color=colors[m], lw=2, ms=3, label=f"{m} (mean of {len(cv['by_seed'])})")
    a.set(xlabel="step", ylabel="held-out accuracy", title="learning curves (thin: seeds)")
    if a.get_lines():
        a.legend(fontsize=8)
    for i, (m, p) in enumerate(rep["paired"].items()):
        for j, (s, v) in enumerate(p["by_seed"].items()):
            x = i + (j - (len(p["by_seed"]) - 1) / 2) * 0.15
            lo, hi = v["ci95_pp"] or (v["difference_pp"], v["difference_pp"])
            b.errorbar(
                x,
                v["difference_pp"],
                [[v["difference_pp"] - lo], [hi - v["difference_pp"]]],
                fmt="o",
                color=colors[m],
                ms=4,
                capsize=2,
            )
        if p["mean_pp"] is not None:
            b.hlines(p["mean_pp"], i - 0.3, i + 0.3, color="k", lw=1.5)
    b.axhspan(-WITHIN_PP, WITHIN_PP, color="grey", alpha=0.2, lw=0)
    b.axhline(0, color="grey", lw=0.5)
    b.set_xticks(range(len(rep["paired"])), list(rep["paired"]))
    b.set(ylabel="arm - gc, pp", title="paired held-out difference (per seed, 95% bootstrap)")
    for m, gr in rep["gradient"].items():
        rows = [r for r in gr["by_step"] if r["grad_rel_error"] is not None]
        if rows:
            c.plot(
                [r["step"] for r in rows], [r["grad_rel_error"] for r in rows], "-", color=colors[m], label=f"{m} error"
            )
            c.plot(
                [r["step"] for r in rows],
                [r["fraction_L"] or 0 for r in rows],
                ":",
                color=colors[m],
                label=f"{m} L share",
            )
    c.set(xlabel="step", title="gradient error and L share per step (mean of seeds)")
    if c.get_lines():
        c.set_yscale("symlog", linthresh=1e-3)
        c.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "fidelity.png", dpi=110)
    plt.close(fig)
