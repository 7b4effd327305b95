"""The studies on ``benchmarks/RESULTS.md`` beside the speed benchmark: codecs, training fidelity,
risk diagnostics, the knapsack's solve time, planning at depth and length and the demo job's runs,
each rendered from its committed JSON (or JSONL) by ``results_page``."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Dict, List

from .outputs import fmt, reading
from .results_runs import CodecRun, DemoRun, Page
from .stats import bootstrap_ci, paired_ratios


def _mean_max(g: Dict) -> str:
    return f"{g['mean']:.4f} [{g['max']:.4f}]" if g else "-"


def codecs(results: Path, runs: List[CodecRun]) -> str:
    out = [
        "## L codecs",
        "",
        "Per codec: the compression of the bytes L stores, and the relative error of one update's gradient "
        "against no-gc with every unit L, only attention units L or only MLP units L (the rest R), mean "
        "[max] over disjoint sets of microbatches. L keeps the attention core exact "
        "(`hilore_actor/recovery/rules.py`, `KEEP_EXACT`).",
        "",
    ]
    for run in runs:
        name, title, stale = run.name, run.title, run.stale
        p = Path(results) / f"{name}.json"
        if not p.exists():
            continue
        d = json.loads(p.read_text())
        out += [
            f"### {title} (`{name}`)",
            "",
            f"`{d['command']}` at commit {d['git_commit'][:7]}, torch {d['torch']}, "
            f"{d['sets']} sets of {d['microbatches_per_set']} x {d['tokens']} tokens, LoRA B init "
            f"{d['inputs'].get('lora_b_init')}.",
            "",
        ] + ([stale, ""] if stale else [])
        out += [
            "| codec | bytes ratio | encode+decode s/MiB | all L | attention L | MLP L |",
            "|---|---|---|---|---|---|",
        ]
        for c, v in sorted(d["codecs"].items(), key=lambda kv: kv[1]["grad_rel_err"]["all"]["mean"]):
            g = v["grad_rel_err"]
            out.append(
                f"| `{c}` | {v['compression']:.2f} | {v['seconds_per_mib']:.5f} | {_mean_max(g.get('all'))} | "
                f"{_mean_max(g.get('attn'))} | {_mean_max(g.get('mlp'))} |"
            )
        kinds = {c: v["kind_grad_rel_err"] for c, v in d["codecs"].items() if v.get("kind_grad_rel_err")}
        if kinds:
            names = sorted({k for v in kinds.values() for k in v})
            out += [
                "",
                "Gradient error of compressing one kind of saved tensor alone (every layer, the rule off; "
                "kinds named by `benchmarks/bench/saved_kinds.py`):",
                "",
                "| kind | " + " | ".join(f"`{c}`" for c in kinds) + " |",
                "|---" * (len(kinds) + 1) + "|",
            ]
            out += [f"| {k} | " + " | ".join(fmt(kinds[c].get(k), ".4f") for c in kinds) + " |" for k in names]
        out.append("")
    return "\n".join(out)


FIDELITY_SCHEMA = 2  # the form of benchmarks/fidelity/report.py's fidelity.json this section renders


def fidelity(results: Path) -> str:
    """The fidelity study (``python -m benchmarks.fidelity``): final held-out accuracy per arm
    and seed, the paired differences to gc with their intervals, the study's power, KL to gc,
    the gradient error and L share per step, and the learning curves' plot. A report of an
    earlier form is not shown: its study could not see a difference."""
    from benchmarks.fidelity.report import result_tables

    p = Path(results) / "fidelity" / "fidelity.json"
    d = json.loads(p.read_text()) if p.exists() else {}
    out = ["## Training fidelity on SmolLM2 (`python -m benchmarks.fidelity`)", ""]
    if d.get("schema") != FIDELITY_SCHEMA:  # none yet, or a report of an earlier form: none of its figures
        out.append(
            "The study has not run yet in its current form: paired GRPO runs of gc, hilore (at a budget where its "
            "plans use L) and a positive control (L wherever it saves room, with a deliberately coarse codec), three "
            "seeds each, on a task the model visibly learns within the run "
            "([docs/benchmark.md](../docs/benchmark.md))."
        )
        return "\n".join(out) + "\n"
    command = p.parent / "command.txt"
    cmd = command.read_text().strip() if command.is_file() else "python -m benchmarks.fidelity"
    out += [
        f"`{cmd}`: {d['steps']}-step GRPO runs of the training job per arm and seed, paired by seed (same prompts and "
        f"first rollouts); greedy held-out accuracy (exact answers) on {d['heldout'] or '-'} problems no run trained "
        "on; KL(arm || gc) per response token on the arm's held-out responses. Flags: "
        "`benchmarks/results/fidelity/study.yaml` and each arm's below; report: `fidelity.{md,json,png}`. "
        + ("Complete." if d["complete"] else f"**Partial**: missing {', '.join(d['missing_runs'])}."),
        "",
        *([d["task_line"], ""] if d.get("task_line") else []),
        "Arms' own flags: " + "; ".join(f"{m} `{' '.join(f)}`" for m, f in d["flags"].items()) + ".",
        "",
        *result_tables(d),
    ]
    for m, by in d["kl_to_gc"].items():
        if by:
            out.append(f"KL({m} || gc): " + ", ".join(f"seed {s} {v:.2e}" for s, v in by.items()) + ".")
    for m, gr in d["gradient"].items():
        shares = " ".join(fmt(r["fraction_L"], ".2f") for r in gr["by_step"])
        out.append(
            f"{m}: L on {fmt(gr['fraction_L_mean'], '.1%')} of unit actions; relative gradient error mean "
            f"{fmt(gr['grad_rel_error_mean'], '.4f')}, max {fmt(gr['grad_rel_error_max'], '.4f')}; lowest cosine "
            f"{fmt(gr['grad_cosine_min'], '.6f')} over {gr['steps_measured']} measured steps. L share by step "
            f"(mean of seeds): {shares or '-'}."
        )
    out += ["", "![held-out learning curves, paired differences, gradient error](results/fidelity/fidelity.png)"]
    finished = d.get("finished_runs", [])
    missing = [r for r in finished if not (p.parent / "runs" / f"{r}.metrics.jsonl").exists()]
    if missing:
        out.append(
            f"Not recomputable here: the per-step metrics of {len(missing)} of {len(finished)} runs (`runs/`) were "
            "not committed, so the curves, gradient error and L share stand only as the report recorded them."
        )
    return "\n".join(out) + "\n"


def diagnostics(results: Path, page: Page) -> str:
    p = Path(results) / "fidelity" / "diagnostics-smollm2.json"
    if not p.exists():
        return ""
    d = json.loads(p.read_text())
    c = d["coefficients"]
    aims, paper = page.diagnostics_aims, page.paper_psi
    out = [
        "## Risk diagnostics on SmolLM2 (`python -m benchmarks.diagnostics --model smollm2`)",
        "",
        f"Real rollouts, {d['calibration_microbatches']} calibration and {d['heldout_microbatches']} held-out "
        f"microbatches of {d['tokens']} tokens, codec `{d['codec']}`; each predictor scored against the measured "
        f"gradient error of putting one unit under L ({d['n_samples']} unit x held-out microbatch samples). "
        f"{c['zero_pg_coefficient_fraction']:.1%} of response tokens have a zero policy-gradient coefficient; the "
        f"top 10% of tokens carry {c['top10_omega_mass']:.1%} of |omega|.",
        "",
        "| predictor | Spearman | top-10% recall | AUROC (top 10%) |",
        "|---|---|---|---|",
    ]
    for name, v in d["predictors"].items():
        out.append(f"| {name} | {v['spearman']:.3f} | {v['top10_recall']:.3f} | {v['auroc_top10']:.3f} |")
    out.append(
        f"| paper (psi_u) | {paper['spearman']:.2f} | {paper['top10_recall']:.2f} | {paper['auroc_top10']:.2f} |"
    )
    psi = d["predictors"].get("psi")
    if psi:
        out += [
            "",
            f"psi_u against the aims: Spearman >= {aims['spearman']}: {psi['spearman'] >= aims['spearman']}; "
            f"AUROC >= {aims['auroc_top10']}: {psi['auroc_top10'] >= aims['auroc_top10']}; top-10% recall "
            f"{'at or above' if psi['top10_recall'] >= paper['top10_recall'] else 'below'} the paper's. "
            f"Inputs: {d['inputs'].get('groups')} groups, clip fraction {d['inputs'].get('clip_frac_last_row')}; "
            f"top 10% = the {round(d['n_samples'] * 0.1)} largest errors.",
            "",
            page.diagnostics_note,
        ]
    return "\n".join(out) + "\n"


def knapsack(results: Path) -> str:
    p = Path(results) / "knapsack.json"
    if not p.exists():
        return ""
    d = json.loads(p.read_text())
    return (
        "## Knapsack solve time (`python -m benchmarks.bench.knapsack`)\n\n"
        f"U = {d['units']} units on a {d['grid'][0]} x {d['grid'][1]} grid: median {d['median_ms']:.2f} ms "
        f"(min {d['min_ms']:.2f}, max {d['max_ms']:.2f}) over {d['repeats']} solves on 2 CPU cores.\n"
    )


def planning_scale(results: Path) -> str:
    """Hooks' overhead on a deep thin model and planning's time and peak at three lengths
    (``python -m benchmarks.planning_scale``), against the aims the JSON records."""
    p = Path(results) / "planning-scale.json"
    if not p.exists():
        return ""
    d = json.loads(p.read_text())
    aims = d["aims"]
    out = [
        "## Planning at depth and length (`python -m benchmarks.planning_scale`)",
        "",
        f"On {d['machine']}; each part's command below, nothing else running unless a row says so. Definitions: "
        "`benchmarks/planning_scale.py`'s docstring and "
        "[docs/benchmark.md](../docs/benchmark.md#planning-at-depth-and-length).",
        "",
    ]
    dep = d.get("depth")
    if dep:
        out += [
            f"### Hooks' overhead: {dep['layers']} decoder layers ({dep['units']} units), hidden 64, LoRA r8, "
            f"{dep['tokens']} tokens (commit {dep.get('commit', '?')})",
            "",
            f"`{dep['command']}`.",
            "",
            f"Median of {dep['rounds']} paired, interleaved rounds; overhead = (method - its twin) / gc's update "
            "time, per round, median with its 95% bootstrap interval. Aim: at most "
            f"{aims['hook_overhead']:.0%} of gc's update time.",
            "",
            "| method | median update s | against | overhead, share of gc's time | 95% interval | within the aim |",
            "|---|---:|---|---:|---|---|",
        ]
        for name, sec in dep["seconds"].items():
            o = dep["overhead_of_gc"].get(name)
            if o is None:
                out.append(f"| {name} | {sec:.3f} | | | | |")
                continue
            lo, hi = o["ci95"]
            aa = name == "no-gc'"
            ok = "(A/A floor)" if aa else "yes" if o["median"] <= aims["hook_overhead"] else "no"
            out.append(f"| {name} | {sec:.3f} | {o['against']} | {o['median']:+.1%} | [{lo:+.1%}, {hi:+.1%}] | {ok} |")
        out.append("")
    rows = d.get("length") or {}
    if rows:
        out += [
            "### Planning on SmolLM2-135M-Instruct by microbatch length",
            "",
            "Planning as the training job runs it before the first step (ZeRO-0..2: H/R plans, L's calibration "
            "later on real rollouts; `+calibration`: calibration inside planning, as under ZeRO-3), mode `hilore`, "
            "B = 1.10 x gc's device peak, LoRA r16, the chunked head, 4 sequences per microbatch. "
            f"Aims: planning at most {aims['plan_over_gc_updates']:.0f} gc updates of its microbatch; its highest "
            f"pass at most B ({aims['plan_peak_over_budget']:.2f}).",
            "",
            "| tokens | planning s | gc update s | planning / gc update | within the aim | planning peak / B | "
            "peak phase | plan (H/L/R) | commit |",
            "|---:|---:|---:|---:|---|---:|---|---|---|",
        ]
        for k in sorted(rows, key=lambda k: (int(k.split("+")[0]), k)):
            r = rows[k]
            plan = r.get("plan") or {}
            mix = f"{plan.get('exact', 0)}/{plan.get('compressed', 0)}/{plan.get('checkpoint', 0)}"
            ok = "yes" if r["plan_over_gc_updates"] <= aims["plan_over_gc_updates"] else "no"
            times = f"{r['plan_seconds']:.0f} | {r['gc_update_seconds']:.1f} | {r['plan_over_gc_updates']:.1f} | {ok}"
            if not r.get("timed", True):
                times = "not timed | not timed | - | -"
            out.append(
                f"| {k} | {times} | {r['plan_peak_over_budget']:.3f} | {r['plan_peak_phase']} | {mix} | "
                f"{r.get('commit', '?')} |"
            )
        out += ["", "Commands: " + "; ".join(sorted({f"`{r['command']}`" for r in rows.values()})) + "."]
        names = []
        for r in rows.values():
            names += [n for n in (r.get("phases") or {}) if n not in names]
        if names:
            out += ["", "Where planning's time goes (passes / share of planning's seconds; untimed rows: passes):", ""]
            out += ["| tokens | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
            for k in sorted(rows, key=lambda k: (int(k.split("+")[0]), k)):
                ph, total = rows[k].get("phases") or {}, rows[k]["plan_seconds"]
                timed = rows[k].get("timed", True)
                cells = [
                    "-"
                    if n not in ph
                    else f"{int(ph[n]['passes'])}" + (f" / {ph[n]['seconds'] / total:.0%}" if timed else "")
                    for n in names
                ]
                out.append(f"| {k} | " + " | ".join(cells) + " |")
        out.append("")
    for note in d.get("notes", []):
        out += [note, ""]
    return "\n".join(out).rstrip() + "\n"


def demo(results: Path, runs: List[DemoRun]) -> str:
    out: List[str] = [
        "## The demo job (`bash scripts/demo.sh`)",
        "",
        "Five GRPO steps on SmolLM2-135M-Instruct + LoRA r16 (mode `hilore-hr`: gradients exact); "
        "after each update gc and hilore are timed on the same microbatches (`gc s`, `hilore s`). "
        "B = 1.10 x gc's peak in the named scope; peak/B is the update's highest microbatch.",
        "",
    ]
    for run in runs:
        name, title, commit, note = run.name, run.title, run.commit, run.note
        p = Path(results) / f"{name}.metrics.jsonl"
        if not p.exists():
            continue
        rows = [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
        out += [
            f"### {title}",
            "",
            f"From a fresh clone at commit {commit}, nothing else running. {note}",
            "",
            "| step | reward | accuracy | resp. len | loss | update s | peak / B | gc s | hilore s | speed |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            out.append(
                f"| {r['step']} | {r['reward_mean']:.3f} | {r['accuracy']:.3f} | {r['response_length']:.1f} | "
                f"{r['loss']:+.5f} | "
                f"{r['update_seconds']:.2f} | {r['peak_over_budget_max']:.3f} | {r['compare_gc_seconds']:.2f} | "
                f"{r['compare_hilore_seconds']:.2f} | x{r['compare_speedup_vs_gc']:.3f} |"
            )
        peaks = [x for r in rows for c in r.get("coordinator", {}).values() for x in c.get("peaks_over_budget", [])]
        pred = [
            p / q
            for r in rows
            for c in r.get("coordinator", {}).values()
            for p, q in zip(c.get("peaks_over_budget", []), c.get("predicted_over_budget", []))
            if q
        ]
        gc = sum(r["compare_gc_seconds"] for r in rows)
        hl = sum(r["compare_hilore_seconds"] for r in rows)
        out += [
            "",
            f"All steps: gc {gc:.1f} s, hilore {hl:.1f} s (x{gc / hl:.3f}); planning's highest pass "
            f"{max(r.get('plan_peak_over_budget') or 0 for r in rows):.3f} B. "
            + (
                f"The {len(peaks)} microbatches peaked at {min(peaks):.3f}-{max(peaks):.3f} of B (median "
                f"{statistics.median(peaks):.3f}; {sum(x > 1 for x in peaks)} over B), measured/predicted "
                f"{min(pred):.2f}-{max(pred):.2f}. "
                if peaks and pred
                else ""
            )
            + f"Raw: `benchmarks/results/{name}.metrics.jsonl`"
            f" and `.log`.",
            "",
        ]
    return "\n".join(out)


def architectures(results: Path) -> str:
    """``benchmarks/architectures.sh``: the benchmark's exactness check per architecture."""
    files = sorted((Path(results) / "architectures").glob("*.json"))
    if not files:
        return ""
    out = [
        "## Architectures through the benchmark (`bash benchmarks/architectures.sh`)",
        "",
        "Per architecture: a tiny random config (`tests/helpers/arch_sweep.py`), "
        "then `python -m benchmarks.bench --workload "
        "cpu-small --model-config <config.json> --methods no-gc,gc,all-h,all-r,all-l --repeats 1 --updates 1`; "
        "gradient error relative to no-gc on one update of 2 microbatches of 1024 tokens (random weights: L's error "
        "shows that L acts, not its cost on a real model). The sweep over every architecture: "
        "[`docs/architectures.md`](../docs/architectures.md). *stale*: a JSON that does not record its config "
        "(`workload.model.model_type`) was measured before the sweep built configs through the config class and "
        "before the chunked head was checked to be the model's own logits (soft-capped, scaled and prediction-head "
        "logits now use the model's); its figures may differ from a re-run's. Peaks (in the JSON, not here) are by the "
        "profiler's allocation log, or by live tensor storages where the CPU meter column says `storage` (state-space "
        "models, whose reference scans made the profiler's log too large: `runtime/storage_meter.py`).",
        "",
        "| architecture | gc | all-H | all-R | all-L | CPU meter | commit |",
        "|---|---|---|---|---|---|---|",
    ]
    for f in files:
        d = json.loads(f.read_text())
        err = {r["method"]: r.get("grad_rel_err_mean") for r in d["records"]}
        cell = lambda m: "-" if err.get(m) is None else ("0 (exact)" if err[m] == 0 else f"{err[m]:.4f}")  # noqa: E731
        stale = "" if d["workload"].get("model", {}).get("model_type") else " *stale*"
        out.append(
            f"| `{f.stem}`{stale} | {cell('gc')} | {cell('all-h')} | {cell('all-r')} | {cell('all-l')} | "
            f"{d.get('cpu_meter') or 'profiler'} | {d['git_commit'][:7]} |"
        )
    return "\n".join(out) + "\n"


