"""One result's outputs: a printed table, a JSON file, a frontier plot, a markdown table, and the paired
comparisons and plan evidence the results page shows too."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Tuple

from hilore_actor.learner.plan import plan_counts
from .partial import write_atomic
from .stats import speed_summary

FIELDS = (
    "method",
    "head",
    "budget_ratio",
    "update_seconds",
    "tokens_per_second",
    "speed_over_gc",
    "speed_ci95",
    "peak_bytes",
    "peak_over_gc",
    "peak_activations_bytes",
    "peak_device_bytes",
    "grad_rel_err_mean",
    "grad_rel_err_max",
    "h_frac",
    "l_frac",
    "p_frac",
    "r_frac",
    "online_overhead_seconds",
    "update_seconds_all",
    "paired_gc_seconds_all",
    "bimodal_times",
    "fits_budget",
)


# The paired comparisons a result prints when one phase timed both: HiLoRe over its whole-unit form,
# and HiLoRe on compiled units over the compiled peers.
VERSUS = (("hilore", "hilore-coarse"), ("hilore+compile", "compile-budget"), ("hilore+compile", "gc+compile"))


def fmt(v, spec=".3f"):
    return "-" if v is None else (format(v, spec) if isinstance(v, float) else str(v))


def _ci(r) -> str:
    ci = r.get("speed_ci95")
    return "-" if not ci else f"[{ci[0]:.3f}, {ci[1]:.3f}]"


def record_notes(r) -> str:
    notes = []
    if r["fits_budget"] is False:
        notes.append("over budget")
    if r.get("bimodal_times"):
        notes.append("bimodal times")
    if r.get("sac_layers") is not None:
        notes.append(f"SAC on {len(r['sac_layers'])} layers")
    if r.get("activation_memory_budget") is not None:
        notes.append(f"activation_memory_budget {r['activation_memory_budget']:.4f}")
    return ", ".join(notes)


def table(records: List[Dict]) -> str:
    head = (
        f"{'method':<18}{'head':>8}{'B':>6}{'upd s':>9}{'x gc':>7}{'95% CI':>17}{'peak/B1':>9}{'err mean':>10}"
        f"{'err max':>10}{'H':>6}{'L':>6}{'P':>6}{'R':>6}  note"
    )
    lines = [head, "-" * len(head)]
    for r in records:
        if r.get("unavailable"):
            lines.append(f"{r['method']:<18}{'':>8}{fmt(r['budget_ratio'], '.2f'):>6}  not run: {r['unavailable']}")
            continue
        lines.append(
            f"{r['method']:<18}{r['head']:>8}{fmt(r['budget_ratio'], '.2f'):>6}{r['update_seconds']:>9.3f}"
            f"{fmt(r['speed_over_gc']):>7}{_ci(r):>17}{r['peak_over_gc']:>9.3f}{fmt(r['grad_rel_err_mean'], '.4f'):>10}"
            f"{fmt(r['grad_rel_err_max'], '.4f'):>10}{fmt(r['h_frac'], '.2f'):>6}{fmt(r['l_frac'], '.2f'):>6}"
            f"{fmt(r.get('p_frac'), '.2f'):>6}{fmt(r['r_frac'], '.2f'):>6}  {record_notes(r)}"
        )
    return "\n".join(lines)


def definitions(header: Dict) -> str:
    scope = {
        "device": "device scope: weights, gradients, AdamW state, activations, head and the optimizer step",
        "activations": "activation scope: bytes allocated inside a microbatch",
    }[header["budget_scope"]]
    return (
        f"B at ratio 1.00 = the peak of `{header['budget_from']}` ({scope}) = "
        f"{header['budget_base_bytes'] / 2**20:.1f} MiB; every method runs the `{header['head']}` head unless its "
        f"name ends in `+full`. Speed = median over repeats of the paired ratio gc time / method time (gc with "
        f"the `{header['head']}` head, timed in the same phase), with a bootstrap 95% interval. Gradient error: "
        f"relative to no-gc, summed over each update, mean and max over {header['updates']} updates; LoRA B init "
        f"{header['inputs'].get('lora_b_init')}. Recompute removed (the paper's second metric): the share of gc's "
        f"recompute time (gc - no-gc, same head) a method saves, from the paired speeds."
    )


def markdown(records: List[Dict], header: Dict) -> str:
    out = [
        f"Workload `{header['workload']['name']}` ({header['device']}, torch {header['torch']}, "
        f"{header['threads']} threads, GLIBC_TUNABLES={header['glibc_tunables']}, commit {header['git_commit']}), "
        f"{header['repeats']} interleaved repeats; command: `{header['command']}`",
        "",
        definitions(header),
        "",
        "| method | head | B | update s | speed x gc [95% CI] | recompute removed | peak / B1 | act. peak MiB | "
        "device peak MiB | grad err mean | grad err max | H | L | P | R | notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        if r.get("unavailable"):
            out.append(
                f"| {r['method']} | | {fmt(r['budget_ratio'], '.2f')} | not run: {r['unavailable']} |||||||||||||"
            )
            continue
        out.append(
            f"| {r['method']} | {r['head']} | {fmt(r['budget_ratio'], '.2f')} | {r['update_seconds']:.3f} | "
            f"{fmt(r['speed_over_gc'])} {_ci(r)} | {fmt(r.get('gap_recovered'), '.0%')} | {r['peak_over_gc']:.3f} | "
            f"{r['peak_activations_bytes'] / 2**20:.1f} | {r['peak_device_bytes'] / 2**20:.1f} | "
            f"{fmt(r['grad_rel_err_mean'], '.4f')} | {fmt(r['grad_rel_err_max'], '.4f')} | "
            f"{fmt(r['h_frac'], '.2f')} | {fmt(r['l_frac'], '.2f')} | {fmt(r.get('p_frac'), '.2f')} | "
            f"{fmt(r['r_frac'], '.2f')} | {record_notes(r)} |"
        )
    return "\n".join(out) + "\n" + "".join(versus(records, m, ref, header=header) for m, ref in VERSUS) + plans(records)


def phases_of(header: Dict) -> List[Tuple[Optional[str], str, Dict[str, List[float]]]]:
    """(piece, phase label, {method key: times}) of every timed phase of a result; a merged
    result keeps each piece's (``timing.Phase``)."""
    pieces = header.get("pieces") or [{"name": None, "phases": header.get("phases")}]
    return [(p["name"], ph["label"], ph["times"]) for p in pieces for ph in p.get("phases") or []]


