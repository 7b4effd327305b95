"""Runs one microbatch (forward, GRPO loss, backward) under a method, and measures it.

Every allocation measurement goes through here so that all methods see the same inputs,
the same RNG seed and the same bookkeeping: baselines (``no-gc``, ``gc``), engine policies
and plans, and HiLoRe's online choice (a callable that picks actions after the loss).

``Runner.watching()`` records the peak of every pass while planning (``plan_peak_bytes``):
every run is measured except timed ones (``profile`` or ``timed``), whose program also runs
once measured (a warm-up, or the measured run after the timed repeats), since on CPU the
meter's profiler would slow the very code being timed.

Gradient checks (calibration's and validation's gradient errors, ``learner/gradient_check.py``)
compare two gradients without a flattened copy of either: a pass with a ``GradOp`` adds each
parameter's gradient into a sum ``HeldGradients`` keeps, or compares it with one, as autograd
produces it, and lets it go; ``RunResult.grad_sums`` has the float64 sums (docs/planning.md).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

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
    grad_sums: Optional[Tuple[float, float, float, float]] = None  # a comparing ``GradOp``'s (``GradSums``)
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
        self._captured = backward is not None  # a given backward is torch.autograd.grad (HeldGradients.stream)
        self.engine = engine if engine is not None else RecoveryEngine(model)
        self.loss_fn = loss_fn
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.watch: Optional[List[int]] = None  # peaks of the passes run while watching
        self.watch_phases: List[str] = []  # the phase each watched pass ran in (``phase``)
        self.phase_stats: Dict[str, Dict[str, float]] = {}  # phase -> passes and seconds spent in it (``phase``)
        self.progress: Optional[Callable[[Dict], None]] = None  # told of every phase and pass (``Progress``)
        self._phase, self._total, self._pass = "", None, 0
        self._since = self.started = time.perf_counter()
        self.held = HeldGradients(self.params)  # gradients gradient checks hold between passes (``GradOp``)

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
    def phase(self, name: str, total: Optional[int] = None):
        """Name the passes run inside the block: planning's report says which phase peaked,
        ``phase_stats`` how many passes and seconds each took (a nested phase's time is its own,
        not its parent's), and ``progress`` hears of each. ``total``: the passes it will run, when
        known."""
        old = (self._phase, self._total, self._pass)
        self._account()
        self._phase, self._total, self._pass = name, total, 0
        self.phase_stats.setdefault(name, {"passes": 0, "seconds": 0.0})
        self._tell()
        try:
            yield
        finally:
            self._account()
            self._phase, self._total, self._pass = old

    def _account(self) -> None:
        now = time.perf_counter()
        if self._phase:
            self.phase_stats[self._phase]["seconds"] += now - self._since
        self._since = now

    def _tell(self) -> None:
        if self.progress is not None:
            elapsed = time.perf_counter() - self.started
            self.progress({"phase": self._phase, "pass": self._pass, "total": self._total, "elapsed": elapsed})

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
        grad_op: Optional[GradOp] = None,
    ) -> RunResult:
        """``method``: a baseline name, ``"as-is"`` (the model as currently configured, e.g. a
        peer's own checkpointing), an engine policy name, or a plan / action map.
        ``actions``: fixed actions, or a callable ``(step, loss_output) -> actions``.
        ``loss_fn`` overrides the runner's (e.g. to call a compiled model).
        ``accumulate``: keep the gradients of earlier microbatches (as an update accumulates
        them) instead of starting from none; ``grads`` then returns the running sum.
        ``timed``: the caller uses ``seconds``, so a watching runner leaves the run unmeasured.
        ``regions``: uniform layers run as their compiled layer regions (``recovery.compiled``).
        ``grad_op``: what the pass does with its gradient, parameter by parameter (``GradOp``;
        not with ``grads`` or ``accumulate``); a comparing one fills ``grad_sums``."""
        if grad_op is not None and (grads or accumulate):
            raise ValueError("grad_op streams the gradient: not with grads or accumulate")
        loss_fn = loss_fn or self.loss_fn
        measure_peak = measure_peak or (self.watch is not None and not (profile or timed))
        self._pass += 1
        if self._phase:
            self.phase_stats[self._phase]["passes"] += 1
        self._tell()
        if not accumulate:
            self._returned = None
            for p in self.params:
                p.grad = None
        torch.manual_seed(seed)
        meter = MemoryMeter(self.device) if measure_peak else None
        info: Dict = {}
        self._sync()
        t0, c0 = time.perf_counter(), time.process_time()
        stream = (
            self.held.stream(grad_op, self._captured, self.device) if grad_op is not None else contextlib.nullcontext()
        )
        with meter if meter is not None else contextlib.nullcontext(), stream as sums:
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
        if grad_op is not None and grad_op.compare:
            res.grad_sums = sums.total(self.held.keys)
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


# ---- gradient checks, one parameter at a time ------------------------------------------------
CHUNK = 1 << 22  # elements per float64 reduction (``GradSums``): its temporaries are three of these (96 MiB)


@dataclass(frozen=True)
class GradOp:
    """What a pass does with its gradient, one parameter at a time as autograd produces it (no
    flattened copy, no full second set): ``add`` it into the held sum of that name (created at
    the first such pass; accumulated in ``dtype``, None: the gradient's own, as ``.grad``
    would); ``compare`` it, plus the held sum ``add`` names (then consumed), with the held
    gradient of that name: ``RunResult.grad_sums``. ``drop``: held gradients freed after the
    pass. ``part``: ``(i, n)``, only the i-th of n parameter groups (equal shares of the
    bytes, in order; the others' gradients go as they arrive), so that an accumulated check
    (a sum being built beside the reference) holds one set in all over n = 2 rounds."""

    add: Optional[str] = None
    compare: Optional[str] = None
    drop: Tuple[str, ...] = ()
    part: Tuple[int, int] = (0, 1)
    dtype: Optional[torch.dtype] = None
    restart: bool = False  # ``add`` starts a new sum (whatever an interrupted check left under that name goes)


class GradSums:
    """``(||s - r||^2, <s, r>, ||s||^2, ||r||^2)`` in float64 between the gradient a comparing
    pass builds (``s``) and the held one (``r``), summed on the device per reduction group and
    over the ranks that hold parts of it at the end (``total``: one host sync)."""

    def __init__(self, device):
        self.device = device
        self.acc: Dict[tuple, torch.Tensor] = {}

    def add(self, key: tuple, s: Optional[torch.Tensor], r: Optional[torch.Tensor], chunk: int = 0) -> None:
        """Add one parameter's terms; None is a zero gradient (unused in that pass)."""
        if s is None and r is None:
            return
        chunk = chunk or CHUNK
        a = s.detach().reshape(-1) if s is not None else None
        b = r.detach().reshape(-1) if r is not None else None
        n = (a if a is not None else b).numel()
        acc = self.acc.get(key)
        if acc is None:
            acc = self.acc[key] = torch.zeros(4, dtype=torch.float64, device=(a if a is not None else b).device)
        zero = torch.zeros((), dtype=torch.float64, device=acc.device)
        for i in range(0, n, chunk):  # live at once: x, y and x - y, three float64 chunks
            x = a[i : i + chunk].double() if a is not None else None
            y = b[i : i + chunk].double() if b is not None else None
            xx = torch.dot(x, x) if x is not None else zero
            yy = torch.dot(y, y) if y is not None else zero
            if x is None or y is None:
                acc += torch.stack([xx + yy, zero, xx, yy])
            else:
                d = x - y
                acc += torch.stack([torch.dot(d, d), torch.dot(x, y), xx, yy])

    def total(self, groups: Dict[tuple, tuple]) -> Tuple[float, float, float, float]:
        """The sums over every reduction group (``groups``: key -> the process groups whose
        ranks hold the other parts; every rank calls this with the same keys, in order)."""
        out = torch.zeros(4, dtype=torch.float64, device=self.device)
        for key, pgs in groups.items():
            acc = self.acc.get(key)
            if acc is None:
                acc = torch.zeros(4, dtype=torch.float64, device=self.device)
            for pg in pgs:
                torch.distributed.all_reduce(acc, group=pg)
            out += acc.to(out.device)
        return tuple(out.tolist())


class HeldGradients:
    """Gradients held between passes, by name, one tensor (or None: zero) per parameter, and the
    hooks that stream a pass's gradient into them (``stream``). The local tensor is what a rank
    has: an FSDP2 gradient's shard (``to_local``; its sums are reduced over the shard groups); a
    ZeRO-3 parameter's gradient, which ``torch.autograd.grad`` gives whole and alike on every
    rank of a lockstep pass, cut to this rank's 1/world slice (held and summed there, reduced
    over ``ds_process_group``; ``zero3_slices`` False: whole, for ranks that each run their
    own microbatches); else the whole gradient."""

    def __init__(self, params: Sequence[torch.Tensor], zero3_slices: bool = True):
        self.params = list(params)
        self.sets: Dict[str, List[Optional[torch.Tensor]]] = {}
        self._groups = [_shard_groups(p, zero3_slices) for p in self.params]
        self.keys: Dict[tuple, tuple] = {}  # reduction key -> process groups, in parameter order
        for g in self._groups:
            self.keys.setdefault(tuple(id(pg) for pg in g), g)

    def parts(self, n: int) -> List[List[int]]:
        """Parameter indices in ``n`` groups of about equal bytes, in order."""
        sizes = [_numel(p) * p.element_size() for p in self.params]
        total, out, acc = sum(sizes), [[] for _ in range(n)], 0
        for i, b in enumerate(sizes):
            out[min(n - 1, int(n * acc / total) if total else 0)].append(i)
            acc += b
        return out

    def free(self, names: Optional[Sequence[str]] = None) -> None:
        """Let the held gradients of ``names`` go (None: all)."""
        for name in list(self.sets) if names is None else names:
            self.sets.pop(name, None)

    def _local(self, i: int, g: torch.Tensor) -> torch.Tensor:
        if hasattr(g, "to_local"):
            return g.to_local()
        pg = getattr(self.params[i], "ds_process_group", None) if hasattr(self.params[i], "ds_id") else None
        if pg is not None and self._groups[i]:
            world, rank = torch.distributed.get_world_size(pg), torch.distributed.get_rank(pg)
            flat = g.reshape(-1)
            per = -(-flat.numel() // world)
            return flat[rank * per : (rank + 1) * per]
        return g

    @contextlib.contextmanager
    def stream(self, op: GradOp, captured: bool, device) -> "GradSums":
        """Hooks on every parameter for the block's backward: each gradient, once complete, goes
        to ``op`` and is let go. ``captured``: the backward is ``torch.autograd.grad`` (its
        gradients are captured, not accumulated): tensor hooks see them and hand autograd a
        zero-strided stand-in instead; else a post-accumulate-grad hook takes ``.grad`` (also
        FSDP2's sharded one) and clears it. A gradient no hook saw (a wrapper that sets
        ``.grad`` itself) is taken from ``.grad`` after the block. Yields the ``GradSums`` that
        a comparing ``op`` fills; ``total`` is left to the caller."""
        index, n = op.part
        mine = set(self.parts(n)[index]) if n > 1 else set(range(len(self.params)))
        if op.add and op.restart:
            self.sets.pop(op.add, None)
        held = self.sets.setdefault(op.add, [None] * len(self.params)) if op.add else None
        ref = self.sets.get(op.compare, [None] * len(self.params)) if op.compare else None
        sums, seen = GradSums(device), set()

        def take(i: int, g: torch.Tensor) -> None:
            seen.add(i)
            if i not in mine:
                return
            v = self._local(i, g.detach())
            if held is not None:
                held[i] = _add_into(held[i], v, op.dtype)
            if ref is not None:
                sums.add(tuple(id(pg) for pg in self._groups[i]), held[i] if held is not None else v, ref[i])
                if held is not None:
                    held[i] = None  # the sum it built is compared: not needed again

        def pre(i):
            def hook(g):
                take(i, g)
                return g.new_zeros(()).expand(g.shape)

            return hook

        def post(i):
            def hook(p):
                if p.grad is not None:
                    take(i, p.grad)
                    p.grad = None

            return hook

        handles = [
            p.register_hook(pre(i)) if captured else p.register_post_accumulate_grad_hook(post(i))
            for i, p in enumerate(self.params)
        ]
        try:
            yield sums
        finally:
            for h in handles:
                h.remove()
        for i, p in enumerate(self.params):
            if i not in seen and p.grad is not None:
                take(i, p.grad)
            p.grad = None
        if ref is not None:
            for i in sorted(mine - seen):  # unused in this pass: a zero gradient
                sums.add(tuple(id(pg) for pg in self._groups[i]), held[i] if held is not None else None, ref[i])
                if held is not None:
                    held[i] = None
            if op.add:
                self.sets.pop(op.add, None)
        self.free(op.drop)


def _add_into(held: Optional[torch.Tensor], v: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """``held + v`` in ``held``'s storage (chunked where dtypes differ, so a cast copy is one
    chunk); the first ``v`` is kept as it is, unless a cast or a view into a larger storage
    (this rank's slice) asks for a copy of its own."""
    if held is None:
        t = v if dtype is None or v.dtype == dtype else v.to(dtype)
        if t is v and t.untyped_storage().nbytes() > t.numel() * t.element_size():
            t = t.clone()
        return t
    if held.dtype == v.dtype or not (held.is_contiguous() and v.is_contiguous()):
        return held.add_(v)
    a, b = held.view(-1), v.reshape(-1)
    for i in range(0, a.numel(), CHUNK):
        a[i : i + CHUNK].add_(b[i : i + CHUNK])
    return held


def _shard_groups(p: torch.Tensor, zero3_slices: bool = True) -> tuple:
    """Process groups over which a parameter's gradient is split across ranks: an FSDP2
    DTensor's sharded mesh dimensions, a ZeRO-3 parameter's ``ds_process_group`` (its whole
    gradient sliced per rank, ``HeldGradients._local``); none for a plain one."""
    if hasattr(p, "placements") and hasattr(p, "device_mesh"):
        return tuple(p.device_mesh.get_group(d) for d, pl in enumerate(p.placements) if pl.is_shard())
    pg = getattr(p, "ds_process_group", None) if zero3_slices and hasattr(p, "ds_id") else None
    if pg is not None and torch.distributed.is_initialized() and torch.distributed.get_world_size(pg) > 1:
        return (pg,)
    return ()
