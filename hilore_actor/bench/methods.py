"""Every benchmarked method as one object: run an update, measure its peak, its gradients."""
from __future__ import annotations

import statistics
from collections import Counter
from typing import Callable, Dict, List, Optional

import torch

from ..allocation import HiLoRe
from ..recovery import apply_baseline
from ..recovery.policies import ENGINE_POLICIES
from .peers import PeerUnavailable, compiled_runner, enable_sac

OURS = ("hilore-hr", "hilore-static", "hilore")  # run through the chunked head by default
PEERS = ("sac", "compile-budget", "compile-fp8")
BUDGETED = OURS + ("compile-budget",)


def is_budgeted(name: str) -> bool:
    return name.split("+")[0] in BUDGETED


class Method:
    """``run(mb, **kw)`` executes one microbatch through the shared runner."""

    def __init__(self, name: str, budget_ratio: Optional[float], run: Callable, setup=None, teardown=None):
        self.name, self.budget_ratio = name, budget_ratio
        self._run, self._setup, self._teardown = run, setup, teardown
        self.prepare_seconds = 0.0
        self.unavailable: Optional[str] = None
        self.hilore: Optional[HiLoRe] = None
        self.extra: Dict = {}
        self.isolated = False  # compiled peers: timed in their own phase (see peers.compiled_runner)
        self.rebuild = None  # callable that recompiles an isolated peer before its phase

    def run(self, mb, **kw):
        if self._setup:
            self._setup()
        try:
            return self._run(mb, **kw)
        finally:
            if self._teardown:
                self._teardown()

    def update(self, mbs: List) -> Dict:
        """One optimizer update's worth of microbatches: seconds, CPU seconds, overhead, actions."""
        secs = cpu = over = 0.0
        acts: Counter = Counter()
        for i, mb in enumerate(mbs):
            r = self.run(mb, seed=i)
            secs += r.seconds
            cpu += r.cpu_seconds
            over += r.choose_seconds
            acts.update(r.actions.values())
        return {"seconds": secs, "cpu_seconds": cpu, "overhead": over, "actions": acts}

    def peak(self, mbs: List) -> int:
        return max(self.run(mb, measure_peak=True, seed=i).peak_bytes for i, mb in enumerate(mbs))

    def grad(self, mbs: List) -> torch.Tensor:
        return sum(self.run(mb, grads=True, seed=i).grad for i, mb in enumerate(mbs))


def make_method(name: str, runner, budget_ratio: Optional[float], ctx) -> Method:
    """``ctx`` carries what methods share: gc peak, calibration, cost cache, dev batches, log,
    and ``lean_runner`` (the same model and engine with the chunked head). A ``+lean`` suffix
    runs any method through the chunked head; HiLoRe uses it unless ``ctx['ours_lean']`` is off."""
    if name.endswith("+lean"):
        m = make_method(name[: -len("+lean")], ctx["lean_runner"], budget_ratio, dict(ctx, ours_lean=False))
        m.name = name
        return m
    if name in OURS and ctx.get("ours_lean", True) and runner is not ctx["lean_runner"]:
        runner = ctx["lean_runner"]
    model = runner.model
    if name in ("no-gc", "gc") or name in ENGINE_POLICIES:
        return Method(name, None, lambda mb, **kw: runner.run(mb, name, **kw))
    if name == "sac":
        return Method(name, None, lambda mb, **kw: runner.run(mb, "as-is", **kw),
                      setup=lambda: enable_sac(model), teardown=lambda: apply_baseline(model, "no-gc"))
    if name in OURS:
        cache = ctx["costs_cache"].setdefault(id(runner), {})  # costs differ with the head
        h = HiLoRe(runner, int(budget_ratio * ctx["gc_peak"]), ctx["calibration"], mode=name,
                   costs_cache=cache, loo=ctx.get("loo", True), log=ctx["log"])
        m = Method(name, budget_ratio, lambda mb, **kw: h.run(mb, **kw))
        m.hilore = h
        return m
    if name == "compile-fp8":
        def build():
            r = compiled_runner(runner, 1.0, fp8=True)
            r.run(ctx["dev"][0], "as-is")  # compile now, so a failure is reported here
            return r
        try:
            holder = {"r": build()}
        except Exception as e:  # noqa: BLE001 - report whatever stops the peer
            raise PeerUnavailable(f"torch.compile with the activation-quantization pass failed: {e}") from None
        m = Method(name, None, lambda mb, **kw: holder["r"].run(mb, "as-is", **kw))
        m.isolated, m.rebuild = True, lambda: holder.update(r=build())
        return m
    if name == "compile-budget":
        budget = int(budget_ratio * ctx["gc_peak"])
        tried = {}
        for b in ctx.get("compile_budgets", (1.0, 0.5, 0.2, 0.05, 0.0)):
            r = compiled_runner(runner, b)
            peak = max(r.run(mb, "as-is", measure_peak=True).peak_bytes for mb in ctx["dev"][:1])
            tried[b] = peak
            ctx["log"](f"[bench] compile-budget {b}: peak {peak / ctx['gc_peak']:.3f} x gc")
            if peak <= budget:
                holder = {"r": r}
                m = Method(name, budget_ratio, lambda mb, **kw: holder["r"].run(mb, "as-is", **kw))
                m.extra = {"activation_memory_budget": b, "tried": tried}
                m.isolated, m.rebuild = True, lambda b=b: holder.update(r=compiled_runner(runner, b))
                return m
        raise PeerUnavailable(f"no activation_memory_budget in {sorted(tried)} fits {budget_ratio} x gc "
                              f"(peaks {[round(p / ctx['gc_peak'], 3) for p in tried.values()]} x gc)")
    raise ValueError(f"unknown method {name!r}; known: no-gc, gc, {', '.join(ENGINE_POLICIES)}, {', '.join(PEERS)}, {', '.join(OURS)}")


def median(xs):
    return statistics.median(xs) if xs else float("nan")
