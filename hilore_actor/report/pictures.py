"""The pictures of a training run: the action each unit took on each microbatch (a heatmap), each
rank's peak against B per microbatch, and the run's curves. One look answers what HiLoRe decided
and how close it came to B, which the JSONL scalars leave to the reader. matplotlib (Agg: no
display) is imported here, where it is used; every function returns a ``Figure`` that
``png`` renders and closes."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

# the heatmap's cell values, in legend order; "skipped": a pad microbatch of the zero-advantage
# skip (one skipped response, gradient 0). Okabe-Ito colours: distinct under colour blindness.
KINDS = ("H", "P", "L", "R", "skipped")
COLOURS = {"H": "#009E73", "P": "#56B4E9", "L": "#E69F00", "R": "#D55E00", "skipped": "#BBBBBB"}
MEANING = {
    "H": "H: stored exactly",
    "P": "P: partly stored",
    "L": "L: low-precision copy",
    "R": "R: recomputed",
    "skipped": "skipped (pad row)",
}
DPI = 100


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _integers():
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(integer=True)


def unit_label(name: str) -> str:
    """``model.layers.7.self_attn`` -> ``7 self_attn``: the layer and the block, what a row needs."""
    m = re.search(r"(?:^|\.)(\d+)\.(.+)$", name)
    return f"{m.group(1)} {m.group(2)}" if m else name


def actions_heatmap(
    units: Sequence[str],
    columns: Sequence[Tuple[str, bool]],
    title: str,
    column_labels: Optional[Sequence[str]] = None,
    groups: Sequence[Tuple[int, str]] = (),
    xlabel: str = "microbatch",
    separators: Sequence[int] = (),
):
    """Rows: ``units`` in layer order; columns: ``(actions, skipped)``, one letter per unit
    (``H``/``P``/``L``/``R``; a skipped column is drawn as skipped whatever ran). ``groups``:
    ``(first column, name)`` of each group of columns (a rank, a step), separated by a line and
    named on top; ``separators``: first columns of subgroups (the ranks within a step), a thin
    line; ``column_labels``: a tick per column where they fit."""
    import numpy as np
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    plt = _plt()
    code = {k: i for i, k in enumerate(KINDS)}
    grid = np.full((len(units), len(columns)), np.nan)
    for j, (acts, skipped) in enumerate(columns):
        for i, a in enumerate(acts[: len(units)]):
            grid[i, j] = code["skipped"] if skipped else code.get(a, np.nan)
    width = min(16.0, 3.5 + 0.22 * len(columns))
    height = min(16.0, 1.6 + 0.2 * len(units))
    fig, ax = plt.subplots(figsize=(width, height), dpi=DPI)
    cmap = ListedColormap([COLOURS[k] for k in KINDS]).with_extremes(bad="white")  # white: no action recorded
    ax.imshow(
        np.ma.masked_invalid(grid), cmap=cmap, vmin=-0.5, vmax=len(KINDS) - 0.5, aspect="auto", interpolation="nearest"
    )
    every = max(1, -(-len(units) // 40))
    ax.set_yticks(range(0, len(units), every), [unit_label(u) for u in units][::every], fontsize=7)
    if column_labels is not None and len(columns) <= 48:
        ax.set_xticks(range(len(columns)), column_labels, fontsize=7, rotation=90 if len(columns) > 16 else 0)
    else:
        ax.set_xticks([])
    if len(columns) <= 64 and len(units) <= 80:  # cell borders where cells are big enough to see them
        ax.set_xticks(np.arange(-0.5, len(columns)), minor=True)
        ax.set_yticks(np.arange(-0.5, len(units)), minor=True)
        ax.grid(which="minor", color="white", linewidth=0.6)
        ax.tick_params(which="minor", length=0)
    for first in separators:
        ax.axvline(first - 0.5, color="#222222", linewidth=1.0, linestyle=(0, (2, 2)))
    for k, (first, name) in enumerate(groups):
        if first > 0:
            ax.axvline(first - 0.5, color="black", linewidth=1.2)
        end = groups[k + 1][0] if k + 1 < len(groups) else len(columns)
        ax.text((first + end - 1) / 2, -0.7, name, ha="center", va="bottom", fontsize=8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("unit (layer, block)")
    ax.set_title(title, fontsize=10, pad=16 if groups else 6)
    handles = [Patch(facecolor=COLOURS[k], label=MEANING[k]) for k in KINDS]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return fig


def peaks_chart(
    series: Dict[str, Tuple[List[float], List[float], List[bool]]],
    title: str,
    xlabel: str = "microbatch",
    boundaries: Sequence[float] = (),
):
    """Each rank's peak over B per microbatch (``{rank: (x, peak/B, skipped)}``), B's line at 1
    and, for a whole run, the steps' ``boundaries``; a skipped (pad) microbatch is a hollow mark."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8.0, 3.6), dpi=DPI)
    for b in boundaries:
        ax.axvline(b, color="#DDDDDD", linewidth=0.8, zorder=0)
    top = 1.0
    for rank, (xs, ys, skipped) in sorted(series.items(), key=lambda kv: int(kv[0])):
        (line,) = ax.plot(xs, ys, marker="o", markersize=4, linewidth=1.2, label=f"rank {rank}")
        hollow = [(x, y) for x, y, s in zip(xs, ys, skipped) if s]
        if hollow:
            ax.plot(
                *zip(*hollow),
                linestyle="none",
                marker="o",
                markersize=7,
                markerfacecolor="white",
                markeredgecolor=line.get_color(),
            )
        top = max([top, *ys])
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1.2, label="B")
    ax.xaxis.set_major_locator(_integers())
    ax.set_ylim(0, top * 1.08)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("peak / B")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    return fig


