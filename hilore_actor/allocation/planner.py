"""The planner: a pre-forward plan per shape class, validated, and online actions.

Vocabulary as in docs/DESIGN.md's glossary: a *plan* maps each unit to its forward
representation; a ``ShapePlan`` is a shape class's plan with the costs and budgets it was
solved for; the planner works inside the *room* (B less the resident bytes: the
in-microbatch peak a microbatch may reach).

``prepare`` (once per shape class, on development microbatches):
  1. profile utility and memory (Eq. 9) and the all-R base peak;
  2. candidate plans: the knapsack (Eq. 13) with calibration-mean risks at several risk
     budgets (``plan_risk_scales`` x delta; 0 gives H/R only). A larger risk budget captures
     more units compressed, which the online step may send back to R when a microbatch's
     exposure is high;
  3. run every candidate's complete update (plan + online choice) and keep, among those whose
     measured peak is within the room, the one whose actions save the most profiled time (the
     sum of dtau over the units it did not recompute). One timed run cannot rank them: on a
     busy CPU two runs of the same plan differ by 10-15%, more than candidates differ;
  4. validate it: the measured peak on every development microbatch <= the room (else shrink
     the memory budget by the overshoot and re-plan), the accumulated relative gradient error
     over them <= ``tolerance`` (else halve the risk budget), and drop each non-R action that
     made the update slower in every leave-one-out pair (time without it minus time with it
     <= 0 in all of them).
Online (``choose``), per microbatch or every ``refresh_every``: omega -> exposure (Eq. 7) ->
risk psi_u -> knapsack restricted to each unit's planned representation -> actions.
Modes: ``hilore``; ``hilore-hr`` (delta = 0: H/R only); ``hilore-static`` (the plan's own
actions, risk from calibration means, no refresh).
"""

from __future__ import annotations

import contextlib
import statistics
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..recovery.policies import stores_nothing
from ..recovery.labels import (
    CHECKPOINT,
    COMPRESSED,
    EXACT,
    PARTIAL,
    action_for_plan,
    allows,
    plan_for_label,
    row_share,
    split_label,
    with_share,
)
from . import fitting
from .budget import RoomBelowAllR
from .calibration import Calibration
from .exposure import exposures_and_rest
from .knapsack import Option, solve
from .profiling import P_LABELS, UnitCosts, costs_at, option_cost, profile_units, shape_class
from .runner import GradOp

EXACT_SUM, PLAN_SUM = "exact update", "planned update"  # the held sums of validation's gradient check
FP32 = torch.float32  # they add up as the flattened float32 gradients did

MODES = ("hilore", "hilore-hr", "hilore-static")


def _help(text: str) -> Dict[str, str]:
    return {"help": text}


