"""The run report: one HTML page, its PNG pictures beside it, written from the run folder alone
(``run_folder.read``), so a finished, stopped or running run can be looked at without TensorBoard
or W&B. Plain HTML and CSS, no script, nothing fetched: it opens from a copied folder."""

from __future__ import annotations

import html
import statistics
from pathlib import Path
from typing import Dict, List, Optional

from ..train.run_dir import REPORT_DIR
from . import pictures
from .run_folder import Run, peaks_by_step, read

PAGE = "index.html"
# the flags a reader looks for first; the page lists every flag below them
MAIN_FLAGS = (
    "actor.model_name_or_path",
    "actor.backend",
    "hilore.mode",
    "hilore.budget",
    "hilore.budget_scope",
    "world_size",
    "ds.zero_stage",
    "ds.lora.rank",
    "rollout.batch_size",
    "rollout.n_samples_per_prompt",
    "train.micro_batch_size",
    "max_steps",
    "hilore.skip_zero_advantage",
)


def _col(rows: List[Dict], key: str) -> List[Optional[float]]:
    return [r.get(key) if isinstance(r.get(key), (int, float)) else None for r in rows]


def _figures(run: Run) -> List[Dict]:
    """``{"name", "title", "fig", "caption"}`` of every picture the run's files can make."""
    rows, steps = run.metrics, [r["step"] for r in run.metrics]
    out = []

    def add(name, title, fig, caption):
        if fig is not None:
            out.append(dict(name=name, title=title, fig=fig, caption=caption))

    held = [r for r in rows if "eval_accuracy" in r]
    add(
        "reward",
        "Reward and held-out accuracy",
        pictures.curves(
            steps,
            {"reward (mean)": _col(rows, "reward_mean"), "accuracy": _col(rows, "accuracy")},
            "reward per step",
            "reward",
            ylim=(None, None),  # a user's reward may be negative
            band=(_col(rows, "reward_min"), _col(rows, "reward_max")) if "reward_min" in rows[0] else None,
            points={
                "held-out accuracy": ([r["step"] for r in held], [r["eval_accuracy"] for r in held]),
                "held-out reward": ([r["step"] for r in held], [r.get("eval_reward_mean") for r in held]),
            },
        ),
        "The step's rollouts: mean reward (band: min to max) and the share of responses with reward 1; squares: "
        "held-out greedy evaluation (--eval.dataset), where the run had one.",
    )
    add(
        "peaks",
        "Peak against B",
        pictures.run_peaks(peaks_by_step(run)),
        "Each rank's measured peak over its budget B, every microbatch, steps one after another (grey lines); "
        "dashed: B. Hollow marks: pad rows of the zero-advantage skip.",
    )
    add(
        "actions",
        "The action each unit took",
        pictures.run_heatmap(run.actions),
        "Rows: the recovery units in layer order (attention and MLP blocks); columns: every rank's microbatches, "
        "step by step. H stores a unit's activations exactly, P keeps its expensive ops' outputs, L a low-precision "
        "copy, R recomputes it in backward; grey: a pad row of the zero-advantage skip.",
    )
    shares = {f"{a}": _col(rows, f"fraction_{a}") for a in ("H", "P", "L", "R")}
    add(
        "shares",
        "Actions per step",
        pictures.curves(
            steps,
            shares,
            "share of unit actions per step (mean over ranks)",
            "share",
            ylim=(0, 1.02),
            colours=pictures.COLOURS,
        ),
        "The share of (unit, microbatch) pairs that took each action, per step.",
    )
    times = {"update (s)": _col(rows, "update_seconds")}
    compared = "compare_gc_seconds" in rows[-1]
    if compared:
        times["gc, same microbatches (s)"] = _col(rows, "compare_gc_seconds")
        times[f"{run.backend}, same microbatches (s)"] = _col(rows, f"compare_{run.backend}_seconds")
    add(
        "time",
        "Update time",
        pictures.curves(steps, times, "update time per step", "seconds"),
        "The step's learner updates (the slowest rank)"
        + (
            "; with --compare_gc, gradient checkpointing and the backend timed on the same microbatches, interleaved."
            if compared
            else "; the run did not time gc beside it (--compare_gc)."
        ),
    )
    if any(r.get("zero_adv_share") is not None for r in rows):
        add(
            "skip",
            "Responses with no signal",
            pictures.curves(
                steps,
                {"responses": _col(rows, "zero_adv_share"), "their tokens": _col(rows, "zero_adv_token_share")},
                "share with advantage 0"
                + (" (skipped by the learners)" if any(r.get("zero_adv_skip") for r in rows) else ""),
                "share",
                ylim=(0, 1.02),
            ),
            "Responses whose advantage is exactly 0 (a group of equal rewards) and their share of the response "
            "tokens; with --hilore.skip_zero_advantage the learners leave them out of forward and backward.",
        )
    return out


