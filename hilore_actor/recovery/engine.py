"""The recovery engine: per-unit store (H), compress (L) or recompute (R) of saved activations.

Mechanism (the same one ``torch.utils.checkpoint``'s non-reentrant mode uses, made per unit):

1. ``saved_tensors_hooks`` intercept every tensor autograd saves. Module hooks on each unit's
   modules tell which unit is running, so each saved tensor becomes a handle ``(unit, index)``;
   the unit's store keeps it exact, compressed, or not at all, as its pre-forward *plan* says
   (``saved.py``). Parameters pass through untouched (never copied, never counted).
2. While a unit runs, its module calls are recorded (arguments that come from outside the unit
   are its exact *checkpoint inputs*; arguments produced inside the unit are links), together
   with the RNG and autocast state. Each decoder layer's own call is recorded the same way.
3. After forward the caller sets *actions*. exact -> H | L | R, compressed -> L | R, partial -> P | R,
   checkpoint -> R. L compresses the exact bundle now; R drops it now: memory is freed before
   backward starts.
4. In backward, unpacking an H handle returns the stored tensor; L decodes; R re-runs the
   unit's recorded calls (same inputs, RNG, autocast, precision) under a capture hook that
   collects the re-saved tensors in the same order. When every unit of a layer is R or P, one
   replay of the whole layer serves them all (the attention recompute produces the MLP's input,
   so the MLP's input need not be kept): with every unit R that is exactly decoder-layer
   checkpointing.

5. P (plan ``partial``): while the unit runs forward, torch's selective-checkpoint caching
   mode keeps the outputs of its matmuls and attention kernels (plan ``partial:core``: of its
   attention kernel alone; ``rules.partial_saves``) and the unit keeps no saved tensor;
   backward replays the unit under the matching cached mode, which hands those outputs back
   instead of recomputing them. The unit holds a fraction of its bytes and its replay costs a
   fraction of its time. Its cached mode is on exactly while the unit re-runs, as its caching
   mode was in forward (the mode replays the unit's op sequence), so a P unit can join its
   layer's replay.

H, P and R therefore give bitwise the gradients of plain autograd; only L approximates.
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Dict, List, Optional, Union

import torch
from torch.utils.checkpoint import get_device_states, set_device_states

from .codecs import DEFAULT_CODECS, get_codec
from .rules import partial_policy, reads_sign
from .saved import is_param
from .state import CHECKPOINT, PARTIAL, P, Call, Link, Replay, UnitState, iter_tensors, map_structure, storage_key
from .step import Step
from .units import discover_units
from .zero3 import replay_outside_coordinator


class _ReplayDone(Exception):
    """Raised from the capture hook once every target's bundle is rebuilt (as
    ``torch.utils.checkpoint`` stops early): the replay's remaining ops are never run."""


def _rng_state(args) -> tuple:
    devices, states = get_device_states(*list(iter_tensors(args)))
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