def paired(header: Dict, method: str, reference: str, within: Optional[List[str]] = None) -> Optional[Dict]:
    """``method`` over ``reference`` (keys as ``timing.key``: ``name`` or ``name@1.10``) from
    every phase that timed both (``within``: only those of these phases), pairs kept within
    their repeat and pooled over phases (a ``speed_summary``, its "over gc" over ``reference``,
    with the phases it used); None when no phase timed both: then the two are not compared."""
    ref, times, used = [], [], []
    for piece, label, t in phases_of(header):
        if within is not None and f"{piece or 'this run'}: {label}" not in within:
            continue
        if method in t and reference in t:
            n = min(len(t[method]), len(t[reference]))
            ref += t[reference][:n]
            times += t[method][:n]
            used.append(f"{piece or 'this run'}: {label}")
    if not times:
        return None
    return dict(speed_summary(ref, times), phases=used)


def reading(s: Dict, floor: Optional[Dict]) -> str:
    """Where a paired ratio's interval lies against the A/A floor's (gc-aa over gc in the same
    phases): a difference is read only when the intervals do not overlap."""
    if not floor or not s.get("speed_ci95") or not floor.get("speed_ci95"):
        return "-"
    (lo, hi), (flo, fhi) = s["speed_ci95"], floor["speed_ci95"]
    return "above the floor" if lo > fhi else "below the floor" if hi < flo else "within the floor"


