"""The benchmark's outputs: a printed table, a JSON file, a frontier plot, a markdown table."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List

FIELDS = ("method", "budget_ratio", "update_seconds", "tokens_per_second", "peak_bytes", "peak_over_gc",
          "grad_rel_err_mean", "grad_rel_err_max", "h_frac", "l_frac", "r_frac", "online_overhead_seconds")


def fmt(v, spec=".3f"):
    return "-" if v is None else (format(v, spec) if isinstance(v, float) else str(v))


def table(records: List[Dict]) -> str:
    head = f"{'method':<16}{'B/gc':>6}{'upd s':>9}{'tok/s':>9}{'x gc':>7}{'peak/gc':>9}{'err mean':>10}{'err max':>10}{'H':>6}{'L':>6}{'R':>6}{'ovh s':>8}  note"
    lines = [head, "-" * len(head)]
    for r in records:
        if r.get("unavailable"):
            lines.append(f"{r['method']:<16}{fmt(r['budget_ratio'], '.2f'):>6}  not run: {r['unavailable']}")
            continue
        lines.append(
            f"{r['method']:<16}{fmt(r['budget_ratio'], '.2f'):>6}{r['update_seconds']:>9.3f}{r['tokens_per_second']:>9.0f}"
            f"{r['speed_over_gc']:>7.3f}{r['peak_over_gc']:>9.3f}{fmt(r['grad_rel_err_mean'], '.4f'):>10}"
            f"{fmt(r['grad_rel_err_max'], '.4f'):>10}{fmt(r['h_frac'], '.2f'):>6}{fmt(r['l_frac'], '.2f'):>6}"
            f"{fmt(r['r_frac'], '.2f'):>6}{fmt(r['online_overhead_seconds'], '.4f'):>8}  {'' if r['fits_budget'] else 'over budget'}"
        )
    return "\n".join(lines)


def markdown(records: List[Dict], header: Dict) -> str:
    out = [f"Workload `{header['workload']['name']}` ({header['device']}, torch {header['torch']}), "
           f"{header['repeats']} interleaved repeats; command: `{header['command']}`", "",
           "| method | B / gc | update s | tokens/s | speed x gc | peak / gc | grad err mean | grad err max | H | L | R |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        if r.get("unavailable"):
            out.append(f"| {r['method']} | {fmt(r['budget_ratio'], '.2f')} | not run: {r['unavailable']} ||||||||| ")
            continue
        out.append(f"| {r['method']} | {fmt(r['budget_ratio'], '.2f')} | {r['update_seconds']:.3f} | {r['tokens_per_second']:.0f} | "
                   f"{r['speed_over_gc']:.3f} | {r['peak_over_gc']:.3f} | {fmt(r['grad_rel_err_mean'], '.4f')} | "
                   f"{fmt(r['grad_rel_err_max'], '.4f')} | {fmt(r['h_frac'], '.2f')} | {fmt(r['l_frac'], '.2f')} | {fmt(r['r_frac'], '.2f')} |")
    return "\n".join(out) + "\n"


def _clean(v):
    """NaN / inf (e.g. a peer whose gradients overflow) become null: strict JSON."""
    if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))):
        return None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_clean(x) for x in v]
    return v


def write_json(path, header: Dict, records: List[Dict]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(_clean({**header, "records": records}), indent=1, allow_nan=False))


def plot(path, records: List[Dict], budgets, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    markers = "os^vD<>pP*hX"
    names = sorted({r["method"] for r in records if not r.get("unavailable")})
    for i, name in enumerate(names):
        pts = [(r["peak_over_gc"], r["speed_over_gc"], r["budget_ratio"]) for r in records if r["method"] == name and not r.get("unavailable")]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker=markers[i % len(markers)], s=60, label=name)
        for x, y, b in pts:
            if b is not None:
                ax.annotate(f"{b:.2f}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    for b in budgets:
        ax.axvline(b, color="grey", lw=0.6, ls=":")
    ax.axhline(1.0, color="black", lw=0.6)
    ax.set_xlabel("peak memory / gc peak (dotted: budgets)")
    ax.set_ylabel("update throughput / gc throughput")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="best")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