class RecoveryEngine:
    """Attach once to an HF decoder model (plain, peft, or inside a DeepSpeed engine); then
    ``with engine.step(plan): forward; loss; step.set_actions(...); loss.backward()``."""

    def __init__(
        self, model: torch.nn.Module, codec: str = DEFAULT_CODECS.split(",")[0], attention_core_exact: bool = True
    ):
        """``attention_core_exact``: L keeps the attention core's saved tensors exact
        (``rules.KEEP_EXACT``); off only to measure what that rule buys."""
        self.model = model
        self.layer_specs = discover_units(model)
        self.unit_names = [u.name for layer in self.layer_specs for u in layer.units]
        self.codec = get_codec(codec)
        self.attention_core_exact = attention_core_exact
        self.compiled = False  # unit forwards compiled (compiled.compile_units): L restores saved strides
        self.region_layers: set = set()  # ids of the layer modules with a compiled layer region (compiled.py)
        self._step: Optional["Step"] = None
        self._core_depth = self._child_depth = 0  # inside an attention module / inside one of its children
        self._sign_depth = 0  # inside a sign-reading activation (rules.SIGN_READING_ACTIVATIONS)
        self._hooks = []
        for layer in self.layer_specs:
            for unit in layer.units:
                if unit.attention is not None:
                    self._watch_attention_core(unit.attention)
        self._watch_sign_reading()
        for li, layer in enumerate(self.layer_specs):
            self._hooks.append(layer.module.register_forward_pre_hook(partial(self._layer_pre, li), with_kwargs=True))
            for ui, unit in enumerate(layer.units):
                last = len(unit.modules) - 1
                for k, m in enumerate(unit.modules):
                    self._hooks.append(
                        m.register_forward_pre_hook(partial(self._module_pre, li, ui, k), with_kwargs=True)
                    )
                    self._hooks.append(m.register_forward_hook(partial(self._module_post, li, ui, k, k == last)))

    def _watch_attention_core(self, attn: torch.nn.Module) -> None:
        """The attention core is the attention module's own code, outside its child modules
        (projections, q/k norms): whatever it saves is the kernel's (rules.KEEP_EXACT)."""

        def enter(name, *_):
            setattr(self, name, getattr(self, name) + 1)

        def leave(name, *_):
            setattr(self, name, getattr(self, name) - 1)

        self._hooks += [
            attn.register_forward_pre_hook(partial(enter, "_core_depth")),
            attn.register_forward_hook(partial(leave, "_core_depth")),
        ]
        for child in attn.children():
            self._hooks += [
                child.register_forward_pre_hook(partial(enter, "_child_depth")),
                child.register_forward_hook(partial(leave, "_child_depth")),
            ]

    def _watch_sign_reading(self) -> None:
        """Count when a sign-reading activation runs, so that L's codecs keep the signs of what
        it saves (rules.SIGN_READING_ACTIVATIONS); each module once, even when layers share it."""
        seen = set()
        for layer in self.layer_specs:
            for unit in layer.units:
                for sub in (s for m in unit.modules for s in m.modules()):
                    if reads_sign(sub) and id(sub) not in seen:
                        seen.add(id(sub))
                        self._hooks += [
                            sub.register_forward_pre_hook(lambda *_: self._count_sign(1)),
                            sub.register_forward_hook(lambda *_: self._count_sign(-1)),
                        ]

    def _count_sign(self, d: int) -> None:
        self._sign_depth += d

    def detach(self) -> None:
        """Remove the engine's hooks; the model behaves as before attaching."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def own_hooks(self) -> Dict[int, set]:
        """id of a hook dict of the model -> ids of this engine's hooks in it."""
        own: Dict[int, set] = {}
        for h in self._hooks:
            for ref in (h.hooks_dict_ref, *h.extra_dict_ref):
                d = ref()
                if d is not None:
                    own.setdefault(id(d), set()).add(h.id)
        return own

    def unhooked_copy(self) -> torch.nn.Module:
        """A deep copy of the model without this engine's hooks, for another engine or a
        compiled peer. A plain ``copy.deepcopy`` keeps them, bound to a copy of this engine:
        ``compile_units`` then sees hooks that are not its engine's and keeps per-unit regions,
        and ``torch.compile`` of the copy traces them into its graph."""
        import copy

        own = self.own_hooks()
        twin = copy.deepcopy(self.model)
        for m, c in zip(self.model.modules(), twin.modules()):
            for attr, d in vars(m).items():
                if isinstance(d, dict) and id(d) in own:
                    for k in own[id(d)]:
                        vars(c)[attr].pop(k, None)
        return twin

    def step(
        self,
        plan: Union[str, Dict[str, str], None] = None,
        actions: Union[str, Dict[str, str], None] = None,
        track_error: bool = True,
        track_tokens: bool = False,
        profile: bool = False,
        token_scores: Optional[torch.Tensor] = None,
        regions: bool = False,
    ) -> "Step":
        """One microbatch. ``plan``: a policy name (``all-h``, ``all-l``, ``all-r``), a
        ``{unit: exact|compressed|checkpoint}`` map, or an ``{unit: H|L|R}`` action map (then
        the plan is the cheapest that admits it). ``compressed`` and ``L`` may name their codec
        (``"compressed:bf16"``, ``"L:int8-g64"``; plain: the engine's ``codec``), so units
        can keep copies of different precision in one step. ``actions`` (optional) are applied before
        backward unless ``set_actions`` is called. ``track_error`` measures each L unit's
        reconstruction error (one extra decode per compressed tensor). A compressed plan may
        keep a share of a token-wise unit's rows exact (``"compressed@0.25"``, action
        ``"L@0.25"``): the rows of largest input norm x ``token_scores`` (``Step.keep_rows``).
        ``regions``: uniform layers run as their compiled layer regions (``compiled.py``)."""
        from .policies import resolve_plan

        plans, default_actions = resolve_plan(plan, self.unit_names)
        return Step(
            self,
            plans,
            actions if actions is not None else default_actions,
            track_error,
            track_tokens,
            profile,
            token_scores,
            regions,
        )

    # ---- forward hooks -------------------------------------------------------------------
    def _active(self) -> Optional["Step"]:
        st = self._step
        return st if st is not None and torch.is_grad_enabled() else None

    def _layer_pre(self, li, module, args, kwargs):
        st = self._active()
        if st is None or st.mode != "forward":
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

    def _module_pre(self, li, ui, k, module, args, kwargs):
        st = self._active()
        if st is None:
            return
        u = st.layers[li].units[ui]
        if st.mode == "replay":
            if k == 0:
                st.capture = u if u in st.targets else None
                if st.capture is u and u.action == P:  # serve its kept op outputs while it re-runs
                    st.cached = u
                    u.sac[1].__enter__()
                if st.profile:
                    u.timer = st.clock()
            return
        if k == 0:
            st.current = u
            u.outputs.clear()
            x = next(iter_tensors((args, kwargs)), None)
            if st.track_tokens and u.plan not in (CHECKPOINT, PARTIAL):  # exposure only matters where L may be chosen
                if x is not None and x.dim() >= 2:
                    u.token_norms = torch.linalg.vector_norm(x.detach(), dim=-1, dtype=torch.float32)
            if u.row_share is not None and x is not None and x.dim() >= 2:
                st.keep_rows(u, x)  # token L: this unit's exact rows, before it saves anything
            if st.layer_joint_plan[li]:
                return
            u.replay = Replay([], _rng_state((args, kwargs)), _autocast_state())
            if u.plan == PARTIAL:  # keep the expensive ops' outputs while the unit runs (closed in _module_post)
                from torch.utils.checkpoint import create_selective_checkpoint_contexts

                u.sac = create_selective_checkpoint_contexts(partial_policy(u.partial_level))
                u.sac[0].__enter__()
        if st.layer_joint_plan[li]:
            return

        def record(x):
            if isinstance(x, torch.Tensor) and id(x) in u.outputs:
                return Link(*u.outputs[id(x)])
            if isinstance(x, torch.Tensor):
                u.ext_keys.add(storage_key(x))
            return x

        u.replay.calls.append(
            Call(module, map_structure(args, record), map_structure(_drop_caches(kwargs, False), record))
        )

    def _module_post(self, li, ui, k, last, module, args, output):
        st = self._active()
        if st is None:
            return
        u = st.layers[li].units[ui]
        if st.mode == "replay":
            if last:
                st.capture = None
                self._close_cached(st)
                if st.profile and u.timer is not None:
                    u.replay_seconds += st.clock() - u.timer
                    u.timer = None
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
            if u.sac is not None and st.mode == "forward":
                u.sac[0].__exit__(None, None, None)

    # ---- recomputation -------------------------------------------------------------------
    def _recompute(self, st: "Step", u: UnitState) -> None:
        ls = st.layer_of[u.name]
        if u.replayed:
            raise RuntimeError(f"hilore: {u.name}: a saved tensor is missing after recomputation")
        targets = list(ls.units) if ls.joint else [u]  # joint: every unit is R or P
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

    @staticmethod
    def _close_cached(st: "Step") -> None:
        if st.cached is not None:
            st.cached.sac[1].__exit__(None, None, None)
            st.cached = None

    def _run_replay(self, st: "Step", replay: Replay, targets: List[UnitState]) -> None:
        """Re-run ``replay``'s calls, capturing the targets' saved tensors (a P target's kept
        op outputs are served by its cached mode while it runs: ``_module_pre``)."""
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
                stack.enter_context(replay_outside_coordinator([c.module for c in replay.calls]))
                stack.enter_context(torch.enable_grad())
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(partial(self._capture, st), lambda x: x))
                stack.callback(self._close_cached, st)  # the replay stopped inside a P unit (_ReplayDone)
                for call in replay.calls:
                    outs.append(call.module(*map_structure(call.args, resolve), **map_structure(call.kwargs, resolve)))
        except _ReplayDone:
            pass
        finally:
            if st.profile:
                now = st.clock()
                for x in targets:
                    if x.timer is not None:
                        x.replay_seconds += now - x.timer
                        x.timer = None
            st.mode, st.targets, st.capture = prev_mode, set(), None

    def _capture(self, st: "Step", t: torch.Tensor):
        u = st.capture
        if u is not None and not is_param(t, st):
            u.recomputed[u.capture_count] = t
            u.capture_count += 1
            if u.capture_count == u.n_saved and all(x.capture_count == x.n_saved for x in st.targets):
                raise _ReplayDone  # everything backward needs exists: skip the rest of the forward
        return None


__all__ = ["RecoveryEngine", "Step"]