def versus(
    records: List[Dict], method: str = "hilore", reference: str = "hilore-coarse", header: Optional[Dict] = None
) -> str:
    """``method`` over ``reference`` at each budget, as the median of their paired times
    (reference / method, both timed in the same repeats) with a bootstrap 95% interval, beside
    the A/A floor of the same phases; from the phases' raw times when the result has them, else
    from records of one piece (no floor); pairs from different pieces or phases are never formed."""
    out = []
    budgets = sorted(
        {r.get("budget_ratio") for r in records if r["method"] == method and r.get("update_seconds_all")},
        key=lambda b: b or 0,
    )
    budgeted = any(r["method"] == reference and r.get("budget_ratio") is not None for r in records)
    for b in budgets:
        ref_key = f"{reference}@{b:.2f}" if budgeted else reference  # an unbudgeted peer (gc+compile) has one key
        s = paired(header or {}, f"{method}@{b:.2f}", ref_key) if b is not None else None
        floor = paired(header or {}, "gc-aa", "gc", within=s["phases"]) if s else None
        if s is None:
            r = next(
                r
                for r in records
                if r["method"] == method and r.get("budget_ratio") == b and r.get("update_seconds_all")
            )
            ref = next(
                (
                    x
                    for x in records
                    if x["method"] == reference
                    and x.get("budget_ratio") in (b, None)
                    and x.get("piece") == r.get("piece")
                    and x.get("update_seconds_all")
                ),
                None,
            )
            if ref is None:
                continue  # timed in different pieces: not a pair (neither is ever a compiled peer's phase)
            s = speed_summary(ref["update_seconds_all"], r["update_seconds_all"])  # its "over gc" is over ``reference``
        aa = f"{floor['speed_over_gc']:.3f} {_ci(floor)}" if floor else "-"
        out.append(
            f"| {fmt(b, '.2f')} | {s['speed_over_gc']:.3f} {_ci(s)} | {len(s['speed_ratios'])} | {aa} | "
            f"{reading(s, floor)} |"
        )
    if not out:
        return ""
    return (
        f"\n### `{method}` over `{reference}` (paired repeats)\n\n"
        "| B | speed [95% CI] | repeats | A/A floor of those phases [95% CI] | reading |\n|---|---|---|---|---|\n"
        + "\n".join(out)
        + "\n"
    )


def plans(records: List[Dict], top: int = 4) -> str:
    """Why HiLoRe stored what it stored: per budget, the room above the all-R peak and the
    units with the best utility per byte that the plan left R (``records.plan_evidence``)."""
    out = []
    for r in records:
        if "units" not in r:
            continue
        u = r["units"]
        kept = plan_counts({n: v["plan"] for n, v in u.items()})
        left = sorted(
            (n for n, v in u.items() if v["plan"] == "checkpoint"),
            key=lambda n: -u[n]["dtau_H"] / max(u[n]["bytes_H"], 1),
        )[:top]
        desc = "; ".join(
            f"`{n}` saves {u[n]['dtau_H'] * 1e3:.1f} ms for {u[n]['bytes_H'] / 2**20:.1f} MiB H "
            + (
                f"(L: {u[n]['dtau_L'] * 1e3:.1f} ms, {u[n]['bytes_L'] / 2**20:.1f} MiB, "
                f"risk {fmt(u[n]['risk_L'], '.4f')})"
                if u[n].get("dtau_L") is not None
                else "(no L)"
            )
            for n in left
        )
        out.append(
            f"- `{r['method']}` at {fmt(r['budget_ratio'], '.2f')}: room {r['room_bytes'] / 2**20:.1f} MiB inside a "
            f"microbatch, all-R peak {r['all_r_peak_bytes'] / 2**20:.1f} MiB, "
            f"so {r['memory_budget_bytes'] / 2**20:.1f} MiB "
            f"for stored units; plan keeps {kept['exact']} H, {kept['partial']} P "
            f"({sum(v['plan'] == 'partial:core' for v in u.values())} of them P:core) "
            f"and {kept['compressed']} L of {len(u)}. "
            f"Best left R: {desc or 'none'}."
        )
    return ("\n### HiLoRe plans\n\n" + "\n".join(out) + "\n") if out else ""


def write_json(path, header: Dict, records: List[Dict]) -> None:
    """Through a temporary file beside ``path``: a run killed while writing leaves the last whole file."""
    write_atomic(path, {**header, "records": records})


def plot(path, records: List[Dict], budgets, title: str) -> None:
    """Each method's frontier: throughput over gc against measured peak over B at 1.00,
    one line per method through its budgets; unbudgeted methods are single points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 5.5))
    markers = "os^vD<>pP*hX"
    runs = [r for r in records if not r.get("unavailable") and r.get("speed_over_gc") is not None]
    for i, name in enumerate(sorted({r["method"] for r in runs})):
        pts = sorted((r["peak_over_gc"], r["speed_over_gc"], r["budget_ratio"]) for r in runs if r["method"] == name)
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            marker=markers[i % len(markers)],
            ms=7,
            label=name,
            ls="-" if len(pts) > 1 else "none",
        )
        for x, y, b in pts:
            if b is not None:
                ax.annotate(f"{b:.2f}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    for b in budgets:
        ax.axvline(b, color="grey", lw=0.6, ls=":")
    ax.axhline(1.0, color="black", lw=0.6)
    ax.set_xlabel("measured peak / B at 1.00 (dotted: budgets)")
    ax.set_ylabel("update throughput / gc throughput")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="best")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
