"""Runs one microbatch (forward, GRPO loss, backward) under a method, and measures it.

Every allocation measurement goes through here so that all methods see the same inputs,
the same RNG seed and the same bookkeeping: baselines (``no-gc``, ``gc``), engine policies
and plans, and HiLoRe's online choice (a callable that picks actions after the loss).

``Runner.watching()`` records the peak of every pass while planning (``plan_peak_bytes``):
every run is measured except timed ones (``profile`` or ``timed``), whose program also runs
once measured (a warm-up, or the measured run after the timed repeats), since on CPU the
meter's profiler would slow the very code being timed.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Union

import torch

from ..grpo.microbatch import LossOutput, Microbatch, microbatch_loss
from ..recovery import RecoveryEngine, apply_baseline
from ..recovery.policies import BASELINES
from ..runtime import MemoryMeter

ActionChooser = Callable[[object, LossOutput], Dict[str, str]]


@dataclass
class RunResult:
    seconds: float
    cpu_seconds: float
    peak_bytes: Optional[int] = None
    grad: Optional[torch.Tensor] = None  # flat float32 gradient of the trainable parameters
    loss: float = 0.0
    actions: Dict[str, str] = field(default_factory=dict)
    labels: Dict[str, str] = field(default_factory=dict)  # the actions with L's codec when named (L:bf16)
    bytes_by_unit: Dict[str, Dict[str, int]] = field(default_factory=dict)
    bytes_alone: Dict[str, Dict[str, int]] = field(default_factory=dict)  # each unit as if held alone
    saved_counts: Dict[str, int] = field(default_factory=dict)  # tensors each unit saved (its bundle's structure)
    unit_seconds: Dict[str, Dict[str, float]] = field(default_factory=dict)
    token_norms: Dict[str, torch.Tensor] = field(default_factory=dict)
    reconstruction: Dict[str, float] = field(default_factory=dict)
    omega: Optional[torch.Tensor] = None
    mask: Optional[torch.Tensor] = None
    choose_seconds: float = 0.0  # time spent in the online chooser (HiLoRe's overhead)


class Runner:
    def __init__(self, model, engine: Optional[RecoveryEngine] = None, loss_fn=microbatch_loss, backward=None):
        """``backward(loss)`` replaces ``loss.backward()``, e.g. ``torch.autograd.grad`` for
        timing passes that must not reach an optimizer's gradient hooks (DeepSpeed ZeRO). It
        may return the trainable parameters' gradients (in order, None where unused) instead
        of leaving them in ``.grad``: a ZeRO-3 parameter, partitioned, cannot hold a full one."""
        self.model = model
        self._returned: Optional[List[Optional[torch.Tensor]]] = None  # gradients ``backward`` returned
        self.backward = backward or (lambda loss: loss.backward())
        self.engine = engine if engine is not None else RecoveryEngine(model)
        self.loss_fn = loss_fn
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.watch: Optional[List[int]] = None  # peaks of the passes run while watching
        self.watch_phases: List[str] = []  # the phase each watched pass ran in (``phase``)
        self._phase = ""

    @contextlib.contextmanager
    def watching(self):
        """Measure every untimed pass inside the block; yields the list of their peaks
        (``watch_phases`` names the phase of each)."""
        self.watch, self.watch_phases = [], []
        try:
            yield self.watch
        finally:
            self.watch = None

    @contextlib.contextmanager
    def phase(self, name: str):
        """Name the passes run inside the block (planning's report says which phase peaked)."""
        old, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = old

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def run(
        self,
        mb: Microbatch,
        method: Union[str, Dict[str, str], None],
        actions: Union[str, Dict[str, str], ActionChooser, None] = None,
        *,
        loss_fn=None,
        grads: bool = False,
        measure_peak: bool = False,
        profile: bool = False,
        track_tokens: bool = False,
        track_error: bool = False,
        accumulate: bool = False,
        seed: int = 0,
        timed: bool = False,
        regions: bool = False,
    ) -> RunResult:
        """``method``: a baseline name, ``"as-is"`` (the model as currently configured, e.g. a
        peer's own checkpointing), an engine policy name, or a plan / action map.
        ``actions``: fixed actions, or a callable ``(step, loss_output) -> actions``.
        ``loss_fn`` overrides the runner's (e.g. to call a compiled model).
        ``accumulate``: keep the gradients of earlier microbatches (as an update accumulates
        them) instead of starting from none; ``grads`` then returns the running sum.
        ``timed``: the caller uses ``seconds``, so a watching runner leaves the run unmeasured.
        ``regions``: uniform layers run as their compiled layer regions (``recovery.compiled``)."""
        loss_fn = loss_fn or self.loss_fn
        measure_peak = measure_peak or (self.watch is not None and not (profile or timed))
        if not accumulate:
            self._returned = None
            for p in self.params:
                p.grad = None
        torch.manual_seed(seed)
        meter = MemoryMeter(self.device) if measure_peak else None
        info: Dict = {}
        self._sync()
        t0, c0 = time.perf_counter(), time.process_time()
        with meter if meter is not None else contextlib.nullcontext():
            if method == "as-is":
                out = loss_fn(self.model, mb)
                self._backward(out.loss, grads or accumulate)
            elif isinstance(method, str) and method in BASELINES:
                apply_baseline(self.model, method)
                try:
                    out = loss_fn(self.model, mb)
                    self._backward(out.loss, grads or accumulate)
                finally:
                    if method == "gc":
                        apply_baseline(self.model, "no-gc")
            else:
                with self.engine.step(
                    method,
                    track_error=track_error,
                    track_tokens=track_tokens,
                    profile=profile,
                    token_scores=token_scores(mb),
                    regions=regions,
                ) as step:
                    out = loss_fn(self.model, mb)
                    if callable(actions):
                        c = time.perf_counter()
                        chosen = actions(step, out)
                        info["choose_seconds"] = time.perf_counter() - c
                        step.set_actions(chosen)
                    elif actions is not None:
                        step.set_actions(actions)
                    else:
                        step.ensure_actions()
                    info["bytes_by_unit"] = step.bytes_by_unit()
                    info["bytes_alone"] = step.bytes_by_unit(shared=False)
                    info["saved_counts"] = step.saved_counts()
                    info["token_norms"] = step.token_norms()
                    self._backward(out.loss, grads or accumulate)
                    info["actions"], info["labels"] = step.actions(), step.actions(labels=True)
                    info["unit_seconds"] = step.unit_seconds()
                    info["reconstruction"] = step.reconstruction_errors()
            self._sync()
        res = RunResult(
            time.perf_counter() - t0,
            time.process_time() - c0,
            loss=float(out.loss.detach()),
            omega=out.omega,
            mask=out.mask,
            **info,
        )
        if meter is not None:
            res.peak_bytes = meter.report.peak_bytes
            if self.watch is not None:
                self.watch.append(res.peak_bytes)
                self.watch_phases.append(self._phase)
        if grads:
            held = self._returned if self._returned is not None else [p.grad for p in self.params]
            res.grad = torch.cat(
                [
                    _whole(g).detach().float().flatten()
                    if g is not None  # unused: 0
                    else torch.zeros(_numel(p), device=self.device)
                    for p, g in zip(self.params, held)
                ]
            )
        return res

    def _backward(self, loss, keep: bool) -> None:
        """``self.backward``; with ``keep``, gradients it returns are kept (summed over
        ``accumulate`` runs) for ``RunResult.grad``; else they go at once, as ``.grad`` would."""
        got = self.backward(loss)
        if keep and isinstance(got, (list, tuple)):
            old = self._returned or [None] * len(got)
            self._returned = [g if o is None else o if g is None else o + g for o, g in zip(old, got)]


def token_scores(mb) -> Optional[torch.Tensor]:
    """What token L weighs each row's norm by before forward (``Step.keep_rows``): |advantage|
    on response tokens, the part of |omega| (Eq. 4) known before the loss; 0 elsewhere. None
    for a microbatch that is not a ``Microbatch`` (an integration's own): the norms alone."""
    adv, mask = getattr(mb, "advantages", None), getattr(mb, "action_mask", None)
    return adv.abs() * mask if isinstance(adv, torch.Tensor) and isinstance(mask, torch.Tensor) else None


def _numel(p: torch.Tensor) -> int:
    """A parameter's element count, also when ZeRO-3 has partitioned it (``ds_numel``)."""
    return int(getattr(p, "ds_numel", p.numel()))


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A sharded (FSDP2 DTensor) gradient gathered whole: a collective every rank joins
    (``learner/lockstep.py``); a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