def _summary(run: Run) -> List[tuple]:
    rows, last = run.metrics, run.metrics[-1]
    out = [("steps", f"{len(rows)} (last: {last['step']})")]
    first = f"{rows[0]['reward_mean']:.3f} at step {rows[0]['step']}"
    out.append(("reward (mean)", f"{first}, {last['reward_mean']:.3f} at step {last['step']}"))
    held = [r for r in rows if "eval_accuracy" in r]
    if held:
        out.append(("held-out accuracy", f"{held[-1]['eval_accuracy']:.3f} after step {held[-1]['step']}"))
    peaks = [r["peak_over_budget_max"] for r in rows if isinstance(r.get("peak_over_budget_max"), (int, float))]
    if peaks:
        out.append(("peak / B", f"max {max(peaks):.3f}, median of steps {statistics.median(peaks):.3f}"))
    ranks = (last.get("coordinator") or {}).items()
    budgets = ", ".join(f"rank {r}: {rec['budget_bytes'] / 2**20:.1f} MiB" for r, rec in ranks if "budget_bytes" in rec)
    if budgets:
        out.append(("B", f"{budgets} ({last.get('budget_scope', '-')} scope)"))
    out.append(("update time", f"{sum(r.get('update_seconds', 0) for r in rows):.1f} s over all steps"))
    if "compare_gc_seconds" in last:
        gc = sum(r["compare_gc_seconds"] for r in rows)
        ours = sum(r[f"compare_{run.backend}_seconds"] for r in rows)
        out.append(
            ("against gc", f"gc {gc:.1f} s, {run.backend} {ours:.1f} s on the same microbatches (x{gc / ours:.3f})")
        )
    shares = [r["zero_adv_share"] for r in rows if r.get("zero_adv_share") is not None]
    if shares:
        skipped = any(r.get("zero_adv_skip") for r in rows)
        out.append(("advantage 0", f"{statistics.fmean(shares):.0%} of responses" + (", skipped" if skipped else "")))
    speedups = [r["compare_skip_speedup"] for r in rows if "compare_skip_speedup" in r]
    if speedups:  # --compare_skip: the first update with every response over with the skip's rows
        out.append(("the skip's speed-up", f"x{statistics.median(speedups):.3f} (median of steps, --compare_skip)"))
    return out


STYLE = """
body { font-family: system-ui, sans-serif; margin: 24px auto; max-width: 1240px; color: #222; padding: 0 16px; }
h1 { font-size: 22px; } h2 { font-size: 17px; margin-top: 28px; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 13px; } td, th { padding: 3px 10px; border-bottom: 1px solid #eee; }
th { text-align: left; font-weight: 600; } figure { margin: 8px 0 20px; }
figcaption { font-size: 13px; color: #555; max-width: 900px; } img { display: block; }
code { font-size: 12px; }
"""


def _table(pairs) -> str:
    cells = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>" for k, v in pairs)
    return f"<table>{cells}</table>"


def render(run: Run, figures: List[Dict]) -> str:
    """The page: the summary, each picture (``figures``: with ``file``, ``width``, ``height``) and the flags."""
    parts = [
        f"<h1>Training run <code>{html.escape(run.path.resolve().name)}</code></h1>",
        f"<p>Folder: <code>{html.escape(str(run.path.resolve()))}</code></p>",
        _table(_summary(run)),
    ]
    for f in figures:
        parts.append(
            f'<h2>{html.escape(f["title"])}</h2><figure><img src="{html.escape(f["file"])}" width="{f["width"]}" '
            f'height="{f["height"]}" alt="{html.escape(f["title"])}"><figcaption>{html.escape(f["caption"])}'
            "</figcaption></figure>"
        )
    parts.append("<h2>Settings</h2>")
    if run.flags:
        main = [(k, run.flags[k]) for k in MAIN_FLAGS if k in run.flags]
        rest = sorted((k, v) for k, v in run.flags.items() if k not in MAIN_FLAGS)
        parts += [_table(main), f"<details><summary>every flag ({len(rest)} more)</summary>{_table(rest)}</details>"]
    else:
        parts.append("<p>The run folder holds no checkpoint (its flags are kept there): saved under --ckpt.path?</p>")
    body = "\n".join(parts)
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>run {html.escape(run.path.resolve().name)}</title><style>{STYLE}</style></head>\n"
        f"<body>\n{body}\n</body></html>\n"
    )


def write(folder, out=None) -> Path:
    """Write the report of the run in ``folder`` into ``out`` (default ``<folder>/report``): ``index.html``
    and one PNG per picture; returns the page's path. ``run_folder.NotARun`` when there is no run."""
    run = read(folder)
    out = Path(out) if out is not None else run.path / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    figures = []
    for f in _figures(run):
        path = pictures.png(f.pop("fig"), out / f"{f['name']}.png")
        width, height = pictures.png_size(path)
        figures.append(dict(f, file=path.name, width=width, height=height))
    page = out / PAGE
    page.write_text(render(run, figures))
    return page
