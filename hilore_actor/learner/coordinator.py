"""The budget coordinator: one Ray actor that every learner rank reports to.

Each rank measures its peak memory per microbatch (above the memory held when the microbatch
starts; ``runtime.memory``) and reports it. The coordinator holds every rank's budget B and
answers each report: ``ok``, or ``tighten`` with the overshoot in bytes, after which the rank
shrinks its own memory budget by that much (plus a margin) and re-plans before its next
microbatch (ranks also size their plans by their own measured peaks, ``RankPlanner.observe``;
``tighten`` is the guard). It keeps a per-step record (per rank: max peak / B, each
microbatch's peak, tokens and predicted peak, tightenings) that the driver puts into the
metrics. Plain Python: ``ray.remote(BudgetCoordinator)`` makes the actor, and tests use the
class directly.

If the actor dies, Ray restarts it (the job gives it ``max_restarts``): the new copy reloads
the state saved with the last checkpoint (``checkpoints``: the job's checkpoint folder, whose
``latest`` names the newest; ``STATE_FILE`` in it), ranks wait while it restarts (``call``),
and a rank it does not know re-registers with the budget its report carries. The records of
steps since that checkpoint are lost with the old copy (``restarts`` counts the restarts).
"""

from __future__ import annotations

import json
import os
import time
from typing import Dict, List, Optional

from .fault_injection import injected, reconstructed

STATE_FILE = "coordinator.json"


def call(method, *args, wait_s: float = 600.0):
    """Call a coordinator method: on a Ray actor handle (the job) or a plain object (tests).
    While Ray restarts the actor, calls are refused: wait for it, up to ``wait_s``."""
    if not hasattr(method, "remote"):
        return method(*args)
    import ray
    from ray.exceptions import ActorUnavailableError

    deadline = time.monotonic() + wait_s
    while True:
        try:
            return ray.get(method.remote(*args))
        except ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


class BudgetCoordinator:
    def __init__(self, margin: float = 0.05, checkpoints: Optional[str] = None, resume_from: Optional[str] = None):
        """``resume_from``: a checkpoint folder whose state to start from (``--resume``);
        ``checkpoints``: the job's checkpoint folder, whose newest state a copy that Ray
        restarted loads."""
        self.margin = margin  # tighten by overshoot x (1 + margin)
        self.budgets: Dict[int, int] = {}
        self.steps: Dict[int, Dict[int, dict]] = {}  # step -> rank -> record
        self.restarts = 0
        if checkpoints and reconstructed():
            try:
                with open(os.path.join(checkpoints, "latest")) as f:
                    resume_from = os.path.join(checkpoints, f.read().strip())
            except OSError:
                pass  # no checkpoint yet: ranks re-register with their reports
            if resume_from:
                self.load_state(resume_from)
            self.restarts += 1
        elif resume_from:
            self.load_state(resume_from)

    def state(self) -> Dict:
        """JSON-ready: budgets and step records (saved with each checkpoint)."""
        return {
            "margin": self.margin,
            "budgets": {str(r): b for r, b in self.budgets.items()},
            "restarts": self.restarts,
            "steps": {str(s): {str(r): rec for r, rec in recs.items()} for s, recs in self.steps.items()},
        }

    def restart_count(self) -> int:
        return self.restarts

    def load_state(self, folder: str) -> bool:
        """The state saved in checkpoint ``folder`` (False: it has none)."""
        try:
            with open(os.path.join(folder, STATE_FILE)) as f:
                state = json.load(f)
        except (OSError, ValueError):
            return False
        self.budgets = {int(r): int(b) for r, b in state["budgets"].items()}
        self.steps = {int(s): {int(r): rec for r, rec in recs.items()} for s, recs in state["steps"].items()}
        self.restarts = int(state.get("restarts", 0))
        return True

    def register(self, rank: int, budget_bytes: int) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"rank {rank}: budget must be positive, got {budget_bytes}")
        self.budgets[int(rank)] = int(budget_bytes)

    def budget(self, rank: int) -> int:
        return self.budgets[int(rank)]

    def report(
        self,
        rank: int,
        step: int,
        microbatch: int,
        peak_bytes: int,
        actions: Optional[Dict[str, int]] = None,
        tokens: int = 0,
        predicted_bytes: int = 0,
        budget_bytes: int = 0,
    ) -> dict:
        """Record one microbatch's measured peak (with its tokens and the peak its plan
        predicted, when known); return the directive for the rank's next one. ``budget_bytes``:
        the rank's B, registered if this copy does not know the rank (a restart)."""
        rank = int(rank)
        if injected("coordinator", step) and not reconstructed():
            os._exit(17)
        if rank not in self.budgets and budget_bytes > 0:
            self.register(rank, budget_bytes)
        if rank not in self.budgets:
            raise KeyError(f"rank {rank} reported before registering its budget")
        B = self.budgets[rank]
        rec = self._record(step, rank)
        rec["max_peak"] = max(rec["max_peak"], int(peak_bytes))
        rec["microbatches"] += 1
        rec["peaks"].append(int(peak_bytes))
        rec["tokens"].append(int(tokens))
        rec["predicted"].append(int(predicted_bytes))
        for k, v in (actions or {}).items():
            rec["actions"][k] = rec["actions"].get(k, 0) + int(v)
        if peak_bytes > B:
            over = int((peak_bytes - B) * (1 + self.margin))
            rec["tightened"].append(
                {"microbatch": int(microbatch), "peak_over_budget": peak_bytes / B, "by_bytes": over}
            )
            return {"action": "tighten", "by_bytes": over, "peak_over_budget": peak_bytes / B}
        return {"action": "ok", "peak_over_budget": peak_bytes / B}

    def _record(self, step: int, rank: int) -> dict:
        return self.steps.setdefault(int(step), {}).setdefault(
            int(rank),
            {
                "max_peak": 0,
                "microbatches": 0,
                "tightened": [],
                "actions": {},
                "peaks": [],
                "tokens": [],
                "predicted": [],
                "out_of_memory": [],
            },
        )

    def out_of_memory(self, rank: int, step: int, microbatch: int, tokens: int, by_bytes: int) -> None:
        """A rank ran out of memory in a microbatch and reruns it all-R, its plan ``by_bytes``
        smaller (``learner/microbatch_run.out_of_memory``)."""
        self._record(step, rank)["out_of_memory"].append(
            {"microbatch": int(microbatch), "tokens": int(tokens), "by_bytes": int(by_bytes)}
        )

    def step_record(self, step: int) -> Dict[str, dict]:
        """Per rank: ``peak_over_budget`` (max peak / B), microbatches, tightenings, action
        counts, and per microbatch its peak, tokens and predicted peak over B."""
        out = {}
        for rank, rec in sorted(self.steps.get(int(step), {}).items()):
            out[str(rank)] = {
                "peak_over_budget": rec["max_peak"] / self.budgets[rank],
                "max_peak_bytes": rec["max_peak"],
                "budget_bytes": self.budgets[rank],
                "microbatches": rec["microbatches"],
                "tightened": list(rec["tightened"]),
                "actions": dict(rec["actions"]),
                "peaks_over_budget": [p / self.budgets[rank] for p in rec["peaks"]],
                "tokens": list(rec["tokens"]),
                "predicted_over_budget": [p / self.budgets[rank] for p in rec["predicted"]],
                "out_of_memory": list(rec.get("out_of_memory", [])),
            }
        return out

    def over_budget_ranks(self, step: int) -> List[int]:
        return [int(r) for r, rec in self.step_record(step).items() if rec["peak_over_budget"] > 1.0]
