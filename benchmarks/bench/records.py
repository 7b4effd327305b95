"""One JSON record per benchmarked method and budget, from its timings, peaks and gradients.

Every raw number stays in the record (each repeat's time, the gc times paired with them, each
update's per-microbatch peaks in both scopes, each update's gradient error), so a reader can
recompute every summary from the JSON.
"""

from __future__ import annotations

import statistics
from typing import Dict, List, Optional

from .methods import COMPILE, Budget, split_name
from .stats import bimodal, speed_summary
from .timing import AA, Timings


def _fractions(name: str, t: Timings) -> Dict[str, Optional[float]]:
    base = split_name(name.removesuffix(COMPILE))[0]
    if base == "no-gc":
        return {"H": 1.0, "L": 0.0, "P": 0.0, "R": 0.0}
    if base in ("gc", AA):
        return {"H": 0.0, "L": 0.0, "P": 0.0, "R": 1.0}
    total = sum(t.actions.values())
    return {k: t.actions.get(k, 0) / total for k in "HLPR"} if total else {k: None for k in "HLPR"}


def aa_summary_of(r: Dict) -> Dict:
    """The A/A floor of the phase a record was timed in: gc over gc-aa, repeat by repeat
    (``aa_over_gc``, ``aa_ci95``, ...); and the method against gc-aa directly
    (``over_aa_*``, the pair whose spread sizes a powered run: ``stats.repeats_to_resolve``)."""
    gc, aa, t = r.get("paired_gc_seconds_all"), r.get("paired_aa_seconds_all"), r.get("update_seconds_all")
    if not aa:
        return {}
    return {**speed_summary(gc, aa, prefix="aa"), **speed_summary(aa, t, prefix="over_aa")}


def method_record(
    m, t: Timings, peaks: List, errs: List[float], budget: Budget, budgets: List[float], tokens_per_update: int
) -> Dict:
    """``peaks``: one ``UpdatePeaks`` per measured update; ``errs``: each update's relative
    gradient error against no-gc."""
    scoped = [p.device_peak if budget.scope == "device" else max(p.activations) for p in peaks]
    mb_peaks = [x for p in peaks for x in (p.device if budget.scope == "device" else p.activations)]
    if budget.scope == "device":
        mb_peaks += [p.step_device for p in peaks]
    peak = max(scoped)
    t_med = statistics.median(t.seconds)
    frac = _fractions(m.name, t)
    rec = {
        "method": m.name,
        "head": m.head,
        "budget_ratio": m.budget_ratio,
        "budget_bytes": None if m.budget_ratio is None else budget.bytes(m.budget_ratio),
        "update_seconds": t_med,
        "update_seconds_all": t.seconds,
        "paired_gc_seconds_all": t.gc_seconds,
        "cpu_seconds_median": statistics.median(t.cpu_seconds),
        "cpu_seconds_all": t.cpu_seconds,
        "bimodal_times": bimodal(t.seconds),
        **speed_summary(t.gc_seconds, t.seconds),
        "paired_aa_seconds_all": t.aa_seconds,
        "tokens_per_second": tokens_per_update / t_med,
        "peak_bytes": peak,
        "peak_over_gc": peak / budget.peak,
        "peak_activations_bytes": max(max(p.activations) for p in peaks),
        "peak_device_bytes": max(p.device_peak for p in peaks),
        "peaks_by_update": [p.to_dict() for p in peaks],
        "grad_rel_err_mean": sum(errs) / len(errs),
        "grad_rel_err_max": max(errs),
        "grad_rel_err_all": errs,
        "h_frac": frac["H"],
        "l_frac": frac["L"],
        "p_frac": frac["P"],
        "r_frac": frac["R"],
        "online_overhead_seconds": statistics.median(t.overhead)
        if split_name(m.name)[0].startswith("hilore")
        else None,
        "prepare_seconds": m.prepare_seconds,
        **m.extra,
    }
    rec.update(aa_summary_of(rec))
    if m.budget_ratio is None:
        rec["fits_budget"] = [b for b in budgets if peak <= budget.bytes(b)]
    else:
        rec["fits_budget"] = all(x <= budget.bytes(m.budget_ratio) for x in mb_peaks)
    if m.hilore is not None:
        rec.update(plan_evidence(m.hilore, t.taken))
    return rec


def plan_evidence(h, taken: Optional[Dict] = None) -> Dict:
    """The plan and, per unit, what the knapsack saw: utility (seconds saved, Eq. 9), bytes and
    calibration risk of H and L; with the room above the all-R peak, so a reader can see why a
    unit was left R. ``options``: every option the unit had before forward (P and token L
    included); ``taken``: the action labels it ran with over the timed updates."""
    sp = next(iter(h.plans.values()))
    risks = h.static_risks()
    units = {
        n: {
            "plan": sp.plan[n],
            "dtau_H": sp.costs.dtau[n]["H"],
            "dtau_L": sp.costs.dtau[n].get("L"),
            "bytes_H": sp.costs.dm[n]["H"],
            "bytes_L": sp.costs.dm[n].get("L"),
            "risk_L": risks.get(n, {}).get("L"),
            "levels": {
                a: {"dtau": sp.costs.dtau[n][a], "bytes": sp.costs.dm[n][a], "risk": risks.get(n, {}).get(a)}
                for a in h.levels
            },
            "options": {
                o.action: {"seconds_saved": o.value, "bytes": o.memory, "risk": o.risk}
                for o in h.options(sp.costs, n, None, risks.get(n, {}))
            },
            "taken": dict((taken or {}).get(n, {})),
        }
        for n in sp.plan
    }
    return {
        "plan": sp.plan,
        "validation": sp.report,
        "units": units,
        "room_bytes": h.room,
        "all_r_peak_bytes": sp.costs.base_peak,
        "all_r_seconds": sp.costs.base_seconds,
        "memory_budget_bytes": sp.memory_budget,
        "risk_budget": sp.risk_budget,
    }


def add_gap_recovered(records: List[Dict]) -> None:
    """The paper's second metric: the share of gc's recompute time (gc - no-gc, both with the
    method's head) that a method removes. From paired speeds, so records timed in different
    phases or pieces (``merge``) combine: with ``t = 1 / speed`` (time relative to the
    benchmark's gc), ``(t_gc - t) / (t_gc - t_nogc)``."""
    rel = {
        (split_name(r["method"])[0], r["head"]): 1.0 / r["speed_over_gc"]
        for r in records
        if r.get("speed_over_gc") and r.get("budget_ratio") is None
    }
    for r in records:
        if not r.get("speed_over_gc") or split_name(r["method"])[0] in ("gc", "no-gc"):
            continue
        gc, nogc = rel.get(("gc", r["head"])), rel.get(("no-gc", r["head"]))
        if gc and nogc and gc > nogc:
            r["gap_recovered"] = (gc - 1.0 / r["speed_over_gc"]) / (gc - nogc)
