"""One learner microbatch under HiLoRe: the sequence every integration runs.

meter -> the plan sized to the microbatch's tokens -> recovery-engine step (that plan's
storage during forward) -> the integration's own forward, loss and backward, which sets the
actions (Eq. 7 -> Eq. 13 of docs/DESIGN.md) between loss and backward -> the actions taken
and their H/L/R counts -> the measured peak against the plan's prediction (later plans are
sized by it) and to the budget coordinator -> ``tighten`` when over B: the rank re-plans
before its next microbatch.

The training job (``train/learner.py``) calls its loss and ``engine.backward`` inside the
block; the OpenRLHF drop-in (``openrlhf/training_step.py``) calls OpenRLHF's whole
``training_step`` there and sets the actions from its intercepted ``strategy.backward``. Without
a recovery engine (backends ``gc`` and ``none``) the block only measures the peak.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Dict, Iterator, Optional

from ..recovery.policies import layer_checkpointing, stores_nothing
from ..recovery.labels import ACTIONS
from ..runtime import MemoryMeter
from .coordinator import call

END_MARK = "end_of_microbatch"  # MicrobatchRecord.end_here


@dataclass
class MicrobatchRecord:
    """What one microbatch did: the engine step while it runs, then its actions and peak."""

    step: Optional[object] = None  # the recovery engine's Step (None without an engine)
    sp: Optional[object] = None  # the plan sized to this microbatch (``RankPlanner.for_tokens``)
    tokens: int = 0
    resident: int = 0  # bytes held when the microbatch began, as B's scope counts them (0: activations)
    actions: Dict[str, str] = field(default_factory=dict)  # unit -> H | L | R
    peak_bytes: int = 0  # allocated inside the microbatch, above what it began with
    trapped_bytes: int = 0  # CUDA: free bytes in partly used segments above that peak, at most (``MemoryReport``)
    predicted_bytes: int = 0  # the in-microbatch peak its plan predicted (0: no plan)
    meter: Optional[MemoryMeter] = None  # while the block runs

    def end_here(self) -> None:
        """What follows in the block (an integration's optimizer step) is not the microbatch's:
        its peak is the peak up to this point."""
        if self.meter is not None:
            self.meter.mark(END_MARK)

    @property
    def scope_peak(self) -> int:
        """The peak as B counts it: resident + in-microbatch (device), or in-microbatch only."""
        return self.resident + self.peak_bytes

    @property
    def budget_peak(self) -> int:
        """What the coordinator holds against B: ``scope_peak`` + trapped bytes, which the allocator
        cannot give back before an OOM (fragmentation; 0 on CPU and with expandable segments)."""
        return self.scope_peak + self.trapped_bytes

    @property
    def counts(self) -> Dict[str, int]:
        return {a: sum(v == a for v in self.actions.values()) for a in ACTIONS}

    def set_actions(self, plan, loss_output, agree=None) -> None:
        """The plan's online actions for this microbatch (needs its omega: call after the loss);
        ``agree``: made one per unit across ranks (ZeRO-3: ``lockstep.agree_actions``)."""
        if self.step is not None:
            actions = plan.actions(self.step, loss_output, self.sp)
            self.step.set_actions(agree(actions) if agree is not None and isinstance(actions, dict) else actions)


@contextlib.contextmanager
def run_microbatch(
    plan, engine, device, tokens: int, resident: int = 0, all_r: bool = False, token_scores=None
) -> Iterator[MicrobatchRecord]:
    """Run the block as one microbatch of ``tokens`` tokens under ``plan`` (a ``RankPlanner``;
    its plan sized to those tokens) on ``engine`` (a ``RecoveryEngine`` or None); the record
    is complete when the block exits. ``resident``: what the rank holds as the microbatch
    begins, in B's scope (``scope.resident_now`` for the device scope, 0 otherwise).
    ``all_r``: recompute every unit whatever the plan (a rerun after running out of memory).
    ``token_scores``: the microbatch's pre-forward token weights for token L
    (``allocation.runner.token_scores``; None: the rows' norms alone choose its exact rows)."""
    rec = MicrobatchRecord(tokens=int(tokens), resident=int(resident))
    meter = rec.meter = MemoryMeter(device)
    with meter:
        if engine is None:
            yield rec
        else:
            rec.sp = plan.for_tokens(tokens)
            rec.predicted_bytes = plan.predicted_peak(rec.sp)
            if all_r or stores_nothing(rec.sp.plan):  # all-R: plain layer checkpointing, no engine bookkeeping
                with layer_checkpointing(engine.model):
                    yield rec
                rec.actions = {n: "R" for n in rec.sp.plan}
            else:
                with engine.step(
                    rec.sp.plan,
                    track_tokens=plan.track_tokens,
                    track_error=False,
                    token_scores=token_scores,
                    regions=True,
                ) as st:
                    rec.step = st
                    yield rec
                    rec.actions = st.actions()
    rec.meter = None
    rec.peak_bytes = meter.report.peak_before.get(END_MARK, meter.report.peak_bytes)
    rec.trapped_bytes = meter.report.trapped_before.get(END_MARK, meter.report.trapped_bytes)


def report(plan, coordinator, rank: int, step: int, index: int, rec: MicrobatchRecord) -> Optional[dict]:
    """The microbatch's peak against its plan's prediction (``RankPlanner.observe``: allocated bytes,
    the plan's own), then ``budget_peak`` (with trapped bytes) to the coordinator, whose directive
    the rank obeys (None without a coordinator)."""
    if rec.predicted_bytes:
        plan.observe(rec.predicted_bytes, rec.peak_bytes)
    if coordinator is None:
        return None
    predicted = rec.resident + rec.predicted_bytes if rec.predicted_bytes else 0
    d = call(coordinator.report, rank, step, index, rec.budget_peak, rec.counts, rec.tokens, predicted, plan.budget)
    if d["action"] == "tighten":
        plan.tighten(d["by_bytes"], f" rank {rank}", tokens=rec.tokens)
    return d


def out_of_memory(plan, coordinator, rank: int, step: int, index: int, tokens: int) -> int:
    """A microbatch ran out of memory before its backward: the rank's plan for that size gives
    up half of what it stores (``RankPlanner.tighten``), the coordinator records it, and the caller
    reruns the microbatch all-R (``run_microbatch(all_r=True)``). Returns the bytes given up."""
    sp = plan.for_tokens(tokens) if plan.planner is not None else None
    by = int(plan.planner.planned_bytes(sp) // 2) if sp is not None else 0
    if by > 0:
        plan.tighten(by, f" rank {rank} (out of memory)", tokens=tokens)
    if coordinator is not None:
        call(coordinator.out_of_memory, rank, step, index, tokens, by)
    return by
