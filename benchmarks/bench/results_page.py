"""``benchmarks/RESULTS.md`` and the README's headline table, generated from the committed JSON.

``python -m benchmarks.bench.report --results benchmarks/results --out benchmarks/RESULTS.md
[--readme README.md]`` rewrites both; ``--check`` only compares and exits 1 when a file differs
(the default suite runs it, so no figure on either page can drift from its JSON).

The noise floor beside every speed: gc timed against itself. A run made with ``gc-aa`` (every
run since it was added) carries an interleaved A/A row in each phase: gc over gc-aa, repeat
by repeat, exactly as a method is paired with gc. Older results have none; for them the floor
is the ratio of gc's update time in one repeat to the next repeat of the same piece (adjacent
repeats are further apart than a pair, so that floor is wider) and is marked "adjacent". A
speed is called above the floor only when its interval lies wholly above the floor's.

A comparison of HiLoRe with a peer is printed as a ratio only when one phase timed both
(``outputs.paired``); peers measured in other pieces or phases stand beside it with their own
speed over their own gc, marked "not paired".
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional

from hilore_actor.learner.plan import plan_counts
from .outputs import VERSUS, definitions, fmt, paired, plans, record_notes, versus
from . import results_studies
from .results_runs import Page, Run, load_page
from .stats import bootstrap_ci, log_spread, repeats_to_resolve, resolvable_difference

MIB = 2**20
# Gradient checkpointing and the peers that keep gradients exact: "the fastest peer that fits".
EXACT_PEERS = ("gc", "gc+full", "no-gc", "sac", "sac-budget", "compile-budget")
BEGIN, END = (
    "<!-- results:headline (generated: python -m benchmarks.bench.report --results ...) -->",
    "<!-- /results:headline -->",
)


def load(results: Path, name: str) -> Optional[Dict]:
    p = Path(results) / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def interval(s: Optional[float], ci) -> str:
    return "-" if s is None else f"{s:.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")


# ---- noise floor and comparisons ---------------------------------------------------------
def gc_times(data: Dict, piece: Optional[str]) -> List[float]:
    """gc's update times in ``piece`` (the gc every method of that piece is paired with)."""
    for r in data["records"]:
        if r.get("piece") == piece and r.get("paired_gc_seconds_all"):
            return r["paired_gc_seconds_all"]
    gc = next((r for r in data["records"] if r["method"] == "gc"), None)
    return gc["update_seconds_all"] if gc else []


def aa_floor(times: List[float]) -> Dict:
    """The adjacent-repeat floor of results without a gc-aa row."""
    ratios = [a / b for a, b in zip(times, times[1:])]
    if not ratios:
        return {"median": None, "ci": None, "kind": "adjacent"}
    return {"median": statistics.median(ratios), "ci": bootstrap_ci(ratios), "kind": "adjacent"}


def floor_of(data: Dict, r: Dict) -> Dict:
    """The A/A floor of the phase ``r`` was timed in: interleaved (gc-aa) when the run had it."""
    if r.get("aa_ci95"):
        return {"median": r["aa_over_gc"], "ci": r["aa_ci95"], "kind": "interleaved"}
    return aa_floor(gc_times(data, r.get("piece")))


def floor_cell(f: Dict) -> str:
    return interval(f["median"], f["ci"]) + (
        " (adjacent)" if f["kind"] == "adjacent" and f["median"] is not None else ""
    )


def over_peer(data: Dict, peer: Dict, b: float) -> str:
    """HiLoRe over ``peer`` at ``b`` when one phase timed both, else "not paired"."""
    s = paired(
        data, f"hilore@{b:.2f}", peer["method"] if peer.get("budget_ratio") is None else f"{peer['method']}@{b:.2f}"
    )
    return f"hilore / it {interval(s['speed_over_gc'], s.get('speed_ci95'))}, paired" if s else "not paired"


