"""A learner rank's budget and plan: plan first, on the bare model, act online after.

Shared by every learner integration (the training job's ``train/learner.py``, the OpenRLHF
policy actor ``openrlhf/policy_actor.py``). ``plan_before_wrapping`` runs on the bare model, before
``deepspeed.initialize``: ZeRO's gradient hooks and parameter gathers need every rank in
lockstep, and planning runs a data-dependent number of extra passes. Synthetic GRPO
microbatches as large as the job can make (``workloads.replayed_microbatches``) give:

1. the peak of gradient checkpointing as users run it (HF gc, full logits) -> B when the
   budget is a ratio (``allocation.budget``);
2. for modes with L: the calibration (Eq. 10 of docs/DESIGN.md), or a saved one;
3. the validated plan (``allocation.planner.Planner.prepare``).

Every one of these passes after gc's reference stays within B, so a device sized for B and for gc's
own pass can plan (gc's pass is what a ratio budget is a ratio of; B may be below it, down to the
all-R peak, where gc's full float32 logits set gc's peak; profiling measures what would not fit on
prefixes of the microbatch; the exact reference is all-R; a fit grows its candidates by half the gap
its measured real/predicted ratio leaves, ``allocation.fitting``, because that ratio grows with the
plan: a full step to the predicted size can overshoot B). A pass can still overshoot: a fit's
first candidate, whose ratio no earlier pass measured, or a grown one whose real bytes grew faster
than ``1 / fitting.GROWTH`` per predicted byte (docs/planning.md). The runner measures each pass;
``info["plan_peak_over_budget"]`` is the highest after gc's over B and ``info["plan_peak_phase"]``
the phase it ran in (calibration, profiling, fit at a risk scale, validation; gc under the gc and
none backends).

A shorter microbatch gets the plan re-solved for its own tokens (``RankPlanner.for_tokens``).
Online, ``RankPlanner.actions`` turns a microbatch's omega into actions (Eq. 7 -> Eq. 13), and
``RankPlanner.observe`` sizes later plans by each microbatch's measured peak against its
prediction, and ``RankPlanner.tighten`` answers the budget coordinator's ``tighten`` directive.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

import torch

from ..recovery.labels import PLANS, action_for_plan, split_label

SIZE_BUCKET = 16  # tokens: microbatches within one bucket share a sized plan (sized for its top)
PEAK_WINDOW = 4  # observed microbatches whose largest real-to-predicted peak ratio sizes the plans


class RankPlanner:
    """One rank's budget B, its ``allocation.Planner`` and the plan at the planning size (a
    ``ShapePlan``, ``sp``), with the plans sized from it per microbatch. ``planner`` and ``sp``
    are None for the ``gc`` and ``none`` backends, which only report peaks. ``sized_plans``:
    re-solve the plan for each microbatch's own token count (``for_tokens``); off, every
    microbatch uses the planning-size plan. Names as in docs/DESIGN.md's glossary: B
    (``budget``), the resident bytes B counts (``resident_bytes``), the room (B less them:
    ``Planner.room``), a plan's memory budget above its all-R peak (``ShapePlan.memory_budget``)."""

    sized_plans = True

    def __init__(self, budget: int, info: Dict, planner=None, sp=None, log: Callable[[str], None] = print):
        self.budget, self.info, self.planner, self.sp, self.log = int(budget), info, planner, sp, log
        self._sized: Dict[int, object] = {}  # token bucket -> plan sized to it

    @property
    def scope(self) -> str:
        return self.info["budget_scope"]

    @property
    def resident_bytes(self) -> int:
        """Resident bytes B counts besides a microbatch's own (0 in the activation scope)."""
        return int(self.info.get("resident_bytes", 0)) if self.scope == "device" else 0

    def rebase(self, resident: int) -> bool:
        """Device scope, once DeepSpeed is built: the measured resident bytes replace the
        planning estimate when they are larger (never smaller: an optimizer may allocate its
        state at its first step, after this measurement); a ratio budget moves with them
        (B = ratio x (gc + resident)); the room B - resident, the plan's memory budget and the
        plan follow. True when B changed."""
        if self.scope != "device":
            return False
        resident = max(int(resident), self.resident_bytes)
        old_budget, old_room = self.budget, self.budget - self.resident_bytes
        kind, value = ("bytes", self.budget)
        if str(self.info.get("budget_spec", "")).strip().lower() not in ("", "auto"):
            from ..allocation.budget import parse_budget

            kind, value = parse_budget(self.info["budget_spec"])
        if kind == "ratio":
            self.budget = int(value * (self.info["gc_peak_bytes"] + resident))
        self.info.update(
            budget_bytes=self.budget, resident_estimate_bytes=self.resident_bytes, resident_bytes=int(resident)
        )
        grown = (self.budget - resident) - old_room  # how much the room moved
        if self.planner is not None and abs(grown) > 0.005 * max(old_room, 1):
            self.planner.room += grown
            self.sp.memory_budget = max(0.0, self.sp.memory_budget + grown)
            self.planner.replan(self.sp)
            self._sized.clear()
        self.log(
            f"[hilore] resident bytes measured {resident / 2**20:.1f} MiB (estimated "
            f"{self.info['resident_estimate_bytes'] / 2**20:.1f}); B = {self.budget / 2**20:.1f} MiB, "
            f"a microbatch may allocate {(self.budget - resident) / 2**20:.1f} MiB"
        )
        return self.budget != old_budget

    @property
    def track_tokens(self) -> bool:
        return self.planner is not None and self.planner.mode == "hilore"

    @property
    def fill(self) -> float:
        return float(self.info.get("fill", 0.0))

    @property
    def peak_ratio(self) -> Optional[float]:
        """The largest measured/predicted in-microbatch peak of the last ``PEAK_WINDOW``
        microbatches (None before any, or with ``fill`` 0)."""
        ratios = self.info.get("peak_ratios")
        return max(ratios) if ratios and self.fill > 0 else None

    def observe(self, predicted_bytes: int, peak_bytes: int) -> None:
        """A microbatch's measured in-microbatch peak against the peak its plan predicted.
        Planned unit bytes come from synthetic microbatches and token scaling, so they miss
        by a few percent either way; later plans are sized so that the prediction times the
        largest recent ratio meets ``fill`` x B (``for_tokens``)."""
        if self.planner is None or predicted_bytes <= 0 or self.fill <= 0:
            return
        ratios = self.info.setdefault("peak_ratios", [])
        ratios.append(peak_bytes / predicted_bytes)
        del ratios[:-PEAK_WINDOW]
        self._sized.clear()

    def for_tokens(self, tokens: int):
        """The plan for a microbatch of ``tokens`` tokens, per 16-token bucket (sized for its
        top). Before any peak is observed: the validated plan at the planning size (the
        largest the job makes), else one re-solved for the microbatch's own size with the
        planning fit's correction (``Planner.sized``), so a short microbatch stores more. Once
        peaks are observed: re-solved so that its predicted peak times ``peak_ratio`` is
        ``fill`` x B (in B's scope; less what ``tighten`` took), at every size."""
        if self.planner is None:
            return None
        bucket = min(-(-int(tokens) // SIZE_BUCKET) * SIZE_BUCKET, self.sp.costs.tokens)
        ratio = self.peak_ratio
        if ratio is None and (bucket >= self.sp.costs.tokens or not self.sized_plans):
            return self.sp
        if bucket not in self._sized:
            target = None
            if ratio is not None:  # the in-microbatch peak that puts the scope's peak at fill x B
                room, tightened = self.planner.room, self.info.get("tightened_bytes", 0)
                target = (room - (1.0 - self.fill) * self.budget - tightened) / ratio
            self._sized[bucket] = self.planner.sized(self.sp, bucket, peak_target=target)
        return self._sized[bucket]

    def predicted_peak(self, sp) -> int:
        """The in-microbatch peak ``sp`` was sized for: its all-R peak plus the planned bytes
        of what it stores (before the correction its fit measured, ``Planner._fit``)."""
        return int(sp.costs.base_peak + self.planner.planned_bytes(sp))

    def actions(self, step, loss_output, sp=None) -> Dict[str, str]:
        """Online actions for a microbatch run under ``sp`` (default: the planning-size plan)."""
        sp = sp or self.sp
        chooser = self.planner.chooser_for(sp)
        if chooser is not None:
            return chooser(step, loss_output)
        return {n: action_for_plan(q) for n, q in sp.plan.items()}

    def _headroom_ratio(self, tokens: Optional[int]) -> float:
        """Planning-size plan bytes per byte of the plan sized to ``tokens`` (sized plans take
        the same share of their own headroom above their all-R peak, ``Planner.sized``)."""
        sp_t = self.for_tokens(tokens) if tokens else self.sp
        head, head_t = self.planner.room - self.sp.costs.base_peak, self.planner.room - sp_t.costs.base_peak
        return head / head_t if head > 0 and head_t > 0 else 1.0

    def _set_memory_budget(self, value: float) -> None:
        self.sp.memory_budget = max(0.0, float(value))
        self.planner.replan(self.sp)
        self._sized.clear()  # re-solved from the planning-size plan when next used

    def tighten(self, by_bytes: int, who: str = "", tokens: Optional[int] = None) -> None:
        """The coordinator's ``tighten``: the plan of the microbatch's size loses ``by_bytes``
        (the planning-size plan its share of them; every size follows) and re-plans. Once
        plans are sized by observed peaks, their target peak loses ``by_bytes`` for good."""
        if self.planner is None:
            return
        if self.peak_ratio is not None:  # sized by observed peaks: aim that much lower from now on
            self.info["tightened_bytes"] = int(self.info.get("tightened_bytes", 0)) + int(by_bytes)
            self._sized.clear()
        else:
            self._set_memory_budget(self.sp.memory_budget - by_bytes * self._headroom_ratio(tokens))
        self.log(f"[hilore{who}] over budget: memory budget tightened by {by_bytes / 2**20:.1f} MiB, re-planned")

    @property
    def calibration_pending(self) -> bool:
        return self.info.get("calibration") == "pending"

    def adopt_calibration(self, calibrations: Dict, runner, dev_microbatch, hcfg) -> None:
        """Leave the first step's H/R plan for the wanted mode, now that L's risk is
        calibrated (on the job's real rollouts): re-fit and validate the plan at the planning
        size on ``runner`` (outside DeepSpeed's gradient path); unit costs are reused."""
        self.planner = _planner(
            runner, self.planner.room, calibrations, hcfg, self.log, costs_cache=self.planner.costs_cache
        )
        self.sp = self.planner.prepare([dev_microbatch], accumulate=1)
        self._sized.clear()
        self.info.pop("peak_ratios", None)  # a new fitted plan: earlier peaks measured another one
        self.info.update(
            calibration="job",
            plan=plan_counts(self.sp.plan),
            plan_report=self.sp.report,
            plan_why=self.planner.explain(self.sp),
        )

    def state(self) -> Dict:
        """JSON-ready, for checkpoints: a resumed rank keeps its budget and plan."""
        out = {"budget": self.budget, "info": self.info}
        if self.planner is not None:
            out.update(
                plan=self.sp.to_dict(),
                calibrations={a: asdict(c) for a, c in self.planner.calibrations.items()},
            )
        return out


def plan_counts(plan: Dict[str, str]) -> Dict[str, int]:
    """How many units a plan keeps in each representation (a named codec counts as compressed)."""
    return {q: sum(split_label(v)[0] == q for v in plan.values()) for q in PLANS}


def make_engine(model, hcfg):
    """A recovery engine with the codec ``--hilore.codec`` names first (``recovery.labels.codec_levels``);
    with ``--hilore.compile`` the units' forwards compiled (``recovery.compiled``: in place, so
    the planning engine and the training engine of one model run the same compiled code)."""
    from ..recovery import RecoveryEngine
    from ..recovery.labels import codec_levels

    engine = RecoveryEngine(model, codec=codec_levels(hcfg.codec)[0])
    if hcfg.compile:
        from ..recovery.compiled import compile_units

        compile_units(
            engine, activation_budget=hcfg.compile_activation_budget, layer_regions=hcfg.compile_layer_regions
        )
    return engine


def _planner(runner, room: int, calibration, hcfg, log, costs_cache=None):
    """The planner within ``room`` (B less the resident bytes) in the wanted mode, or H/R only
    (``hilore-hr``) while L's calibration is pending; its config from the ``--hilore.*``
    settings (``settings.planner_config``)."""
    from ..allocation import Planner
    from .settings import planner_config

    mode = hcfg.mode if calibration is not None else "hilore-hr"
    return Planner(runner, room, calibration, planner_config(hcfg, mode=mode), costs_cache=costs_cache, log=log)


def planning_microbatches(
    model, n: int, *, tokens: int, seqs_per_microbatch: int, group_size: int, seed: int, loss_options: Dict, device
):
    """The synthetic GRPO microbatches planning runs on: as large as the job can make."""
    from ..workloads import replayed_microbatches

    dev = replayed_microbatches(
        model,
        n,
        tokens,
        group_size=group_size,
        mean_len=max(8, tokens // seqs_per_microbatch),
        seed=seed,
        loss_options=loss_options,
    )
    return [mb.to(device) for mb in dev]


def restore_rank_planner(model, state: Dict, hcfg, loss_fn, backend: str, log=print) -> RankPlanner:
    from ..allocation import Runner, ShapePlan
    from ..allocation.calibration import Calibration

    if backend != "hilore":
        return RankPlanner(state["budget"], state["info"], log=log)
    cal = {a: Calibration(**v) for a, v in state["calibrations"].items()} or None
    runner = Runner(model, make_engine(model, hcfg), loss_fn=loss_fn)
    plan = RankPlanner(state["budget"], state["info"], None, ShapePlan.from_dict(state["plan"]), log)
    plan.planner = _planner(runner, plan.budget - plan.resident_bytes, cal, hcfg, log)
    runner.engine.detach()
    return plan


def plan_before_wrapping(
    model,
    hcfg,
    *,
    backend: str,
    tokens: int,
    seqs_per_microbatch: int,
    group_size: int,
    loss_options: Dict,
    loss_fn,
    std_loss_fn,
    device,
    seed: int,
    resident: Optional[int] = None,
    write_calibration: bool = True,
    calibrate_later: bool = False,
    runner_cls=None,
    backward=None,
    progress=None,
    log=print,
) -> RankPlanner:
    """See the module docstring. ``hcfg``: the ``--hilore.*`` settings (``learner/settings.py``);
    ``resident``: the bytes the rank will hold between microbatches (``scope.estimate_resident``
    for its DeepSpeed setup), which the device scope counts; None: one rank with a plain AdamW.
    ``calibrate_later``: a mode with L and no saved calibration plans H/R
    (``info["calibration"] == "pending"``) until the job calibrates on its real rollouts
    (``RankPlanner.adopt_calibration``); else calibration runs here on synthetic microbatches.
    ``info["plan_peak_over_budget"]``: the highest planning pass after gc's reference, in B's
    scope, over B (``info["gc_peak_over_budget"]``: gc's, above 1 where B is below gc's peak).
    ``runner_cls``: ``lockstep.Leader`` when other ranks replay the passes
    (``plan_in_lockstep``); calibration then runs on this rank alone. ``backward``: the runner's
    (``Runner``), e.g. outside ZeRO-3's gradient path on a wrapped model
    (``openrlhf/policy_actor.py``). ``progress``: told of each phase and pass (``Runner.progress``);
    ``info["plan_phases"]``: passes and seconds per phase."""
    from ..allocation import Runner

    from ..allocation.budget import BudgetError, RoomBelowAllR, below_minimum

    runner_cls = runner_cls or Runner

    t0 = time.perf_counter()
    saved, wants_l = _calibration_wanted(hcfg, backend)
    n_cal = _planning_count(hcfg, backend, calibrate_later) - 1
    dev = planning_microbatches(
        model,
        1 + n_cal,
        tokens=tokens,
        seqs_per_microbatch=seqs_per_microbatch,
        group_size=group_size,
        seed=seed,
        loss_options=loss_options,
        device=device,
    )
    runner = runner_cls(model, make_engine(model, hcfg), loss_fn=loss_fn, backward=backward)
    runner.progress = progress
    if resident is None:
        from .scope import estimate_resident

        dtype = next(model.parameters()).dtype
        resident = estimate_resident(model, world=1, zero_stage=0, mixed_precision=dtype != torch.float32)
    counted = int(resident) if hcfg.budget_scope == "device" else 0  # the resident bytes B counts
    with runner.watching() as peaks:  # every planning pass, measured (plan_peak_over_budget)
        with runner.phase("gc", total=1):
            gc_peak = runner.run(dev[0], "gc", measure_peak=True, loss_fn=std_loss_fn).peak_bytes
        budget = _budget(hcfg, gc_peak, int(resident), counted, device, log, backend)
        # B below gc's: is it above HiLoRe's all-R peak? Checked here only when L's calibration passes (minutes)
        # come first; otherwise profiling's own all-R pass finds it moments later (``RoomBelowAllR`` below)
        if backend == "hilore" and n_cal and budget < gc_peak + counted:
            with runner.phase("all-R", total=1):
                all_r = runner.run(dev[0], "all-r", measure_peak=True).peak_bytes
            if budget < counted + all_r:
                raise BudgetError(below_minimum(budget, counted + all_r, gc_peak + counted))
        room = budget - counted
        info = {
            "plan_tokens": tokens,
            "gc_peak_bytes": gc_peak,
            "budget_bytes": budget,
            "budget_spec": str(hcfg.budget),
            "budget_scope": hcfg.budget_scope,
            "resident_bytes": counted,
            "fill": float(hcfg.fill),
        }
        planner = sp = None
        if backend == "hilore":
            with runner.phase("calibration"):
                cal = (
                    _calibration(runner, dev[1:], hcfg, write_calibration, log, room, shared=runner_cls is Runner)
                    if (saved or n_cal)
                    else None
                )
            info["calibration"] = (
                None if not wants_l else "pending" if cal is None else "file" if saved else "synthetic"
            )
            planner = _planner(runner, room, cal, hcfg, log)
            try:
                sp = planner.prepare(dev[:1], accumulate=1)
            except RoomBelowAllR as e:  # B's floor: the all-R peak profiling measured
                raise BudgetError(below_minimum(budget, e.need + counted, gc_peak + counted)) from None
            info.update(plan=plan_counts(sp.plan), plan_report=sp.report, plan_why=planner.explain(sp))
    runner.engine.detach()
    for p in model.parameters():  # no planning gradient may reach the first real update (ZeRO adds .grad in)
        p.grad = None
    # planning's own passes: gc's reference measures what B is a ratio of, and may exceed a B below gc's peak
    own = [i for i, phase in enumerate(runner.watch_phases) if phase != "gc"] or list(range(len(peaks)))
    top = max(own, key=peaks.__getitem__)
    info.update(
        gc_peak_over_budget=(counted + gc_peak) / budget,
        plan_seconds=time.perf_counter() - t0,
        plan_peak_bytes=counted + peaks[top],
        plan_peak_over_budget=(counted + peaks[top]) / budget,
        plan_peak_phase=runner.watch_phases[top],
        plan_phases={k: dict(v) for k, v in runner.phase_stats.items()},
    )
    return RankPlanner(budget, info, planner, sp, log)


def _calibration_wanted(hcfg, backend: str) -> Tuple[bool, bool]:
    """(a saved calibration file exists, the mode uses L)."""
    return bool(hcfg.calibration and Path(hcfg.calibration).is_file()), backend == "hilore" and hcfg.mode != "hilore-hr"


def _planning_count(hcfg, backend: str, calibrate_later: bool) -> int:
    """How many synthetic microbatches planning makes: one, plus L's calibration set."""
    saved, wants_l = _calibration_wanted(hcfg, backend)
    return 1 + (hcfg.calibration_batches if wants_l and not saved and not calibrate_later else 0)


def plan_in_lockstep(model, hcfg, *, backend: str, loss_fn, log=print, **kw) -> RankPlanner:
    """``plan_before_wrapping`` for a model whose passes are collectives (FSDP, ZeRO-3): rank 0 plans,
    the others replay its passes and adopt its plan (``lockstep.py``). One rank: plain. Every
    rank makes the synthetic microbatches (their old log-probs are forward passes too)."""
    from ..allocation import Runner
    from .lockstep import Leader, finish, follow

    if _world() == 1:
        return plan_before_wrapping(model, hcfg, backend=backend, loss_fn=loss_fn, log=log, **kw)
    rank = torch.distributed.get_rank()
    count = [_planning_count(hcfg, backend, kw.get("calibrate_later", False)) if rank == 0 else None]
    torch.distributed.broadcast_object_list(count, src=0)  # rank 0's (a saved calibration only it may see)
    if rank == 0:
        plan = plan_before_wrapping(model, hcfg, backend=backend, loss_fn=loss_fn, runner_cls=Leader, log=log, **kw)
        finish(plan.state())
        return plan
    planning_microbatches(
        model,
        count[0],
        **{k: kw[k] for k in ("tokens", "seqs_per_microbatch", "group_size", "seed", "loss_options", "device")},
    )
    runner = Runner(model, make_engine(model, hcfg), loss_fn=loss_fn, backward=kw.get("backward"))
    state = follow(runner)
    runner.engine.detach()
    for p in model.parameters():
        p.grad = None
    return restore_rank_planner(model, state, hcfg, loss_fn, backend, log=log)


def _budget(hcfg, gc_peak: int, resident: int, counted: int, device, log, backend: str = "hilore") -> int:
    """B in its scope: a ratio of gc's peak in that scope (gc's in-microbatch peak, plus the
    resident bytes in the device scope), a size, or ``auto`` (``scope.auto_budget``). ``counted``:
    the resident bytes B counts (``resident`` in the device scope, 0 in the activation scope).
    B's floor: under HiLoRe the all-R peak, which the caller measures where B is below gc's peak;
    under gc and none, gc's peak."""
    from ..allocation import resolve_budget
    from ..allocation.budget import BudgetError, below_minimum
    from .scope import CPU_AUTO_RATIO, auto_budget

    floor = counted + gc_peak if backend != "hilore" else 0  # HiLoRe's (the all-R peak): checked by the caller
    if str(hcfg.budget).strip().lower() != "auto":
        return resolve_budget(hcfg.budget, gc_peak + counted, floor)
    device_bytes = auto_budget(device)
    if device_bytes is None:
        device_bytes = int(CPU_AUTO_RATIO * (gc_peak + resident))
        log(f"[hilore] --hilore.budget auto on CPU (no capacity to read): {CPU_AUTO_RATIO} x gc's device peak")
    budget = device_bytes - (resident - counted)  # the activation scope: what the device leaves a microbatch
    if budget < floor:
        raise BudgetError(
            f"--hilore.budget auto: the device has {device_bytes / 2**20:.0f} MiB for this rank: "
            + below_minimum(budget, floor, gc_peak + counted)
            + "; free memory (a colocated vLLM's share?) or use fewer tokens per microbatch"
        )
    return budget


def _calibration(runner, batches, hcfg, write: bool, log, room: Optional[int] = None, shared: bool = True):
    """L's calibrated risk per L level (``{level: Calibration}``): None for hilore-hr, a saved
    file, or measured on ``batches`` (``shared``: split over the ranks, ``shared_calibration``)."""
    from ..allocation.calibration import calibrate_levels, check_levels, load_levels, save_levels
    from ..recovery.labels import codec_levels

    if hcfg.mode == "hilore-hr":
        return None
    levels = codec_levels(hcfg.codec)[1]
    if hcfg.calibration and Path(hcfg.calibration).is_file():
        cal = load_levels(hcfg.calibration)
        check_levels(cal, hcfg.codec, f"--hilore.calibration {hcfg.calibration}")
        return cal
    log(f"[hilore] calibrating L's risk ({', '.join(levels)}) on {len(batches)} microbatches")
    cal = (
        shared_calibration(runner, batches, levels, room)
        if shared and _world() > 1
        else calibrate_levels(runner, batches, levels, room=room)
    )
    if hcfg.calibration and write:
        save_levels(cal, hcfg.calibration)
    return cal


def _world() -> int:
    return (
        torch.distributed.get_world_size()
        if torch.distributed.is_available() and torch.distributed.is_initialized()
        else 1
    )


def shared_calibration(runner, batches, levels, room: Optional[int] = None) -> Dict:
    """Calibration once for every rank of the process group (before DeepSpeed, where ranks
    plan in lockstep): rank r runs the interventions on ``batches[r::world]``, the samples are
    gathered (``all_gather_object``) and pooled (``calibration.merge``), so every rank adopts
    the same calibration, at 1/world of the cost."""
    from dataclasses import asdict

    from ..allocation.calibration import Calibration, calibrate_levels, merge

    rank, world = torch.distributed.get_rank(), _world()
    share = list(batches)[rank::world]  # empty on ranks beyond the batches: they only receive
    mine = calibrate_levels(runner, share, levels, room=room) if share else {}
    parts = [None] * world
    torch.distributed.all_gather_object(parts, {a: asdict(c) for a, c in mine.items()})
    return {a: merge([Calibration(**p[a]) for p in parts if a in p]) for a in levels}
