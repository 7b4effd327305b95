"""The recovery engine: per-unit store (H), compress (L) or recompute (R) of saved activations.

The mechanism is ``torch.utils.checkpoint``'s non-reentrant one, made per unit. Where it lives:

- ``engine.py`` (here): ``RecoveryEngine`` attaches to a model: it finds the units
  (``units.py``, ``structure.py``), makes the one ``Frame`` and registers the module hooks.
- ``hooks.py``: every hook and the ``Frame`` they share (where the engine is now): module hooks
  (which unit runs, how it was called), saved-tensor hooks (``pack``, ``unpack``) and the replay
  (``recompute``).
- ``step.py``: ``Step``, one microbatch: its records, the actions and what they release (L
  compresses, R drops), and what it measured.
- ``state.py``: the records: per unit what it may keep, what forward saved, how backward
  rebuilds it, what was measured; the bytes each unit holds.
- ``labels.py``: plans and actions (``exact``, ``L:bf16``, ``compressed@0.25``, ``P:core``) and
  their grammar. ``rules.py``: what L keeps exact, what P keeps. ``codecs.py``: L's codecs.
  ``policies.py``: named policies and baselines. ``compiled.py``: compiled units and layer
  regions. ``zero3.py``: ZeRO-3 parameters in the hooks and in replays.

Rules (cited elsewhere by number):

1. ``saved_tensors_hooks`` intercept every tensor autograd saves. Module hooks on each unit's
   modules tell which unit is running, so each saved tensor becomes a handle ``(unit, index)``;
   the unit's store keeps it exact, compressed, or not at all, as its pre-forward *plan* says
   (``hooks.pack``). Parameters pass through untouched (never copied, never counted).
2. While a unit runs, its module calls are recorded (arguments that come from outside the unit
   are its exact *checkpoint inputs*; arguments produced inside the unit are links), together
   with the RNG and autocast state. Each decoder layer's own call is recorded the same way.
3. After forward the caller sets *actions*. exact -> H | L | R, compressed -> L | R, partial -> P | R,
   checkpoint -> R. L compresses the exact bundle now; R drops it now: memory is freed before
   backward starts (``Step.set_actions``).
4. In backward, unpacking an H handle returns the stored tensor; L decodes; R re-runs the
   unit's recorded calls (same inputs, RNG, autocast, precision) under a capture hook that
   collects the re-saved tensors in the same order (``hooks.recompute``). When every unit of a
   layer is R or P, one replay of the whole layer serves them all (the attention recompute
   produces the MLP's input, so the MLP's input need not be kept): with every unit R that is
   exactly decoder-layer checkpointing.
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

from functools import partial
from typing import Dict, Optional, Union

import torch

from . import hooks
from .codecs import DEFAULT_CODECS, get_codec
from .rules import reads_sign
from .step import Step
from .units import discover_units


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
        self.unit_specs = {u.name: u for layer in self.layer_specs for u in layer.units}  # name -> its UnitSpec
        self.unit_names = list(self.unit_specs)
        self.codec = get_codec(codec)
        self.attention_core_exact = attention_core_exact
        self.compiled = False  # unit forwards compiled (compiled.compile_units): L restores saved strides
        self.region_layers: set = set()  # ids of the layer modules with a compiled layer region (compiled.py)
        self.frame = hooks.Frame()  # where the engine is now: the one object its hooks share
        self._hooks = []
        for layer in self.layer_specs:
            for unit in layer.units:
                if unit.attention is not None:
                    self._watch_attention_core(unit.attention)
        self._watch_sign_reading()
        f = self.frame
        for li, layer in enumerate(self.layer_specs):
            pre = partial(hooks.layer_pre, f, li)
            self._hooks.append(layer.module.register_forward_pre_hook(pre, with_kwargs=True))
            for ui, unit in enumerate(layer.units):
                last = len(unit.modules) - 1
                for k, m in enumerate(unit.modules):
                    self._hooks += [
                        m.register_forward_pre_hook(partial(hooks.module_pre, f, li, ui, k), with_kwargs=True),
                        m.register_forward_hook(partial(hooks.module_post, f, li, ui, k, k == last)),
                    ]

    def _watch(self, module: torch.nn.Module, depth: str) -> None:
        """Count in ``frame.<depth>`` while ``module`` runs."""
        self._hooks += [
            module.register_forward_pre_hook(partial(hooks.count_depth, self.frame, depth, 1)),
            module.register_forward_hook(partial(hooks.count_depth, self.frame, depth, -1)),
        ]

    def _watch_attention_core(self, attn: torch.nn.Module) -> None:
        """The attention core is the attention module's own code, outside its child modules
        (projections, q/k norms): whatever it saves is the kernel's (rules.KEEP_EXACT)."""
        self._watch(attn, "core_depth")
        for child in attn.children():
            self._watch(child, "child_depth")

    def _watch_sign_reading(self) -> None:
        """Count when a sign-reading activation runs, so that L's codecs keep the signs of what
        it saves (rules.SIGN_READING_ACTIVATIONS); each module once, even when layers share it."""
        seen = set()
        for layer in self.layer_specs:
            for unit in layer.units:
                for sub in (s for m in unit.modules for s in m.modules()):
                    if reads_sign(sub) and id(sub) not in seen:
                        seen.add(id(sub))
                        self._watch(sub, "sign_depth")

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
        compiled peer. A plain ``copy.deepcopy`` keeps them, bound to a copy of this engine's frame:
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


__all__ = ["RecoveryEngine", "Step"]
