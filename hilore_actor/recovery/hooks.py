"""Every hook of the recovery engine, and the one ``Frame`` they share.

Module hooks (registered once, when the engine attaches) say which unit runs and record how it
was called; saved-tensor hooks (installed by each ``Step``) file every tensor autograd saves
under that unit (``pack``) and hand it back in backward (``unpack``: the stored tensor, its
decoded L copy, or a recomputation, ``recompute``). All of them read and write one ``Frame``,
where the engine is now, and the open ``Step``'s records (``state.py``), and nothing else
(imports go one way: engine -> step -> hooks -> state).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, List, Optional, Set

import torch
from torch.utils._pytree import tree_map_only
from torch.utils.checkpoint import create_selective_checkpoint_contexts, get_device_states, set_device_states

from .codecs import PAYLOADS, decode
from .labels import CHECKPOINT, COMPRESSED, PARTIAL, RECOMPUTED, P
from .rules import partial_policy
from .state import Call, Link, Replay, UnitState, storage_key, tensors
from .zero3 import gathered_alias, is_partitioned, replay_outside_coordinator


@dataclass(eq=False)
class Frame:
    """Where the engine is while a microbatch runs: the one mutable object its hooks share (as
    ``torch.utils.checkpoint``'s hooks share one frame). One per engine; ``Step`` opens it for
    its block (``open`` resets every field) and closes it."""

    step: Any = None  # the open Step; None: every hook passes through
    mode: str = "forward"  # "forward", or "replay" while backward re-runs units
    # forward: the unit whose modules run, and which kind of code runs inside it
    current: Optional[UnitState] = None
    core_depth: int = 0  # inside an attention module's own code (the attention core, rules.KEEP_EXACT) ...
    child_depth: int = 0  # ... or inside one of its child modules (projections, q/k norms: not the core)
    sign_depth: int = 0  # inside a sign-reading activation (rules.SIGN_READING_ACTIVATIONS)
    in_region: bool = False  # an H layer region runs (compiled.py): its tensors are plain autograd's
    # replay: the units it rebuilds, the one whose modules run, the P unit whose cached mode is on
    targets: Set[UnitState] = field(default_factory=set)
    capture: Optional[UnitState] = None
    cached: Optional[UnitState] = None

    def open(self, step) -> None:
        """Start ``step`` with every other field at its default (a failed forward may have left
        counters set)."""
        self.__init__(step=step)

    def close(self) -> None:
        self.step, self.in_region = None, False

    def in_core(self) -> bool:
        return self.core_depth > 0 and self.child_depth == 0

    def close_cached(self) -> None:
        """Leave the P unit's cached mode (its replay ended, or stopped inside it)."""
        if self.cached is not None:
            self.cached.saved.sac[1].__exit__(None, None, None)
            self.cached = None


_OPEN: list = [None]  # the engine step whose block is open, of whichever engine


def active_step():
    """The open engine step (``step.Step``), which a compiled layer region asks what to run."""
    return _OPEN[0]


def set_active_step(step):
    """Open ``step`` (None: close); returns the step that was open before."""
    before, _OPEN[0] = _OPEN[0], step
    return before


# ---- module hooks: which unit runs, and how it was called ------------------------------------


def count_depth(frame: Frame, depth: str, d: int, *_) -> None:
    """A module pre (``d=1``) or post (``d=-1``) hook that moves one of the frame's depth counters."""
    setattr(frame, depth, getattr(frame, depth) + d)


def _active(frame: Frame):
    st = frame.step
    return st if st is not None and torch.is_grad_enabled() else None


def _rng_state(args) -> tuple:
    devices, states = get_device_states(*tensors(args))
    return torch.get_rng_state(), devices, states


def _autocast_state() -> list:
    return [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")]


def _is_kv_cache(x) -> bool:
    return type(x).__name__.endswith("Cache") and hasattr(x, "get_seq_length")


def _drop_caches(kwargs: dict, first_layer: bool) -> dict:
    """A replay must not append to the KV cache a second time (the cached keys would then
    double). A training forward starts from an empty cache, where no cache is equivalent:
    replays get ``None``. A cache that already holds tokens cannot be replayed exactly."""
    out = {}
    for k, v in kwargs.items():
        if _is_kv_cache(v):
            if first_layer and v.get_seq_length() > 0:
                raise RuntimeError(
                    "hilore: a KV cache that already holds tokens was passed to a training forward; "
                    "call the model with use_cache=False"
                )
            v = None
        out[k] = v
    return out


def layer_pre(frame: Frame, li: int, module, args, kwargs) -> None:
    """A decoder layer starts: record its call, for a joint replay of its units."""
    st = _active(frame)
    if st is None or frame.mode != "forward":
        return
    ls = st.layers[li]
    if st.region[id(module)] is not None:
        return  # one compiled region: plain autograd or torch's checkpoint keeps what it needs
    if ls.replay.calls:
        raise RuntimeError(
            f"hilore: {ls.spec.name} ran twice in one engine step: use one engine.step() per microbatch "
            "forward; a model that runs a layer more than once per forward (shared or recurrent "
            "layers) needs gradient checkpointing instead"
        )
    ls.replay = Replay(
        [Call(module, args, _drop_caches(kwargs, li == 0))], _rng_state((args, kwargs)), _autocast_state()
    )


def module_pre(frame: Frame, li: int, ui: int, k: int, module, args, kwargs) -> None:
    """Module ``k`` of unit ``ui`` of layer ``li`` starts. Forward: the unit runs (``current``);
    its first module opens its records, every module's call is recorded for its replay.
    Replay: a target unit runs (``capture``), a P target under its cached mode."""
    st = _active(frame)
    if st is None:
        return
    u = st.layers[li].units[ui]
    if frame.mode == "replay":
        if k == 0:
            frame.capture = u if u in frame.targets else None
            if frame.capture is u and u.choice.action == P:  # serve its kept op outputs while it re-runs
                frame.cached = u
                u.saved.sac[1].__enter__()
            if st.profile:
                u.stats.timer = st.clock()
        return
    if k == 0:
        frame.current = u
        u.rebuild.outputs.clear()
        x = next(iter(tensors((args, kwargs))), None)
        if st.track_tokens and u.choice.plan not in (CHECKPOINT, PARTIAL):  # exposure matters where L may be chosen
            if x is not None and x.dim() >= 2:
                u.stats.token_norms = torch.linalg.vector_norm(x.detach(), dim=-1, dtype=torch.float32)
        if u.choice.row_share is not None and x is not None and x.dim() >= 2:
            st.keep_rows(u, x)  # token L: this unit's exact rows, before it saves anything
        if st.layer_joint_plan[li]:
            return
        u.rebuild.replay = Replay([], _rng_state((args, kwargs)), _autocast_state())
        if u.choice.plan == PARTIAL:  # keep the expensive ops' outputs while the unit runs (closed in module_post)
            u.saved.sac = create_selective_checkpoint_contexts(partial_policy(u.choice.partial_level))
            u.saved.sac[0].__enter__()
    if st.layer_joint_plan[li]:
        return

    def record(x):
        if id(x) in u.rebuild.outputs:
            return Link(*u.rebuild.outputs[id(x)])
        u.saved.ext_keys.add(storage_key(x))
        return x

    u.rebuild.replay.calls.append(
        Call(
            module,
            tree_map_only(torch.Tensor, record, args),
            tree_map_only(torch.Tensor, record, _drop_caches(kwargs, False)),
        )
    )


def module_post(frame: Frame, li: int, ui: int, k: int, last: bool, module, args, output) -> None:
    """Module ``k`` of a unit ends: its outputs become links for the unit's later calls; after
    the unit's last module the unit is no longer running."""
    st = _active(frame)
    if st is None:
        return
    u = st.layers[li].units[ui]
    if frame.mode == "replay":
        if last:
            frame.capture = None
            frame.close_cached()
            if st.profile and u.stats.timer is not None:
                u.stats.replay_seconds += st.clock() - u.stats.timer
                u.stats.timer = None
        return
    if isinstance(output, torch.Tensor):
        u.rebuild.outputs[id(output)] = (k, None)
    elif isinstance(output, (tuple, list)):
        for i, o in enumerate(output):
            if isinstance(o, torch.Tensor):
                u.rebuild.outputs[id(o)] = (k, i)
    if last:
        frame.current = None
        u.rebuild.outputs.clear()
        if u.saved.sac is not None and frame.mode == "forward":
            u.saved.sac[0].__exit__(None, None, None)


# ---- saved-tensor hooks: what each saved tensor becomes ---------------------------------------


class Handle:
    """What autograd holds for a tensor a unit saved: the unit and the tensor's index in it."""

    __slots__ = ("unit", "idx")

    def __init__(self, unit: UnitState, idx: int):
        self.unit, self.idx = unit, idx


def is_param(t: torch.Tensor, st) -> bool:
    """Parameters and their views pass through untouched: never copied, never counted.

    ``param_keys`` holds the storages of the model's parameters as the step began. FSDP2 and
    ZeRO-3 substitute other parameters while a module runs (FSDP2's unsharded parameter, a view
    of its all-gather buffer; ZeRO-3's gathered ``.data``), and ``F.linear`` saves a transposed
    view of them, whose storage is in no such set. The view's ``_base`` names the parameter;
    keeping it (not a copy) also lets FSDP2 free that storage after forward and refill it for
    backward, as plain autograd would."""
    return (
        isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter) or storage_key(t) in st.param_keys
    )


def pack(st, t: torch.Tensor):
    """Forward: file ``t`` under the running unit as its plan says (exact, compressed, or
    nothing for checkpoint and partial plans) and return its handle."""
    f = st.frame
    if f.step is not st or f.mode != "forward":
        return t
    if f.current is None:  # outside the units; an H layer region's tensors are plain autograd's
        return st.canonical(t) if f.in_region else t
    if is_param(t, st):
        return t
    u = f.current
    s = u.saved
    idx = s.count
    s.count += 1
    ext = storage_key(t) in s.ext_keys
    if ext:
        s.external.add(idx)
    if f.sign_depth > 0:
        s.signed.add(idx)
    plan, compiled = u.choice.plan, st.engine.compiled
    if plan in (CHECKPOINT, PARTIAL):
        s.entries[idx] = None
    elif ext:
        s.entries[idx] = st.canonical(t)
    elif st.engine.attention_core_exact and f.in_core():
        s.kept.add(idx)  # the attention core: exact even under L (rules.KEEP_EXACT)
        s.entries[idx] = st.canonical(t)
        st.kept_keys.add(storage_key(s.entries[idx]))  # the storage held (a shared mask: the first copy's)
    elif plan == COMPRESSED and compiled and not t.is_contiguous() and torch._debug_has_internal_overlap(t) != 0:
        s.entries[idx] = st.canonical(t)  # overlapping elements (expanded): no strides to decode into
    elif plan == COMPRESSED:
        s.entries[idx] = st.compress(t, u, keep_sign=idx in s.signed)
        if compiled and isinstance(s.entries[idx], PAYLOADS) and not t.is_contiguous():
            s.strides[idx] = t.stride()  # the compiled backward asserts the saved strides (compiled.py)
    else:
        s.entries[idx] = st.canonical(t)
    return Handle(u, idx)


def unpack(st, h):
    """Backward: the tensor behind ``h``, exact, decoded (L) or recomputed (R, P)."""
    if isinstance(h, torch.Tensor):
        return gathered_alias(h) if is_partitioned(h) else h
    if st.frame.step is not st:
        raise RuntimeError(
            "hilore: backward ran after its engine step ended; call loss.backward() inside `with engine.step():`"
        )
    st.ensure_actions()
    u, idx = h.unit, h.idx
    if u.choice.action in RECOMPUTED:
        if idx not in u.rebuild.recomputed:
            recompute(st, u)
        return u.rebuild.recomputed.pop(idx)
    if idx not in u.saved.entries:
        raise RuntimeError(f"hilore: saved tensor {idx} of {u.name} was already used; one backward per engine step")
    v = u.saved.entries.pop(idx)
    if not isinstance(v, PAYLOADS):
        return v
    t0 = st.clock() if st.profile else 0.0
    out = decode(u.choice.codec or st.engine.codec, v)
    stride = u.saved.strides.pop(idx, None)
    if stride is not None:
        out = torch.empty_strided(out.shape, stride, dtype=out.dtype, device=out.device).copy_(out)
    if st.profile:
        u.stats.codec_seconds += st.clock() - t0
    return out


# ---- recomputation: R and P units rebuilt in backward -----------------------------------------


class _ReplayDone(Exception):
    """Raised from the capture hook once every target's bundle is rebuilt (as
    ``torch.utils.checkpoint`` stops early): the replay's remaining ops are never run."""


def recompute(st, u: UnitState) -> None:
    """Rebuild ``u``'s saved tensors (and, for a joint layer, its layer's other units')."""
    ls = st.layer_of[u.name]
    if u.rebuild.replayed:
        raise RuntimeError(f"hilore: {u.name}: a saved tensor is missing after recomputation")
    targets = list(ls.units) if ls.joint else [u]  # joint: every unit is R or P
    replay = ls.replay if ls.joint else u.rebuild.replay
    for x in targets:
        x.rebuild.replayed, x.rebuild.captured = True, 0
    _run_replay(st, replay, targets)
    for x in targets:
        if x.rebuild.captured != x.saved.count:
            raise RuntimeError(
                f"hilore: recomputing {x.name} saved {x.rebuild.captured} tensors, forward saved {x.saved.count}; "
                "the unit's forward is not deterministic in structure"
            )


def _run_replay(st, replay: Replay, targets: List[UnitState]) -> None:
    """Re-run ``replay``'s calls, capturing the targets' saved tensors (a P target's kept op
    outputs are served by its cached mode while it runs: ``module_pre``)."""
    f = st.frame
    cpu_rng, devices, dev_states = replay.rng
    device_type = "cuda" if devices else "cpu"
    outs: list = []

    def resolve(x):
        if isinstance(x, Link):
            o = outs[x.call]
            return o if x.index is None else o[x.index]
        return x.detach().requires_grad_(x.requires_grad) if x.is_floating_point() else x

    prev_mode, f.mode, f.targets, f.capture = f.mode, "replay", set(targets), None
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=devices, device_type=device_type))
            torch.set_rng_state(cpu_rng)
            if devices:
                set_device_states(devices, dev_states, device_type=device_type)
            for dev, enabled, dtype in replay.autocast:
                if dev == "cpu" or torch.cuda.is_available():
                    stack.enter_context(torch.autocast(dev, dtype=dtype, enabled=enabled))
            stack.enter_context(replay_outside_coordinator([c.module for c in replay.calls]))
            stack.enter_context(torch.enable_grad())
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(lambda t: _capture(f, t), lambda x: x))
            stack.callback(f.close_cached)  # the replay stopped inside a P unit (_ReplayDone)
            for call in replay.calls:
                args = tree_map_only((torch.Tensor, Link), resolve, call.args)
                kwargs = tree_map_only((torch.Tensor, Link), resolve, call.kwargs)
                outs.append(call.module(*args, **kwargs))
    except _ReplayDone:
        pass
    finally:
        if st.profile:
            now = st.clock()
            for x in targets:
                if x.stats.timer is not None:
                    x.stats.replay_seconds += now - x.stats.timer
                    x.stats.timer = None
        f.mode, f.targets, f.capture = prev_mode, set(), None


def _capture(f: Frame, t: torch.Tensor):
    """The replay's pack hook: the running target's re-saved tensors, in forward's order."""
    u = f.capture
    if u is not None and not is_param(t, f.step):
        u.rebuild.recomputed[u.rebuild.captured] = t
        u.rebuild.captured += 1
        if u.rebuild.captured == u.saved.count and all(x.rebuild.captured == x.saved.count for x in f.targets):
            raise _ReplayDone  # everything backward needs exists: skip the rest of the forward
    return None