@dataclass
class ShapePlan:
    """A shape class's plan (unit -> forward representation) with the unit costs and the
    budgets it was solved for."""

    shape: str
    costs: UnitCosts
    plan: Dict[str, str]
    memory_budget: float  # bytes above the all-R peak the stored units may add (the knapsack's capacity)
    risk_budget: float  # online, per microbatch (delta)
    plan_risk_budget: float  # what the plan was solved with (scale x delta)
    report: Dict = field(default_factory=dict)

    def to_dict(self) -> Dict:
        """JSON-ready (checkpoints keep the plan, so a resumed run does not re-profile)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Dict) -> "ShapePlan":
        return cls(**dict(d, costs=UnitCosts(**d["costs"])))


class Planner:
    """Plans per shape class within ``room`` bytes and chooses the online actions.

    ``calibration``: L's calibrated risk, or ``{L level: calibration}`` for several L levels
    (action labels: ``"L"`` is the engine's codec, ``"L:bf16"`` another; each level is one more
    option per unit in the knapsack, with its own bytes, time and risk); None for
    ``hilore-hr``. ``config``: ``Planner.Config`` (its defaults when None). ``costs_cache``:
    shape class -> ``UnitCosts``, shared by planners of one model (across budgets)."""

    @dataclass(frozen=True)
    class Config:
        """The planner's settings: the one source of their defaults. The ``--hilore.*`` flags
        of the same names take their defaults and help from here (``learner/settings.py``)."""

        mode: str = field(
            default="hilore",
            metadata=_help("hilore (H/L/R, online), hilore-hr (H/R only: exact gradients) or hilore-static"),
        )
        delta: float = field(
            default=0.015, metadata=_help("risk budget per microbatch (relative gradient error) for L")
        )
        tolerance: float = field(
            default=0.015, metadata=_help("accumulated gradient error the schedule is validated against")
        )
        grid: int = field(default=128, metadata=_help("knapsack grid cells per constraint (memory and risk)"))
        refresh_every: int = field(default=1, metadata=_help("recompute online actions every N microbatches"))
        plan_risk_scales: Tuple[float, ...] = field(
            default=(0.0, 1.0, 2.0, 4.0),
            metadata=_help(
                "candidate plans are solved at these multiples of delta (0: H/R only); hilore-static keeps those "
                "<= 1 (it has no online trimming), hilore-hr 0 alone"
            ),
        )
        profile_repeats: int = field(default=2, metadata=_help("timing repeats when profiling units"))
        loo: bool = field(
            default=True,
            metadata=_help(
                "leave-one-out check of the plan: the four stored units with the least profiled "
                "utility per byte are timed in pairs with and without them and recomputed when they were slower in "
                "every pair (false skips it: faster start-up)"
            ),
        )
        loo_units: int = field(
            default=4, metadata=_help("stored units the leave-one-out check times (least profiled utility per byte)")
        )
        loo_max_spread: float = field(
            default=0.5,
            metadata=_help(
                "a unit's leave-one-out pairs whose differences spread over more than this share of an update's "
                "time measured a stall, not the unit: the unit keeps its profiled choice, said in the log"
            ),
        )
        within_budget: bool = field(
            default=True,
            metadata=_help(
                "no planning pass may peak above the room (profiling measures what would not fit on prefixes, "
                "profiling.probe_bytes; the exact reference is all-R)"
            ),
        )
        first_fit: float = field(
            default=0.9,
            metadata=_help(
                "share of the memory budget the first candidate plan may use (the real peak per predicted byte is "
                "not known before one plan has run)"
            ),
        )
        partial: bool = field(
            default=False,
            metadata=_help(
                "offer P per unit beside H, L and R: keep only the outputs of the unit's matmuls "
                "and attention kernels (P), or of its attention kernel alone (P:core), and replay the rest from "
                "them in backward (exact gradients; torch's selective checkpointing, chosen per unit by the "
                "knapsack); off until benchmarked"
            ),
        )
        token_rows: Tuple[float, ...] = field(
            default=(),
            metadata=_help(
                "token L for MLP units: shares of a unit's token rows that L may keep exact, a "
                "comma list (e.g. 0.1,0.25): the rows of largest norm x |advantage| are kept, the others "
                "compressed, each share one more option per L level for the knapsack (empty: off until "
                "benchmarked; modes with L)"
            ),
        )

    def __init__(
        self,
        runner,
        room: int,
        calibration: Union[Calibration, Dict[str, Calibration], None],
        config: Optional["Planner.Config"] = None,
        *,
        costs_cache: Optional[Dict[str, UnitCosts]] = None,
        log=print,
    ):
        config = config if config is not None else Planner.Config()
        mode = config.mode
        if mode not in MODES:
            raise ValueError(f"unknown planner mode {mode!r}; choose one of {MODES}")
        if mode != "hilore-hr" and calibration is None:
            raise ValueError(f"{mode} needs a calibration (risk of L); hilore-hr does not")
        self.config = config
        self.runner, self.engine = runner, runner.engine
        self.room = int(room)
        self.calibrations: Dict[str, Calibration] = (
            {} if calibration is None else dict(calibration) if isinstance(calibration, dict) else {"L": calibration}
        )
        self.calibration = self.calibrations.get("L") or next(iter(self.calibrations.values()), None)
        self.mode = mode
        self.delta = 0.0 if mode == "hilore-hr" else config.delta
        self.levels = tuple(sorted(self.calibrations, key=lambda a: (a != "L", a))) if self.delta > 0 else ()
        self.partial = bool(config.partial)
        self.kinds = ("H", *(P_LABELS if self.partial else ()), *self.levels)  # the non-R options per unit
        self.shares = tuple(float(f) for f in config.token_rows) if self.levels else ()
        self.token_wise = {n for n, u in self.engine.unit_specs.items() if u.token_wise}
        # static has no online trimming, so its plan may not take more risk than delta
        self.scales = {
            "hilore-hr": (0.0,),
            "hilore-static": tuple(s for s in config.plan_risk_scales if s <= 1.0),
        }.get(mode, tuple(config.plan_risk_scales))
        self.log = log
        self.plans: Dict[str, ShapePlan] = {}
        self.costs_cache = costs_cache if costs_cache is not None else {}  # shape class -> UnitCosts
        self._calls = 0
        self._last: Optional[Dict[str, str]] = None
        self._ratio: Optional[float] = None  # the largest real / predicted bytes a candidate measured (``_fit``)
        self._candidates: List[Dict] = []  # every candidate the current preparation measured
        self._measured: Dict[tuple, tuple] = {}  # plan -> (seconds, peak, actions), this preparation's

    # ---- allocation -----------------------------------------------------------------------
    def options(self, sp_costs: UnitCosts, unit: str, plan: Optional[str], risks: Dict[str, float]) -> List[Option]:
        """R, H and every L level ``plan`` (the unit's representation, None: any) admits."""
        opts = [Option("R", 0.0, 0.0, 0.0)]
        labels = [a for a in self.kinds if a in sp_costs.dm[unit]]
        if unit in self.token_wise:
            labels += [with_share(a, f) for a in self.levels if a in sp_costs.dm[unit] for f in self.shares]
        for a in labels:
            if plan is None or allows(plan, a):
                opts.append(Option(a, *option_cost(sp_costs, unit, a), risks.get(a, 0.0)))
        return opts

    def allocate(
        self,
        costs: UnitCosts,
        risks: Dict[str, Dict[str, float]],
        memory_budget: float,
        risk_budget: float,
        plan: Optional[Dict[str, str]] = None,
    ) -> Dict[str, str]:
        """Eq. 13: an action label per unit. ``risks``: unit -> L level -> risk (Eq. 11). With
        ``plan``, the units of its H layer regions keep H (``recovery.compiled.region_units``):
        they leave the knapsack, which needs a free option (R) per item, and their H bytes leave
        the memory budget (below zero, every other unit R)."""
        from ..recovery.compiled import region_units

        names = self.engine.unit_names
        fixed = region_units(self.engine, plan) if plan else set()
        free = [n for n in names if n not in fixed]
        held = sum(option_cost(costs, n, "H")[1] for n in fixed)
        items = [self.options(costs, n, plan.get(n) if plan else None, risks.get(n, {})) for n in free]
        picks = solve(items, memory_budget - held, risk_budget, self.config.grid, self.config.grid) if items else []
        chosen = {n: items[i][picks[i]].action for i, n in enumerate(free)}
        return {n: chosen.get(n, "H") for n in names}

    def risks(
        self, exposure: Optional[Dict[str, float]] = None, rest: Optional[Dict[str, float]] = None
    ) -> Dict[str, Dict[str, float]]:
        """Eq. 11 per unit and L level: at the microbatch's exposures, else at the
        calibration-mean exposure (``hilore-static``, and plans made before forward). Token L
        (``L@f``): at the exposure of the rows it compressed (``rest``, online), else at
        (1 - f) x the mean (before forward: the kept rows carry at least their share)."""
        names = exposure if exposure is not None else self.engine.unit_names
        out = {}
        for n in names:
            r = {
                a: (cal.risk(n, exposure[n]) if exposure is not None else cal.static_risk(n))
                for a, cal in self.calibrations.items()
                if a in self.levels
            }
            if n in self.token_wise:
                for a in list(r):
                    for f in self.shares:
                        r[with_share(a, f)] = (
                            self.calibrations[a].risk(n, rest[n]) if rest and n in rest else r[a] * (1.0 - f)
                        )
            out[n] = r
        return out

    def static_risks(self) -> Dict[str, Dict[str, float]]:
        return self.risks()

    # ---- preparation ----------------------------------------------------------------------
    def prepare(self, dev: Sequence, accumulate: int = 2) -> ShapePlan:
        """Profile, pick and validate the plan for ``dev``'s shape class (see module doc)."""
        shape = shape_class(dev[0])
        cached = self.costs_cache.get(shape)
        if cached is None or not set(self.kinds) <= set(cached.options):
            with self.runner.phase("profiling"):
                self.costs_cache[shape] = profile_units(
                    self.runner,
                    dev[0],
                    self.config.profile_repeats,
                    room=self.room if self.config.within_budget else None,
                    levels=self.levels,
                    partial=self.partial,
                )
        costs = self.costs_cache[shape]
        headroom = float(self.room - costs.base_peak)
        if headroom < 0:
            raise RoomBelowAllR(self.room, costs.base_peak, shape)
        best, self._ratio, self._candidates, self._measured = None, None, [], {}
        for scale in self.scales:
            with self.runner.phase(f"fit at risk scale {scale}"):
                sp, t, peak, actions = self._fit(
                    ShapePlan(shape, costs, {}, headroom, self.delta, self.delta * scale), dev[0]
                )
            n = _kind_counts(sp)
            rows = sum(row_share(v) is not None for v in sp.plan.values())
            saved = self.saved_seconds(costs, actions)
            self.log(
                f"[hilore] plan at risk scale {scale}: {n[EXACT]} exact, {n[PARTIAL]} partial, "
                f"{n[COMPRESSED]} compressed ({rows} by token rows); "
                f"saves {saved:.3f}s by profile ({t:.3f}s measured), peak {peak / self.room:.3f} B"
            )
            if peak <= self.room and (best is None or saved > best[0]):
                best = (saved, sp, scale)
        if best is None:  # nothing fitted: start from all-R and let validation grow nothing
            best = (
                0.0,
                ShapePlan(shape, costs, {n: CHECKPOINT for n in self.engine.unit_names}, headroom, self.delta, 0.0),
                0.0,
            )
        with self.runner.phase("validation"):
            sp = self._validate(best[1], dev, accumulate)
        sp.report.update(plan_risk_scale=best[2], fit_candidates=self._candidates)
        self.plans[shape] = sp
        return sp

    @staticmethod
    def saved_seconds(costs: UnitCosts, actions: Dict[str, str]) -> float:
        """Profiled recompute time that ``actions`` avoid (Eq. 9's utilities, summed)."""
        return float(sum(option_cost(costs, n, a)[0] for n, a in actions.items() if a != "R"))

    def sized(self, sp: ShapePlan, tokens: int, peak_target: Optional[float] = None) -> ShapePlan:
        """``sp`` re-solved for a microbatch of ``tokens`` tokens (at most as many as it was
        planned for): its costs scaled (``profiling.costs_at``) and its memory budget the room
        left above that microbatch's all-R peak, times the real-to-predicted correction ``sp``
        measured when it was fitted (and any tightening since); with ``peak_target``, the
        room up to that predicted peak instead. Units the leave-one-out check sent to R stay
        R. Milliseconds: the knapsack only, no pass."""
        costs = costs_at(sp.costs, tokens)
        if peak_target is None:
            headroom = self.room - sp.costs.base_peak
            factor = sp.memory_budget / headroom if headroom > 0 else 0.0
            memory = (self.room - costs.base_peak) * factor
        else:
            memory = min(peak_target, self.room) - costs.base_peak
        out = ShapePlan(
            costs.shape,
            costs,
            {},
            max(0.0, memory),
            sp.risk_budget,
            sp.plan_risk_budget,
            report={"sized_from_tokens": sp.costs.tokens, "loo_recomputed": list(sp.report.get("loo_recomputed", []))},
        )
        self.replan(out)
        return out

    def replan(self, sp: ShapePlan) -> None:
        """Re-solve ``sp``'s plan for its current budgets; units the leave-one-out check sent
        to R stay R."""
        dropped = set(sp.report.get("loo_recomputed", []))
        limits = {n: CHECKPOINT for n in dropped} if dropped else None  # the others: any option
        actions = self.allocate(sp.costs, self.static_risks(), sp.memory_budget, sp.plan_risk_budget, plan=limits)
        sp.plan = {n: plan_for_label(a) for n, a in actions.items()}

    def _fit(self, sp: ShapePlan, mb, attempts: int = 5):
        """Plan, measure the real peak, and resize the memory budget by the measured ratio of
        real to predicted peak increase (allocator and transient effects that per-unit
        accounting cannot see; shared storages that it counts twice), down when the plan
        overshoots B, up by half the gap when it leaves room (``fitting``: every candidate
        is a planning pass, so it is sized cautiously); keep the largest plan that fits."""
        base = sp.costs.base_peak
        headroom = self.room - base
        best = None
        sp.memory_budget = fitting.first_candidate(sp.memory_budget, self.config.first_fit, self._ratio)
        for _ in range(attempts):
            self.replan(sp)
            key = tuple(sorted(sp.plan.items()))  # fits at larger risk scales often re-find a plan
            seen = key in self._measured
            if not seen:
                self._measured[key] = self._measure(sp, [mb])
            t, peak, actions = self._measured[key]
            fits = peak <= self.room
            if fits and (best is None or sp.memory_budget > best[0].memory_budget):
                best = (
                    ShapePlan(sp.shape, sp.costs, dict(sp.plan), sp.memory_budget, sp.risk_budget, sp.plan_risk_budget),
                    t,
                    peak,
                    actions,
                )
            predicted = self.planned_bytes(sp)
            ratio = max(peak - base, 1) / predicted if predicted else None  # real bytes per predicted byte
            if not seen:
                self._candidates.append(
                    fitting.record(
                        _kind_counts(sp),
                        sp.memory_budget,
                        predicted,
                        peak / self.room,
                        ratio,
                        sp.plan_risk_budget / (self.delta or 1.0),
                    )
                )
                self.log(fitting.describe(self._candidates[-1]))
            if predicted == 0 or (fits and sp.memory_budget >= self.costs_total(sp.costs)):
                break
            self._ratio = max(self._ratio or 0.0, ratio)  # the next fit's first candidate starts from the largest
            nxt = fitting.next_candidate(headroom, sp.memory_budget, ratio, fits)
            if nxt is None:
                break
            sp.memory_budget = nxt
        if best is None:
            return sp, t, peak, actions
        return best

    @staticmethod
    def planned_bytes(sp: ShapePlan) -> int:
        """The bytes ``sp``'s plan stores above its all-R peak, by its profiled costs."""
        return int(sum(option_cost(sp.costs, n, action_for_plan(q))[1] for n, q in sp.plan.items() if q != CHECKPOINT))

    @staticmethod
    def costs_total(costs: UnitCosts) -> float:
        return float(sum(v["H"] for v in costs.dm.values()))

    def _measure(self, sp: ShapePlan, batches, repeats: int = 1):
        """Median time, the peak over ``batches``, and the action labels of the last run (L
        with its codec when named, so ``saved_seconds`` credits the level that ran)."""
        times, peak = [], 0
        for mb in batches:
            for _ in range(repeats):
                times.append(self._run(sp, mb, timed=True).seconds)
            res = self._run(sp, mb, measure_peak=True)
            peak = max(peak, res.peak_bytes)
        return statistics.median(times), peak, res.labels or res.actions

    def _validate(self, sp: ShapePlan, dev, accumulate: int) -> ShapePlan:
        for _ in range(6):
            peak = max(self._run(sp, mb, measure_peak=True).peak_bytes for mb in dev)
            err = self.accumulated_error(sp, dev, accumulate)
            sp.report.update(peak_over_budget=peak / self.room, grad_err=err)
            if peak <= self.room and err <= self.config.tolerance:
                break
            self.log(f"[hilore] validation: peak {peak / self.room:.3f} B, gradient error {err:.4f}; re-planning")
            if peak > self.room:
                sp.memory_budget = max(0.0, sp.memory_budget - (peak - self.room) * 1.05)
            if err > self.config.tolerance:
                sp.risk_budget /= 2
                sp.plan_risk_budget /= 2
            self.replan(sp)
        else:
            raise RuntimeError(f"hilore: could not validate a plan within the room and tolerance: {sp.report}")
        if self.config.loo:
            self._drop_useless(sp, dev[0])
        return sp

    def loo_passes(self, sp: ShapePlan, repeats: int = 3) -> int:
        """The passes ``_drop_useless`` runs on ``sp``: per checked unit, ``repeats`` timed pairs
        and, while planning is measured, one measured pass."""
        checked = min(self.config.loo_units, sum(q != CHECKPOINT for q in sp.plan.values()))
        return checked * (2 * repeats + (self.runner.watch is not None))

    def accumulated_error(self, sp: ShapePlan, dev, accumulate: int) -> float:
        """Relative error of the gradient summed over each ``accumulate`` microbatches (an
        update), against exact gradients on the same inputs; the worst update. The exact
        reference is all-R: bitwise equal to all-H (tests/recovery/test_engine.py), within B.

        No flattened copy (``runner.GradOp``): the exact pass keeps its gradient (one set, as
        backward made it), and the plan's pass compares its own with it parameter by parameter
        as backward produces each, in float64. An update of several microbatches sums both in
        float32 (as the flattened gradients did) and builds the plan's sum beside the exact
        one: then in two rounds over halves of the parameters (twice the passes), so that one
        set is held in all."""
        worst = 0.0
        for i in range(0, len(dev), accumulate):
            group = dev[i : i + accumulate]
            rounds = 1 if len(group) == 1 else 2
            dtype = FP32 if len(group) > 1 else None  # one gradient: kept as backward made it (same numbers)
            total = [0.0] * 4
            for r in range(rounds):
                part = (r, rounds)
                for j, mb in enumerate(group):
                    op = GradOp(add=EXACT_SUM, part=part, dtype=dtype, restart=j == 0)
                    self.runner.run(mb, "all-r", grad_op=op, seed=j)
                # each round sees the online chooser as the first did; the last leaves it as one update would
                with self.side_pass() if r < rounds - 1 else contextlib.nullcontext():
                    for j, mb in enumerate(group):
                        last = j == len(group) - 1
                        op = GradOp(
                            add=PLAN_SUM,
                            compare=EXACT_SUM if last else None,
                            drop=(EXACT_SUM,) if last else (),
                            part=part,
                            dtype=dtype,
                            restart=j == 0,
                        )
                        res = self._run(sp, mb, grad_op=op, seed=j)
                total = [t + v for t, v in zip(total, res.grad_sums)]
            diff, _, _, exact = total
            worst = max(worst, diff**0.5 / max(exact**0.5, 1e-30))
        return worst

    def _drop_useless(self, sp: ShapePlan, mb, repeats: int = 3) -> None:
        """Leave-one-out: each checked unit's paired utility (time without it minus time with
        it, ``repeats`` interleaved pairs of whole updates); <= 0 in every pair sends it to R.

        Every pair, not the median: the profile already measured the unit's saving, and this
        check is there to catch a unit that costs time when stored (e.g. its codec is slower
        than its replay), not to re-estimate a saving of 1-3% of an update that a busy CPU's
        10-15% run-to-run noise cannot resolve in three pairs. With the median, a unit whose
        saving is small beside the noise went to R about half the time (a cpu-small sweep:
        18 units recomputed on medians of -1.8 to -33 ms on 0.6-1.4 s updates); a unit with no
        effect at all now goes to R with probability 1/8. Pairs whose differences spread over more
        than ``Config.loo_max_spread`` of an update (a loaded machine once gave -163 s on 1 s
        updates) measured the machine, not the unit: no decision is taken from them.
        Checking every stored unit costs 2 x repeats updates each (30 minutes for the CPU
        demo's 27 units), so only the ``Config.loo_units`` stored units with the least profiled
        utility per byte are checked: those are where a measured utility of zero is likely."""
        with self.runner.phase("leave-one-out", total=self.loo_passes(sp, repeats)):
            self._drop_units(sp, mb, repeats)

    def _drop_units(self, sp: ShapePlan, mb, repeats: int) -> None:
        stored = [n for n, q in sp.plan.items() if q != CHECKPOINT]
        label = {n: action_for_plan(sp.plan[n]) for n in stored}

        def per_byte(n: str) -> float:
            dt, dm = option_cost(sp.costs, n, label[n])
            return dt / max(dm, 1)

        stored.sort(key=per_byte)
        for n in stored[: self.config.loo_units]:
            without = dict(sp.plan, **{n: CHECKPOINT})
            diffs = []
            alt = ShapePlan(sp.shape, sp.costs, without, sp.memory_budget, sp.risk_budget, sp.plan_risk_budget)
            if self.runner.watch is not None:
                self._run(alt, mb)  # measured once (planning's peak), not timed
            updates = []
            for _ in range(repeats):  # paired: with, without, interleaved
                pair = (self._run(alt, mb, timed=True).seconds, self._run(sp, mb, timed=True).seconds)
                diffs.append(pair[0] - pair[1])
                updates += pair
            ms = ", ".join(f"{d * 1e3:.1f}" for d in diffs)
            update = statistics.median(updates)
            if max(diffs) - min(diffs) > self.config.loo_max_spread * update:
                sp.report.setdefault("loo_noisy", []).append(n)
                self.log(
                    f"[hilore] leave-one-out: {n}'s pairs spread over {(max(diffs) - min(diffs)) * 1e3:.1f} ms on "
                    f"{update * 1e3:.1f} ms updates ({ms} ms), more than a unit can change (the machine stalled): "
                    "it keeps its profiled choice"
                )
            elif max(diffs) <= 0:
                sp.plan[n] = CHECKPOINT
                sp.report.setdefault("loo_recomputed", []).append(n)
                self.log(f"[hilore] leave-one-out: {n} saved no time in any pair ({ms} ms); recompute it")
            else:
                self.log(f"[hilore] leave-one-out: {n} kept (paired savings {ms} ms)")

    def explain(self, sp: ShapePlan) -> str:
        """One line: what ``sp``'s plan does with each unit, and why (Eq. 13's knapsack in B's room)."""
        n = _kind_counts(sp)
        above = max(0, self.room - sp.costs.base_peak)
        codec = f" ({self.engine.codec.name})" if n[COMPRESSED] else ""
        why = (
            f"B leaves {above / 2**20:.2f} MiB above the all-R peak; the knapsack fills it with the units that save "
            "the most recompute time per byte"
        )
        if self.levels:
            why += f", a low-precision copy (L) where it costs less room and the step's risk stays within {self.delta}"
        return (
            f"{n[EXACT]} H, {n[PARTIAL]} P, {n[COMPRESSED]} L{codec}, "
            f"{len(sp.plan) - sum(n.values())} R of {len(sp.plan)} units: {why}; the rest are recomputed (R)"
        )

    # ---- online -------------------------------------------------------------------------------
    def plan_for(self, mb) -> ShapePlan:
        """The plan of ``mb``'s shape class; a new shape class is profiled and planned on the
        spot, with ``mb`` as its development microbatch."""
        shape = shape_class(mb)
        if shape not in self.plans:
            self.log(f"[hilore] new shape class {shape}: profiling and planning")
            self.prepare([mb])
        return self.plans[shape]

    def chooser_for(self, sp: ShapePlan):
        """The online action chooser ``(step, loss_output) -> actions`` of a plan, or None
        when the plan's own actions apply (hilore-hr, hilore-static)."""
        if self.mode != "hilore":
            return None  # the plan's own actions (H for exact, L for compressed, R)

        def choose(step, out) -> Dict[str, str]:
            self._calls += 1
            if self._last is not None and (self._calls - 1) % self.config.refresh_every:
                return {n: a if allows(sp.plan[n], a) else "R" for n, a in self._last.items()}
            norms = step.token_norms()
            # an integration's step stand-in (OpenRLHF, verl) may carry norms only: then token L's
            # risk is (1 - f) x the unit's (risks)
            kept = getattr(step, "kept_rows", dict)() if self.shares else {}
            kept = {n: k for n, k in kept.items() if n in norms and k.numel() == norms[n].numel()}
            E, rest = exposures_and_rest(out.omega, norms, out.mask, kept)  # one host sync for all units
            self._last = self.allocate(
                sp.costs, self.risks(E, rest or None), sp.memory_budget, sp.risk_budget, plan=sp.plan
            )
            return self._last

        return choose

    def online_state(self) -> Dict:
        """The online chooser's state across microbatches (its refresh count and last actions):
        a checkpoint keeps it, so a resumed run refreshes on the microbatches the uninterrupted one does."""
        return {"calls": self._calls, "last": self._last}

    def load_online_state(self, state: Optional[Dict]) -> None:
        """``online_state``'s dict back (None: a fresh chooser)."""
        state = state or {}
        self._calls, self._last = int(state.get("calls", 0)), state.get("last")

    @contextlib.contextmanager
    def side_pass(self):
        """Passes run inside the block beside training (a measurement, not an update) leave
        the online chooser as they found it: its refresh count and last actions."""
        saved = self._calls, self._last
        try:
            yield
        finally:
            self._calls, self._last = saved

    def choose(self, mb, step, loss_output) -> Dict[str, str]:
        """Online actions for a training loop that is not ours: call after the loss, before
        backward, inside ``engine.step(self.plan_for(mb).plan, track_tokens=True)``."""
        sp = self.plan_for(mb)
        chooser = self.chooser_for(sp)
        return chooser(step, loss_output) if chooser else {n: action_for_plan(q) for n, q in sp.plan.items()}

    def _run(self, sp: ShapePlan, mb, **kw):
        if stores_nothing(sp.plan):  # all-R: plain layer checkpointing, without the engine's bookkeeping
            res = self.runner.run(mb, "gc", **{k: v for k, v in kw.items() if k != "track_tokens"})
            res.actions = res.labels = {n: "R" for n in sp.plan}
            return res
        return self.runner.run(
            mb, sp.plan, self.chooser_for(sp), track_tokens=self.mode == "hilore", regions=True, **kw
        )

    def run(self, mb, **kw):
        """One microbatch under the planner (the plan for its shape class + online actions)."""
        return self._run(self.plan_for(mb), mb, **kw)


def _kind_counts(sp: ShapePlan) -> Dict[str, int]:
    """How many units ``sp``'s plan keeps exact, compressed and partial."""
    return {q: sum(split_label(v)[0] == q for v in sp.plan.values()) for q in (EXACT, COMPRESSED, PARTIAL)}
