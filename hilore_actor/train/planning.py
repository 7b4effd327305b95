"""HiLoRe for a learner rank whose model DeepSpeed will wrap: plan first, act online after.

Shared by the training job's learner (``train/learner.py``) and the OpenRLHF policy actor
(``openrlhf/policy_actor.py``). ``plan_before_wrapping`` runs on the bare model, before
``deepspeed.initialize``: ZeRO's gradient hooks and parameter gathers need every rank in
lockstep, and planning runs a data-dependent number of extra passes. Synthetic GRPO
microbatches as large as the job can make (``workloads.replayed_microbatches``) give:

1. the peak of gradient checkpointing as users run it (HF gc, full logits) -> B when the
   budget is a ratio (``allocation.budget``);
2. for modes with L: the calibration (HILORE.md section 4), or a saved one;
3. the validated plan (``allocation.schedule.HiLoRe.prepare``).

A smaller microbatch uses the same plan: each unit then holds fewer bytes than planned.
Online, ``RankPlan.actions`` turns a microbatch's omega into actions (Eq. 7 -> Eq. 13), and
``RankPlan.tighten`` answers the budget coordinator's ``tighten`` directive.
"""
from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Dict

UNIT_ACTION = {"exact": "H", "compressed": "L", "checkpoint": "R"}


class RankPlan:
    """One rank's budget, HiLoRe scheduler and current plan (``hl``/``sp`` are None for the
    ``gc`` and ``none`` backends, which only report peaks)."""

    def __init__(self, budget: int, info: Dict, hl=None, sp=None, log: Callable[[str], None] = print):
        self.budget, self.info, self.hl, self.sp, self.log = int(budget), info, hl, sp, log

    @property
    def track_tokens(self) -> bool:
        return self.hl is not None and self.hl.mode == "hilore"

    def actions(self, step, loss_output) -> Dict[str, str]:
        chooser = self.hl.chooser_for(self.sp)
        if chooser is not None:
            return chooser(step, loss_output)
        return {n: UNIT_ACTION[q] for n, q in self.sp.plan.items()}

    def tighten(self, by_bytes: int, who: str = "") -> None:
        """Shrink the allocation budget by the coordinator's overshoot and re-plan."""
        if self.hl is None:
            return
        self.sp.memory_budget = max(0.0, self.sp.memory_budget - by_bytes)
        self.hl.replan(self.sp)
        self.log(f"[hilore{who}] over budget: allocation budget tightened by {by_bytes / 2**20:.1f} MiB, re-planned")

    def state(self) -> Dict:
        """JSON-ready, for checkpoints: a resumed rank keeps its budget and plan."""
        out = {"budget": self.budget, "info": self.info}
        if self.hl is not None:
            out.update(plan=self.sp.to_dict(), calibration=asdict(self.hl.calibration) if self.hl.calibration else None)
        return out


def _scheduler(runner, budget: int, calibration, hcfg, log):
    from ..allocation import HiLoRe

    return HiLoRe(runner, budget, calibration, mode=hcfg.mode, delta=hcfg.delta, tolerance=hcfg.tolerance,
                  refresh_every=hcfg.refresh_every, profile_repeats=hcfg.profile_repeats, loo=False, log=log)


def restore_rank_plan(model, state: Dict, hcfg, loss_fn, backend: str, log=print) -> RankPlan:
    from ..allocation import Runner, ShapePlan
    from ..allocation.calibration import Calibration

    if backend != "hilore":
        return RankPlan(state["budget"], state["info"], log=log)
    cal = Calibration(**state["calibration"]) if state.get("calibration") else None
    runner = Runner(model, loss_fn=loss_fn)
    hl = _scheduler(runner, state["budget"], cal, hcfg, log)
    runner.engine.detach()
    return RankPlan(state["budget"], state["info"], hl, ShapePlan.from_dict(state["plan"]), log)


def plan_before_wrapping(model, hcfg, *, backend: str, tokens: int, seqs_per_microbatch: int, group_size: int,
                         loss_options: Dict, loss_fn,
                         std_loss_fn, device, seed: int, write_calibration: bool = True, log=print) -> RankPlan:
    """See the module docstring. ``hcfg``: the ``--hilore.*`` settings (budget, mode, delta,
    tolerance, refresh_every, calibration_batches, calibration, profile_repeats)."""
    from ..allocation import Runner, calibrate, resolve_budget
    from ..allocation.calibration import Calibration
    from ..workloads import replayed_microbatches

    t0 = time.perf_counter()
    n_cal = hcfg.calibration_batches if backend == "hilore" and hcfg.mode != "hilore-hr" else 0
    dev = replayed_microbatches(model, 1 + n_cal, tokens, group_size=group_size, mean_len=max(8, tokens // seqs_per_microbatch),
                                seed=seed, loss_options=loss_options)
    dev = [mb.to(device) for mb in dev]
    runner = Runner(model, loss_fn=loss_fn)
    gc_peak = runner.run(dev[0], "gc", measure_peak=True, loss_fn=std_loss_fn).peak_bytes
    budget = resolve_budget(hcfg.budget, gc_peak, gc_peak)
    info = {"plan_tokens": tokens, "gc_peak_bytes": gc_peak, "budget_bytes": budget}
    if backend != "hilore":
        runner.engine.detach()
        return RankPlan(budget, dict(info, plan_seconds=time.perf_counter() - t0), log=log)
    cal = None
    if hcfg.mode != "hilore-hr":
        if hcfg.calibration and Path(hcfg.calibration).is_file():
            cal = Calibration.load(hcfg.calibration)
        else:
            cal = calibrate(runner, dev[1:])
            if hcfg.calibration and write_calibration:
                cal.save(hcfg.calibration)
    hl = _scheduler(runner, budget, cal, hcfg, log)
    sp = hl.prepare(dev[:1], accumulate=1)
    runner.engine.detach()
    info.update(plan={q: sum(v == q for v in sp.plan.values()) for q in UNIT_ACTION}, plan_report=sp.report,
                plan_seconds=time.perf_counter() - t0)
    return RankPlan(budget, info, hl, sp, log)