def curves(
    x: Sequence[float],
    series: Dict[str, Sequence[Optional[float]]],
    title: str,
    ylabel: str,
    xlabel: str = "step",
    band: Optional[Tuple[Sequence[float], Sequence[float]]] = None,
    points: Optional[Dict[str, Tuple[Sequence[float], Sequence[float]]]] = None,
    ylim: Tuple[Optional[float], Optional[float]] = (0, None),
    colours: Optional[Dict[str, str]] = None,
):
    """Lines over the steps (``None`` values left out; ``colours`` by series name), an optional
    min-max ``band`` under the first series, and ``points``: series of their own x (held-out
    evaluations). The y axis starts at 0 unless ``ylim`` says otherwise."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8.0, 3.4), dpi=DPI)
    if band is not None:
        import numpy as np

        low, high = (np.asarray(b, dtype=float) for b in band)  # a step without the value: None, a gap
        ax.fill_between(x, low, high, alpha=0.2, label="min-max")
    for name, ys in series.items():
        pts = [(a, b) for a, b in zip(x, ys) if b is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", markersize=3, linewidth=1.4, label=name, color=(colours or {}).get(name))
    for name, (px, py) in (points or {}).items():
        if px:
            ax.plot(px, py, marker="s", markersize=6, linewidth=1.0, linestyle=":", label=name)
    ax.set_ylim(*ylim)
    ax.xaxis.set_major_locator(_integers())
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig


def step_heatmap(record: Dict, step: int):
    """One step of ``actions.jsonl``: units by each rank's microbatches (None without units:
    the gc and none backends have no recovery engine to record actions)."""
    if not record.get("units"):
        return None
    columns, labels, groups = [], [], []
    for rank, mbs in sorted(record["ranks"].items(), key=lambda kv: int(kv[0])):
        groups.append((len(columns), f"rank {rank}"))
        columns += [(m["actions"], m["skipped"]) for m in mbs]
        labels += [str(k) for k in range(len(mbs))]
    title = f"step {step}: the action each unit took on each microbatch"
    return actions_heatmap(record["units"], columns, title, labels, groups)


def step_peaks(record: Dict, step: int):
    """One step of ``actions.jsonl``: each rank's peak over B per microbatch."""
    series = {
        rank: (list(range(len(mbs))), [m["peak_over_budget"] for m in mbs], [m["skipped"] for m in mbs])
        for rank, mbs in record["ranks"].items()
    }
    return peaks_chart(series, f"step {step}: each rank's peak against B per microbatch")


MAX_COLUMNS = 400  # a whole run's heatmap: evenly spaced steps beyond this many microbatch columns


def run_heatmap(records: Sequence[Dict]):
    """The whole run: the steps' heatmaps side by side (every rank's microbatches per step); a run
    with more microbatches than ``MAX_COLUMNS`` shows evenly spaced steps, the last included."""
    records = [r for r in records if r.get("units")]
    if not records:
        return None
    width = max(sum(len(m) for m in r["ranks"].values()) for r in records)
    keep = max(1, MAX_COLUMNS // max(width, 1))
    shown = records
    if len(records) > keep:
        last = len(records) - 1
        shown = [records[k] for k in sorted({round(last - i * last / max(keep - 1, 1)) for i in range(keep)})]
    columns, groups, ranks = [], [], []
    for r in shown:
        groups.append((len(columns), f"step {r['step']}"))
        for k, (_, mbs) in enumerate(sorted(r["ranks"].items(), key=lambda kv: int(kv[0]))):
            if k:
                ranks.append(len(columns))
            columns += [(m["actions"], m["skipped"]) for m in mbs]
    what = f"{len(shown)} of {len(records)} steps" if len(shown) < len(records) else f"{len(records)} steps"
    title = f"the action each unit took on each microbatch ({what}; in each step rank 0, 1, ...)"
    xlabel = "microbatch, by step and rank (dashed: the next rank)"
    return actions_heatmap(records[-1]["units"], columns, title, groups=groups, xlabel=xlabel, separators=ranks)


def run_peaks(records: Sequence[Dict]):
    """The whole run: each rank's peak over B on every microbatch, steps one after the other."""
    series: Dict[str, Tuple[List[float], List[float], List[bool]]] = {}
    boundaries, x0 = [], 0
    for r in records:
        longest = max((len(m) for m in r["ranks"].values()), default=0)
        for rank, mbs in r["ranks"].items():
            xs, ys, sk = series.setdefault(rank, ([], [], []))
            xs += [x0 + k for k in range(len(mbs))]
            ys += [m["peak_over_budget"] for m in mbs]
            sk += [m["skipped"] for m in mbs]
        x0 += longest
        boundaries.append(x0 - 0.5)
    return peaks_chart(
        series, "each rank's peak against B, every microbatch", "microbatch (steps one after another)", boundaries[:-1]
    )


def png(fig, path) -> Path:
    """Render ``fig`` to ``path`` (PNG) and close it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    _plt().close(fig)
    return path


def png_size(path) -> Tuple[int, int]:
    """(width, height) in pixels, from the PNG's header."""
    head = Path(path).read_bytes()[:24]
    if head[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{path}: not a PNG")
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