def peer_cell(data: Dict, h: Optional[Dict], peer: Optional[Dict], b: float, hooked: bool = False) -> str:
    """The fastest exact peer, and HiLoRe over it when one phase timed both; ``hooked``: the run's
    compile-budget graph traced an engine's idle hooks (marked stale)."""
    if not peer:
        return "-"
    stale = " stale" if hooked and peer["method"] == "compile-budget" else ""
    text = f"{peer['method']} {fmt(peer['speed_over_gc'])}{stale}"
    return text if peer["method"] == "gc" or h is None else f"{text} ({over_peer(data, peer, b)})"


def above(r: Dict, floor: Dict) -> Optional[bool]:
    if not r.get("speed_ci95") or not floor["ci"]:
        return None
    return r["speed_ci95"][0] > floor["ci"][1]


def fits(r: Dict, b: float) -> bool:
    f = r.get("fits_budget")
    return bool(f) if isinstance(f, bool) else b in (f or [])


def fastest_peer(records: List[Dict], b: float) -> Optional[Dict]:
    """The fastest exact peer whose measured peak fits B (gc, budgeted at ``b``, or unbudgeted)."""
    ok = [
        r
        for r in records
        if r["method"] in EXACT_PEERS
        and r.get("speed_over_gc") is not None
        and r.get("budget_ratio") in (None, b)
        and fits(r, b)
    ]
    return max(ok, key=lambda r: r["speed_over_gc"], default=None)


def find(records: List[Dict], method: str, b: Optional[float]) -> Optional[Dict]:
    return next((r for r in records if r["method"] == method and r.get("budget_ratio") == b), None)


OPTION = {"exact": "H", "checkpoint": "R", "partial": "P", "compressed": "L"}


def option_key(label: str) -> str:
    """A plan label's option in a unit's record: ``compressed:bf16@0.1`` -> ``L:bf16@0.1``."""
    for plan, key in OPTION.items():
        if label.startswith(plan):
            return key + label[len(plan) :]
    return label


def plan_cell(r: Dict, codec: str = "") -> str:
    """H/L/P/R counts of a record's validated plan; the L count split by codec and exact-row share."""
    if "plan" not in r:
        return "-"
    c = plan_counts(r["plan"])
    core = sum(v == "partial:core" for v in r["plan"].values())
    kinds = Counter(v[len("compressed") :].lstrip(":") or "" for v in r["plan"].values() if v.startswith("compressed"))
    split = ", ".join(f"{n} {(k if not k.startswith('@') else codec + k) or codec}" for k, n in sorted(kinds.items()))
    p = f"{c['partial']} P" + (f" ({core} core)" if core else "")
    return f"{c['exact']} H, {c['compressed']} L{f' ({split})' if split and codec else ''}, {p}, {c['checkpoint']} R"


def profiled_saving(r: Dict) -> Optional[float]:
    """Seconds per planning-size microbatch the plan saves against all-R, by its units' profiles."""
    units = r.get("units")
    if not units:
        return None
    return sum(u.get("options", {}).get(option_key(u["plan"]), {}).get("seconds_saved", 0.0) for u in units.values())


def over_tolerance(r: Dict, tol: float = 0.015) -> str:
    errs = r.get("grad_rel_err_all") or []
    bad = [e for e in errs if e is not None and e > tol]
    return (
        f"error over {tol} on {len(bad)} of {len(errs)} updates ({', '.join(f'{e:.4f}' for e in errs)})" if bad else ""
    )


# ---- one result --------------------------------------------------------------------------
def _pieces(data: Dict, name: str) -> List[str]:
    pieces = data.get("pieces") or [
        {"name": f"{name}.json", "command": data["command"], "git_commit": data["git_commit"]}
    ]
    out = ["| piece | methods | commit | gc median s |", "|---|---|---|---|"]
    for p in pieces:
        piece = p["name"] if data.get("pieces") else None
        methods = sorted({r["method"] for r in data["records"] if r.get("piece") == piece})
        times = gc_times(data, piece)
        out.append(
            f"| `{p['name']}` | {', '.join(methods)} | {p['git_commit'][:7]} | "
            f"{fmt(statistics.median(times) if times else None, '.1f')} |"
        )
    out += ["", "Commands:", ""] + [f"- `{p['command']}`" for p in pieces]
    return out


