"""The budget coordinator: one Ray actor that every learner rank reports to.

Each rank measures its peak memory per microbatch (above the memory held when the microbatch
starts; ``runtime.memory``) and reports it. The coordinator holds every rank's budget B and
answers each report: ``ok``; ``tighten`` with the overshoot in bytes, after which the rank
shrinks its own allocation budget by that much (plus a margin) and re-plans before its next
microbatch; or, for a rank registered with a ``fill`` target, ``loosen`` when the microbatch
left more than ``FILL_BAND`` of B unused: by half the gap to ``fill`` x B (damped, because a
plan's real bytes per planned byte are not known exactly; ``tighten`` stays the guard and
sets a ceiling that later loosening does not pass, ``RankPlan.loosen``). It keeps a per-step
record (per rank: max peak / B, reports, tightenings, loosenings) that the driver puts into the metrics. Plain Python: ``ray.remote(BudgetCoordinator)`` makes the actor,
and tests use the class directly.
"""
from __future__ import annotations

from typing import Dict, List, Optional


def call(method, *args):
    """Call a coordinator method: on a Ray actor handle (the job) or a plain object (tests)."""
    if hasattr(method, "remote"):
        import ray

        return ray.get(method.remote(*args))
    return method(*args)


FILL_BAND = 0.05  # loosen only below (fill - FILL_BAND) x B
LOOSEN_DAMPING = 0.5  # share of the gap to fill x B a loosen directive asks for


class BudgetCoordinator:
    def __init__(self, margin: float = 0.05):
        self.margin = margin  # tighten by overshoot x (1 + margin)
        self.budgets: Dict[int, int] = {}
        self.fills: Dict[int, float] = {}  # rank -> share of B its microbatches aim at (0: never loosen)
        self.steps: Dict[int, Dict[int, dict]] = {}  # step -> rank -> record

    def register(self, rank: int, budget_bytes: int, fill: float = 0.0) -> None:
        """``fill``: the share of B the rank's microbatches aim at (``--hilore.fill``); 0 only
        guards against overshoot."""
        if budget_bytes <= 0:
            raise ValueError(f"rank {rank}: budget must be positive, got {budget_bytes}")
        if not 0.0 <= fill <= 1.0:
            raise ValueError(f"rank {rank}: fill must be within [0, 1], got {fill}")
        self.budgets[int(rank)] = int(budget_bytes)
        self.fills[int(rank)] = float(fill)

    def budget(self, rank: int) -> int:
        return self.budgets[int(rank)]

    def report(self, rank: int, step: int, microbatch: int, peak_bytes: int, actions: Optional[Dict[str, int]] = None) -> dict:
        """Record one microbatch's measured peak; return the directive for the rank's next one."""
        rank = int(rank)
        if rank not in self.budgets:
            raise KeyError(f"rank {rank} reported before registering its budget")
        B = self.budgets[rank]
        rec = self.steps.setdefault(int(step), {}).setdefault(rank, {"max_peak": 0, "microbatches": 0, "tightened": [],
                                                                     "loosened": [], "actions": {}, "peaks": []})
        rec["max_peak"] = max(rec["max_peak"], int(peak_bytes))
        rec["microbatches"] += 1
        rec["peaks"].append(int(peak_bytes))
        for k, v in (actions or {}).items():
            rec["actions"][k] = rec["actions"].get(k, 0) + int(v)
        if peak_bytes > B:
            over = int((peak_bytes - B) * (1 + self.margin))
            rec["tightened"].append({"microbatch": int(microbatch), "peak_over_budget": peak_bytes / B, "by_bytes": over})
            return {"action": "tighten", "by_bytes": over, "peak_over_budget": peak_bytes / B}
        fill = self.fills.get(rank, 0.0)
        if fill and peak_bytes < (fill - FILL_BAND) * B:
            by = int((fill * B - peak_bytes) * LOOSEN_DAMPING)
            rec["loosened"].append({"microbatch": int(microbatch), "peak_over_budget": peak_bytes / B, "by_bytes": by})
            return {"action": "loosen", "by_bytes": by, "peak_over_budget": peak_bytes / B}
        return {"action": "ok", "peak_over_budget": peak_bytes / B}

    def step_record(self, step: int) -> Dict[str, dict]:
        """Per rank: ``peak_over_budget`` (max peak / B), microbatches, tightenings, loosenings,
        action counts."""
        out = {}
        for rank, rec in sorted(self.steps.get(int(step), {}).items()):
            out[str(rank)] = {"peak_over_budget": rec["max_peak"] / self.budgets[rank], "max_peak_bytes": rec["max_peak"],
                              "budget_bytes": self.budgets[rank], "microbatches": rec["microbatches"],
                              "tightened": list(rec["tightened"]), "loosened": list(rec["loosened"]),
                              "actions": dict(rec["actions"]),
                              "peaks_over_budget": [p / self.budgets[rank] for p in rec["peaks"]]}
        return out

    def over_budget_ranks(self, step: int) -> List[int]:
        return [int(r) for r, rec in self.step_record(step).items() if rec["peak_over_budget"] > 1.0]