def skip_demo(results: Path, runs: List[DemoRun]) -> str:
    """The demo without its KL loss, so responses with advantage 0 are skipped: per step the
    share of such responses and tokens, and the first update's forward and backward timed with
    every response (A), with the skip's rows (B) and with every response again (A', the A/A
    floor), interleaved; ratios A/B and A/A' per repeat, pooled over the steps."""
    out: List[str] = []
    for run in runs:
        p = Path(results) / f"{run.name}.metrics.jsonl"
        if not p.exists():
            continue
        rows = [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
        if not out:
            out += [
                "## Skipping responses with advantage 0 (`--hilore.skip_zero_advantage`)",
                "",
                "The demo job without its KL loss: a group of equal rewards gives its responses advantage 0, "
                "which the learner then leaves out (exact: the same gradient). After each step the step's first "
                "update is timed outside the optimizer's path with every response (A), with the skip's rows (B) "
                "and with every response again (A'), interleaved, the slowest rank per repeat; speed = A / B per "
                "repeat and the A/A floor A / A', medians with a 95% bootstrap interval over repeats. "
                "`update s` is the real update (with the skip).",
                "",
            ]
        out += [
            f"### {run.title}",
            "",
            f"From a fresh clone at commit {run.commit}, nothing else running. {run.note}",
            "",
            "| step | reward | A=0 responses | A=0 tokens | update s | A s | B s | A / B | A / A' (floor) | reading |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        pooled_ab, pooled_aa = [], []
        for r in rows:
            t = r["compare_skip_times"]
            ab, aa = paired_ratios(t["all"], t["skip"]), paired_ratios(t["all"], t["all_again"])
            pooled_ab += ab
            pooled_aa += aa
            out.append(
                f"| {r['step']} | {r['reward_mean']:.3f} | {r['zero_adv_share']:.0%} | "
                f"{r['zero_adv_token_share']:.0%} | {r['update_seconds']:.2f} | "
                f"{statistics.median(t['all']):.2f} | {statistics.median(t['skip']):.2f} | "
                f"{_ratio(ab)} | {_ratio(aa)} | {_reading(ab, aa)} |"
            )
        out += [
            f"| all | | {statistics.fmean(r['zero_adv_share'] for r in rows):.0%} | "
            f"{statistics.fmean(r['zero_adv_token_share'] for r in rows):.0%} | "
            f"{sum(r['update_seconds'] for r in rows):.2f} | | | {_ratio(pooled_ab)} | {_ratio(pooled_aa)} | "
            f"{_reading(pooled_ab, pooled_aa)} |",
            "",
            f"Raw: `benchmarks/results/{run.name}.metrics.jsonl` and `.log`.",
            "",
        ]
    return "\n".join(out)


def _ratio(xs: List[float]) -> str:
    ci = bootstrap_ci(xs)
    return f"x{statistics.median(xs):.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")


def _reading(ab: List[float], aa: List[float]) -> str:
    """Whether A / B's interval lies above, below or within the A/A floor's."""
    return reading({"speed_ci95": bootstrap_ci(ab)}, {"speed_ci95": bootstrap_ci(aa)})