def _table(data: Dict) -> List[str]:
    out = [
        "| method | B | speed x gc [95% CI] | A/A floor [95% CI] | above floor | recompute removed | "
        "peak / B1 | grad err mean / max | plan | notes |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(data["records"], key=lambda r: (r.get("budget_ratio") is None, r.get("budget_ratio") or 0)):
        b = fmt(r.get("budget_ratio"), ".2f")
        if r.get("unavailable"):
            out.append(f"| {r['method']} | {b} | not run: {r['unavailable']} | | | | | | | |")
            continue
        floor = floor_of(data, r)
        ab = above(r, floor) if r["method"] != "gc" else None
        out.append(
            f"| {r['method']} ({r['head']} head) | {b} | {interval(r['speed_over_gc'], r.get('speed_ci95'))} | "
            f"{floor_cell(floor)} | {'-' if ab is None else ('yes' if ab else 'no')} | "
            f"{fmt(r.get('gap_recovered'), '.0%')} | {r['peak_over_gc']:.3f} | "
            f"{fmt(r.get('grad_rel_err_mean'), '.4f')} / {fmt(r.get('grad_rel_err_max'), '.4f')} | "
            f"{plan_cell(r, first_codec(data))} | {', '.join(x for x in (record_notes(r), over_tolerance(r)) if x)} |"
        )
    return out


def first_codec(data: Dict) -> str:
    return str(data.get("codec") or "").split(",")[0]


def _observations(data: Dict) -> List[str]:
    recs, out = data["records"], []
    for b in data["budgets"]:
        peer, h = fastest_peer(recs, b), find(recs, "hilore", b)
        if peer:
            out.append(
                f"- At {b:.2f}: the fastest exact peer that fits is `{peer['method']}`, "
                f"{interval(peer['speed_over_gc'], peer.get('speed_ci95'))} x gc"
                + (f" ({over_peer(data, peer, b)})" if peer["method"] != "gc" and h else "")
                + "."
            )
        if h and h.get("speed_over_gc") is not None:
            floor = floor_of(data, h)
            verdict = {True: "above", False: "not above", None: "not comparable with"}[above(h, floor)]
            val = (h.get("validation") or {}).get("peak_over_budget")
            out.append(
                f"- At {b:.2f}: `hilore` {interval(h['speed_over_gc'], h.get('speed_ci95'))} x gc is {verdict} "
                f"its phase's A/A floor {floor_cell(floor)}; plan {plan_cell(h, first_codec(data))}"
                + (f", {profiled_saving(h):.2f} s saved per microbatch by profile" if profiled_saving(h) else "")
                + (f", validated at {val:.3f} of B" if val else "")
                + "."
            )
            out += _power(data, h, b)
    hl = [r for r in recs if "plan" in r]
    if hl:
        within = all(r.get("fits_budget") is True for r in hl)
        worst = max(hl, key=lambda r: r.get("grad_rel_err_mean") or 0)
        out.append(
            f"- HiLoRe records within B on every measured microbatch: {'all' if within else 'not all'}; largest "
            f"mean gradient error {fmt(worst.get('grad_rel_err_mean'), '.4f')} (`{worst['method']}` at "
            f"{fmt(worst.get('budget_ratio'), '.2f')})."
        )
    return out


def _power(data: Dict, h: Dict, b: float, d: float = 0.03) -> List[str]:
    """The three estimators of ``h``'s speed side by side, and what its repeats can resolve:
    the spread of its paired log ratios over gc-aa sizes the test (``stats.repeats_to_resolve``)."""
    sd = log_spread(h.get("over_aa_ratios") or [])
    if sd is None:
        return []
    n = len(h["over_aa_ratios"])
    pieces = f" from {len(data['pieces'])} pieces" if data.get("pooled") else ""
    return [
        f"- At {b:.2f}: `hilore` x gc by median of paired ratios {fmt(h.get('speed_over_gc'))}, geometric mean "
        f"{interval(h.get('speed_geomean'), h.get('speed_geomean_ci95'))}, total-time ratio "
        f"{fmt(h.get('speed_total_ratio'))}; over gc-aa {interval(h.get('over_aa_over_gc'), h.get('over_aa_ci95'))}. "
        f"Power: {n} paired repeats{pieces}, log spread over gc-aa {sd:.4f}: they resolve a "
        f"{resolvable_difference(sd, n):.1%} difference (5% two-sided, 80% power); {d:.0%} needs "
        f"{repeats_to_resolve(sd, d)}."
        + (
            f" Plans by piece: {'; '.join(plan_cell({'plan': p}) for p in h['plans_by_piece'])}"
            f" ({_plans_differ(h['plans_by_piece'])})."
            if h.get("plans_by_piece")
            else ""
        )
    ]


def _plans_differ(plans: List[Dict]) -> str:
    """How the pieces' plans of one row differ: in how many units' labels."""
    units = {u for p in plans for u in p}
    n = sum(len({p.get(u) for p in plans}) > 1 for u in units)
    return f"{n} of {len(units)} units planned differently" if n else "identical"


def _loo(data: Dict) -> bool:
    """Whether HiLoRe ran its leave-one-out check: a merged header's flag is its first piece's,
    so the pieces that hold HiLoRe records decide (their commands say ``--no-loo``)."""
    pieces = {r.get("piece") for r in data["records"] if "plan" in r}
    cmds = [p["command"] for p in data.get("pieces") or [] if p["name"] in pieces]
    return all("--no-loo" not in c for c in cmds) if cmds else bool(data.get("loo"))


def _workload(data: Dict) -> str:
    w = data["workload"]
    resident = data.get("budget_offset_bytes") or 0
    return (
        f"Workload `{w['name']}` ({w.get('note') or w.get('arch')}): {w['microbatches']} microbatches of "
        f"{w['tokens']} tokens per update, LoRA r{w['lora_rank']}, {w['dtype']}, {data['device']}, torch "
        f"{data['torch']}, {data['threads']} threads; {data['repeats']} interleaved repeats of {data['updates']} "
        f"updates; calibration {data.get('calib')} x {data.get('calib_tokens')} tokens, codecs `{data.get('codec')}`, "
        f"leave-one-out {'on' if _loo(data) else 'off'}; "
        + (
            f"resident bytes in B (weights, gradients, AdamW state) {resident / MIB:.1f} MiB."
            if data["budget_scope"] == "device"
            else "B counts no resident bytes (activation scope)."
        )
    )


def run_section(run: Run, data: Dict, page: Page) -> str:
    merged = bool(data.get("pieces"))
    last = "pool" if data.get("pooled") else "merge"
    cmd = (
        (" ".join(f"{run.name}:{i + 1}" for i in range(len(data["pieces"]))) + f" {run.name}:{last}")
        if merged
        else run.name
    )
    out = [
        f"## {run.title} (`{run.name}`)",
        "",
        run.about,
        "",
        f"Run: `bash benchmarks/v2.sh {cmd}`; raw times, peaks and per-unit plans: "
        f"`benchmarks/results/{run.name}.json` (and `.md`, `.png`).",
        "",
        run.stale or page.current_planner,
        "",
        _workload(data),
        "",
        definitions(data),
        "",
    ]
    out += _table(data) + [""] + _observations(data) + [""]
    notes = run.notes + ([page.hooked_compile_budget_note] if run.hooked_compile_budget else [])
    out += [f"- {n}" for n in notes] + ([""] if notes else [])
    for extra in [versus(data["records"], m, ref, header=data) for m, ref in VERSUS] + [plans(data["records"])]:
        if extra:
            out += [extra.strip(), ""]
    out += ["### Pieces", ""] + _pieces(data, run.name)
    return "\n".join(out) + "\n"


# ---- the headline ------------------------------------------------------------------------
def headline(results: Path, page: Page) -> str:
    out = [
        "| result | B | hilore x gc [95% CI] | A/A floor [95% CI] | above floor | recompute removed | "
        "peak / B1 | grad err mean | fastest exact peer that fits |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, method, b in page.headline:
        data = load(results, name)
        r = data and find(data["records"], method, b)
        if not r:
            out.append(f"| `{name}` | {b:.2f} | missing | | | | | | |")
            continue
        floor = floor_of(data, r)
        peer = fastest_peer(data["records"], b)
        ab = above(r, floor)
        out.append(
            f"| `{name}` | {b:.2f} x {data['budget_from']} ({data['budget_scope']}) | "
            f"{interval(r['speed_over_gc'], r.get('speed_ci95'))} | {floor_cell(floor)} | "
            f"{'-' if ab is None else ('yes' if ab else 'no')} | {fmt(r.get('gap_recovered'), '.0%')} | "
            f"{r['peak_over_gc']:.3f} | {fmt(r.get('grad_rel_err_mean'), '.4f')} | "
            f"{peer_cell(data, r, peer, b, page.hooked(name))} |"
        )
    return "\n".join(out) + "\n"


HEADLINE_KEY = (
    "The paper reports +10.16% throughput over gradient checkpointing and 43% of its recompute time "
    "removed at 1.10 B_GC (Qwen2.5-3B, GPUs). "
    "Speed: median of paired ratios gc time / hilore time over interleaved repeats (2 CPU cores, "
    "chunked head for every method). B: the ratio times the peak of the named method in the named "
    "scope (device: weights, gradients, AdamW state, activations, head and the optimizer step). A/A "
    "floor: gc against a second gc interleaved in the same phase (gc-aa), or, for results without it, "
    'gc against itself in adjacent repeats of the same piece (marked adjacent); "above floor" only '
    "when the whole interval is above it. The fastest exact peer stands with its own speed over its own "
    'gc; HiLoRe over it is printed only when one phase timed both (else "not paired"); "stale": a '
    "compile-budget row whose graph traced an engine's idle hooks (the run's notes). Recompute removed: the share "
    "of gc's recompute time (gc - no-gc) "
    "saved. Gradient error: relative to no-gc, mean over 3 updates."
)


# ---- the page ----------------------------------------------------------------------------
def render(results: Path) -> str:
    results = Path(results)
    page = load_page(results)
    out = [
        "# Results",
        "",
        "Generated from the JSON in `benchmarks/results/` by `python -m benchmarks.bench.report --results "
        "benchmarks/results --out benchmarks/RESULTS.md --readme README.md`; do not edit by hand (a default-suite "
        "test regenerates it and fails when this file differs). How the benchmark measures: "
        "[`docs/benchmark.md`](../docs/benchmark.md). Nothing here ran on a GPU.",
        "",
        "## Headline",
        "",
        headline(results, page),
        HEADLINE_KEY,
        "",
    ]
    for run in page.runs:
        data = load(results, run.name)
        if data is not None:
            out.append(run_section(run, data, page))
    for text in (
        results_studies.codecs(results, page.codec_runs),
        results_studies.architectures(results),
        results_studies.fidelity(results),
        results_studies.diagnostics(results, page),
        results_studies.knapsack(results),
        results_studies.planning_scale(results),
        results_studies.demo(results, page.demo_runs),
        results_studies.skip_demo(results, page.skip_runs),
    ):
        if text:
            out.append(text)
    out.append(
        "## Older results\n\n`benchmarks/results/v1-stale/` holds the first benchmark's results, kept for the "
        "record and not for claims (`STALE.md` there says why).\n"
    )
    return "\n".join(out).rstrip() + "\n"


def readme_block(results: Path) -> str:
    return f"{BEGIN}\n{headline(Path(results), load_page(results))}\n{HEADLINE_KEY}\n{END}"


def with_headline(readme: str, results: Path) -> str:
    """``readme`` with its headline block (between the markers) regenerated."""
    i, j = readme.find(BEGIN), readme.find(END)
    if i < 0 or j < i:
        raise ValueError(f"the README has no headline block ({BEGIN!r} ... {END!r})")
    return readme[:i] + readme_block(results) + readme[j + len(END) :]


def write(results: Path, out: Path, readme: Optional[Path] = None, check: bool = False) -> List[str]:
    """Write (or with ``check`` only compare) the page and the README's block; returns the
    files that differed from what the JSON gives."""
    wanted = {Path(out): render(results)}
    if readme is not None:
        wanted[Path(readme)] = with_headline(Path(readme).read_text(), results)
    stale = [str(p) for p, text in wanted.items() if not p.exists() or p.read_text() != text]
    if not check:
        for p, text in wanted.items():
            p.write_text(text)
    return stale
