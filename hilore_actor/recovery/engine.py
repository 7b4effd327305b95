"""The recovery engine: per-unit store (H), compress (L) or recompute (R) of saved activations.

Mechanism (the same one ``torch.utils.checkpoint``'s non-reentrant mode uses, made per unit):

1. ``saved_tensors_hooks`` intercept every tensor autograd saves. Module hooks on each unit's
   modules tell which unit is running, so each saved tensor becomes a handle ``(unit, index)``;
   the unit's store keeps it exact, compressed, or not at all, as its pre-forward *plan* says.
   Parameters pass through untouched (never copied, never counted).
2. While a unit runs, its module calls are recorded (arguments that come from outside the unit
   are its exact *checkpoint inputs*; arguments produced inside the unit are links), together
   with the RNG and autocast state. Each decoder layer's own call is recorded the same way.
3. After forward the caller sets *actions*. exact -> H | L | R, compressed -> L | R,
   checkpoint -> R. L compresses the exact bundle now; R drops it now: memory is freed before
   backward starts.
4. In backward, unpacking an H handle returns the stored tensor; L decodes; R re-runs the
   unit's recorded calls (same inputs, RNG, autocast, precision) under a capture hook that
   collects the re-saved tensors in the same order. When every unit of a layer is R, one replay
   of the whole layer serves them all (the attention recompute produces the MLP's input, so the
   MLP's input need not be kept): that is exactly decoder-layer checkpointing.

H and R therefore give bitwise the gradients of plain autograd; only L approximates.
"""
from __future__ import annotations

import contextlib
import weakref
from functools import partial
from typing import Dict, List, Optional, Union

import torch
from torch.utils.checkpoint import get_device_states, set_device_states

from .codecs import Payload, get_codec
from .state import (ALLOWED, CHECKPOINT, COMPRESSED, DEFAULT_ACTION, EXACT, PLANS, R, Call, LayerState, Link,
                    Replay, UnitState, iter_tensors, map_structure, storage_key, unit_bytes, L)
from .units import discover_units
from .zero3 import gathered_alias, is_partitioned, residency_preserved

MIN_COMPRESS_NUMEL = 1024  # smaller or non-float saved tensors stay exact under L


class _Handle:
    __slots__ = ("unit", "idx")

    def __init__(self, unit: UnitState, idx: int):
        self.unit, self.idx = unit, idx


def _rng_state(args) -> tuple:
    devices, states = get_device_states(*list(iter_tensors(args)))
    return torch.get_rng_state(), devices, states


def _autocast_state() -> list:
    return [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")]


class RecoveryEngine:
    """Attach once to an HF decoder model (plain, peft, or inside a DeepSpeed engine); then
    ``with engine.step(plan): forward; loss; step.set_actions(...); loss.backward()``."""

    def __init__(self, model: torch.nn.Module, codec: str = "int8"):
        self.model = model
        self.layer_specs = discover_units(model)
        self.unit_names = [u.name for layer in self.layer_specs for u in layer.units]
        self.codec = get_codec(codec)
        self._step: Optional["Step"] = None
        self._hooks = []
        for li, layer in enumerate(self.layer_specs):
            self._hooks.append(layer.module.register_forward_pre_hook(partial(self._layer_pre, li), with_kwargs=True))
            for ui, unit in enumerate(layer.units):
                last = len(unit.modules) - 1
                for k, m in enumerate(unit.modules):
                    self._hooks.append(m.register_forward_pre_hook(partial(self._module_pre, li, ui, k), with_kwargs=True))
                    self._hooks.append(m.register_forward_hook(partial(self._module_post, li, ui, k, k == last)))

    def detach(self) -> None:
        """Remove the engine's hooks; the model behaves as before attaching."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def step(
        self, plan: Union[str, Dict[str, str], None] = None, actions: Union[str, Dict[str, str], None] = None,
        track_error: bool = True,
    ) -> "Step":
        """One microbatch. ``plan``: a policy name (``all-h``, ``all-l``, ``all-r``), a
        ``{unit: exact|compressed|checkpoint}`` map, or an ``{unit: H|L|R}`` action map (then
        the plan is the cheapest that admits it). ``actions`` (optional) are applied before
        backward unless ``set_actions`` is called. ``track_error`` measures each L unit's
        reconstruction error (one extra decode per compressed tensor)."""
        from .policies import resolve_plan

        plans, default_actions = resolve_plan(plan, self.unit_names)
        return Step(self, plans, actions if actions is not None else default_actions, track_error)

    # ---- forward hooks -------------------------------------------------------------------
    def _active(self) -> Optional["Step"]:
        st = self._step
        return st if st is not None and torch.is_grad_enabled() else None

    def _layer_pre(self, li, module, args, kwargs):
        st = self._active()
        if st is None or st.mode != "forward":
            return
        ls = st.layers[li]
        if ls.replay.calls:
            raise RuntimeError(f"{ls.spec.name} ran twice in one engine step; use one engine.step() per microbatch forward")
        ls.replay = Replay([Call(module, args, kwargs)], _rng_state((args, kwargs)), _autocast_state())

    def _module_pre(self, li, ui, k, module, args, kwargs):
        st = self._active()
        if st is None:
            return
        u = st.layers[li].units[ui]
        if st.mode == "replay":
            if k == 0:
                st.capture = u if u in st.targets else None
            return
        if k == 0:
            st.current = u
            u.outputs.clear()
            if st.layer_joint_plan[li]:
                return
            u.replay = Replay([], _rng_state((args, kwargs)), _autocast_state())
        if st.layer_joint_plan[li]:
            return

        def record(x):
            if isinstance(x, torch.Tensor) and id(x) in u.outputs:
                return Link(*u.outputs[id(x)])
            if isinstance(x, torch.Tensor):
                u.ext_keys.add(storage_key(x))
            return x

        u.replay.calls.append(Call(module, map_structure(args, record), map_structure(kwargs, record)))

    def _module_post(self, li, ui, k, last, module, args, output):
        st = self._active()
        if st is None:
            return
        u = st.layers[li].units[ui]
        if st.mode == "replay":
            if last:
                st.capture = None
            return
        if isinstance(output, torch.Tensor):
            u.outputs[id(output)] = (k, None)
        elif isinstance(output, (tuple, list)):
            for i, o in enumerate(output):
                if isinstance(o, torch.Tensor):
                    u.outputs[id(o)] = (k, i)
        if last:
            st.current = None
            u.outputs.clear()

    # ---- saved-tensor hooks --------------------------------------------------------------
    def _is_param(self, t: torch.Tensor, st: "Step") -> bool:
        return isinstance(t, torch.nn.Parameter) or storage_key(t) in st.param_keys

    def _pack(self, t: torch.Tensor):
        st = self._step
        if st is None or st.mode != "forward" or st.current is None or self._is_param(t, st):
            return t
        u = st.current
        idx = u.n_saved
        u.n_saved += 1
        ext = storage_key(t) in u.ext_keys
        if ext:
            u.external.add(idx)
        if u.plan == CHECKPOINT:
            u.entries[idx] = None
        elif u.plan == COMPRESSED and not ext:
            u.entries[idx] = st.compress(t, u)
        else:
            u.entries[idx] = t
        return _Handle(u, idx)

    def _unpack(self, h):
        if isinstance(h, torch.Tensor):
            return gathered_alias(h) if is_partitioned(h) else h
        st = self._step
        if st is None:
            raise RuntimeError("hilore: backward ran after its engine step ended; call loss.backward() inside `with engine.step():`")
        st.ensure_actions()
        u, idx = h.unit, h.idx
        if u.action == R:
            if idx not in u.recomputed:
                self._recompute(st, u)
            return u.recomputed.pop(idx)
        if idx not in u.entries:
            raise RuntimeError(f"hilore: saved tensor {idx} of {u.name} was already used; one backward per engine step")
        v = u.entries.pop(idx)
        return self.codec.decode(v) if isinstance(v, Payload) else v

    # ---- recomputation -------------------------------------------------------------------
    def _recompute(self, st: "Step", u: UnitState) -> None:
        ls = st.layer_of[u.name]
        if u.replayed:
            raise RuntimeError(f"hilore: {u.name}: a saved tensor is missing after recomputation")
        targets = [x for x in ls.units if x.action == R] if ls.joint else [u]
        replay = ls.replay if ls.joint else u.replay
        for x in targets:
            x.replayed, x.capture_count = True, 0
        self._run_replay(st, replay, targets)
        for x in targets:
            if x.capture_count != x.n_saved:
                raise RuntimeError(
                    f"hilore: recomputing {x.name} saved {x.capture_count} tensors, forward saved {x.n_saved}; "
                    "the unit's forward is not deterministic in structure"
                )

    def _run_replay(self, st: "Step", replay: Replay, targets: List[UnitState]) -> None:
        cpu_rng, devices, dev_states = replay.rng
        device_type = "cuda" if devices else "cpu"
        outs: list = []

        def resolve(x):
            if isinstance(x, Link):
                o = outs[x.call]
                return o if x.index is None else o[x.index]
            return x.detach().requires_grad_(x.requires_grad) if x.is_floating_point() else x

        prev_mode, st.mode, st.targets, st.capture = st.mode, "replay", set(targets), None
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(torch.random.fork_rng(devices=devices, device_type=device_type))
                torch.set_rng_state(cpu_rng)
                if devices:
                    set_device_states(devices, dev_states, device_type=device_type)
                for dev, enabled, dtype in replay.autocast:
                    if dev == "cpu" or torch.cuda.is_available():
                        stack.enter_context(torch.autocast(dev, dtype=dtype, enabled=enabled))
                stack.enter_context(residency_preserved([c.module for c in replay.calls]))
                stack.enter_context(torch.enable_grad())
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(partial(self._capture, st), lambda x: x))
                for call in replay.calls:
                    outs.append(call.module(*map_structure(call.args, resolve), **map_structure(call.kwargs, resolve)))
        finally:
            st.mode, st.targets, st.capture = prev_mode, set(), None

    def _capture(self, st: "Step", t: torch.Tensor):
        u = st.capture
        if u is not None and not self._is_param(t, st):
            u.recomputed[u.capture_count] = t
            u.capture_count += 1
        return None


class Step:
    """One microbatch under the engine: ``with engine.step(...) as step:`` forward, loss,
    ``step.set_actions(...)``, ``loss.backward()`` (backward must run inside the block)."""

    def __init__(self, engine: RecoveryEngine, plans: Dict[str, str], actions, track_error: bool = True):
        self.engine = engine
        self.track_error = track_error
        self.plans = plans
        self._pending_actions = actions
        self.layers = [
            LayerState(spec, [UnitState(u, plan=plans[u.name]) for u in spec.units]) for spec in engine.layer_specs
        ]
        self.units = [u for ls in self.layers for u in ls.units]
        self.layer_of = {u.name: ls for ls in self.layers for u in ls.units}
        self.layer_joint_plan = [all(u.plan == CHECKPOINT for u in ls.units) for ls in self.layers]
        self.mode = "forward"
        self.current: Optional[UnitState] = None
        self.capture: Optional[UnitState] = None
        self.targets: set = set()
        self.actions_set = False
        self._compressed: Dict[int, tuple] = {}
        self._hooks_ctx = None

    def __enter__(self) -> "Step":
        if self.engine._step is not None:
            raise RuntimeError("hilore: an engine step is already active; steps do not nest")
        self.param_keys = {storage_key(p) for p in self.engine.model.parameters() if p.numel() > 0}
        self.engine._step = self
        self._hooks_ctx = torch.autograd.graph.saved_tensors_hooks(self.engine._pack, self.engine._unpack)
        self._hooks_ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks_ctx.__exit__(*exc)
        self.engine._step = None
        for u in self.units:  # release whatever backward did not consume
            u.entries.clear()
            u.recomputed.clear()
            u.replay = Replay()
        for ls in self.layers:
            ls.replay = Replay()

    def compress(self, t: torch.Tensor, unit: UnitState):
        """The L representation of one saved tensor (or ``t`` itself when it cannot be scaled)."""
        if not t.is_floating_point() or t.numel() < MIN_COMPRESS_NUMEL:
            return t
        # Dedup a tensor saved several times by its identity (a weak reference proves it is
        # still the same live tensor: addresses and ids are reused once a tensor is freed).
        hit = self._compressed.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        p = self.engine.codec.encode(t)
        # masks with -inf (SDPA's additive mask) or NaNs cannot be scaled: keep them exact
        out = p if bool(torch.isfinite(p.scale).all()) else t
        self._compressed[id(t)] = (weakref.ref(t), out)
        if self.track_error and out is p:
            x = t.detach().float()
            unit.err_sq += float((self.engine.codec.decode(p).float() - x).pow(2).sum())
            unit.norm_sq += float(x.pow(2).sum())
        return out

    def reconstruction_errors(self) -> Dict[str, float]:
        """``||z^ - z|| / (||z|| + eps)`` over each compressed unit's bundle (section 4's e_u)."""
        return {u.name: u.err_sq**0.5 / (u.norm_sq**0.5 + 1e-12) for u in self.units if u.norm_sq > 0}

    def set_actions(self, actions: Union[str, Dict[str, str], None] = None) -> None:
        """Choose H/L/R per unit after forward (a policy name or ``{unit: action}``; units not
        named take their plan's default). Memory of downgraded bundles is released here."""
        from .policies import resolve_actions

        if self.actions_set:
            raise RuntimeError("hilore: actions were already set for this step")
        chosen = resolve_actions(actions, self.plans)
        for u in self.units:
            a = chosen[u.name]
            if a not in ALLOWED[u.plan]:
                raise ValueError(f"{u.name}: action {a} is not available for a {u.plan!r} bundle (allowed: {ALLOWED[u.plan]})")
            u.action = a
            if a == R:
                u.entries.clear()
            elif a == L and u.plan == EXACT:
                for idx, v in list(u.entries.items()):
                    if isinstance(v, torch.Tensor) and idx not in u.external:
                        u.entries[idx] = self.compress(v, u)
        for ls in self.layers:
            ls.joint = all(u.action == R for u in ls.units)
            if ls.joint:
                for u in ls.units:
                    u.replay = Replay()  # the layer replay rebuilds every unit: drop their own inputs
            else:
                ls.replay = Replay()
                for u in ls.units:
                    if u.action != R:
                        u.replay = Replay()
        self._compressed.clear()
        self.actions_set = True

    def ensure_actions(self) -> None:
        if not self.actions_set:
            self.set_actions(self._pending_actions)

    def bytes_by_unit(self) -> Dict[str, Dict[str, int]]:
        """Bytes held per unit now: ``exact``, ``compressed`` and ``checkpoint`` (inputs kept for
        recomputation), each storage counted once."""
        return unit_bytes(self.layers)

    def actions(self) -> Dict[str, str]:
        return {u.name: u.action for u in self.units}


__all__ = ["RecoveryEngine", "Step", "PLANS", "DEFAULT_ACTION"]
