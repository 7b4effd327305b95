"""Recovery units with compiled forwards: inductor's fused kernels, with H/L/P/R still chosen
per unit and per microbatch (docs/compile.md has the torch 2.13 source behind each point).

``compile_units(engine)`` replaces the ``forward`` of every module of every recovery unit (the
norms, the attention, the MLP) by ``torch.compile`` of it, in place (regional compilation):

- The module object and its hooks stay eager: the engine's pre/post hooks still say which unit
  runs, and an R replay calls the module, hence the same compiled code. Hooks of a unit
  module's *children* are traced into its graph.
- A compiled region is one ``autograd.Function``: saved-tensor hooks are not traced; at run
  time they fire once per tensor the partitioner saved. So H keeps the partitioner's saved
  set (smaller than eager's), R re-runs the compiled forward and gets the same tensors back
  (one graph per grad mode: replays run under ``enable_grad``), L compresses what it saved.
- L, attention: pack fires after the region ran, so every tensor an attention unit saves is
  attention core to the engine's depth counters and stays exact; L on an attention unit
  costs like H and the planner, which measures bytes per option, does not take it. MLP units
  compress as in eager.
- L, layout: the compiled backward asserts each saved tensor's strides; a decoded copy is
  contiguous, so a strided one is copied back into its strides (``hooks.unpack``; a tensor
  whose elements overlap, e.g. expanded, stays exact).
- P keeps what the selective-checkpoint mode sees: inductor's fallback kernels (SDPA's) but
  no fused op; P on an MLP unit keeps nothing and costs like R (measured, like every option).
- Donated buffers are off: the compiled backward may otherwise write into a saved intermediate
  that the engine shares between layers (equal masks, ``Step.canonical``).
- Activation budget: torch's ``activation_memory_budget`` for each unit's graph (default 1.0,
  its partitioner's fastest cut). Below 1 the partitioner recomputes cheap fused ops in the
  unit's compiled backward and saves less, so H keeps fewer bytes per unit (exactly, still):
  the trade whole-model compilation (the ``compile-budget`` peer) makes across one graph,
  made here inside each unit, under HiLoRe's H/L/R choice.
- Token counts: automatic dynamic shapes. The first count compiles a static graph, a second
  one a graph dynamic in that dimension, which serves every later count: at most two
  compiles per module class and grad mode, so warm up with two counts before timing.

Layer regions (``layer_regions=True``): each decoder layer also gets one compiled region of
its whole forward, which fuses across its units (norms into projections, the residual adds)
as whole-model compilation does. Pack fires once per tensor the region saved, after it ran,
with no trace of which unit saved it, so a region serves only a *uniform* layer:

- every unit planned ``exact`` (and kept H): the region runs under plain autograd; what it
  saves passes the engine's pack untouched, but for equal attention masks, shared between
  layers as in per-unit mode (``Step.canonical``, hence donated buffers stay off);
- every unit planned ``checkpoint``: the region runs under ``torch.utils.checkpoint``, whose
  recomputation re-runs the same compiled graph (bitwise the forward's tensors);
- any other layer (an L, P or mixed unit) runs its units' regions as above.

A step uses regions only when asked (``engine.step(..., regions=True)``: planned training
microbatches), so profiling and calibration keep measuring units one by one. Outside a step
the layer runs as one region, under HF's layer checkpointing when that is on: the compiled
model's no-gc and gc (``gc+compile``) are then the same graphs H and R regions run. While a
region runs, the hooks of the layer's submodules and their compiled unit forwards are set
aside, so the region traces the eager code of the whole layer; a layer whose submodules carry
hooks other than the engine's (ZeRO-3's, FSDP's) keeps per-unit regions.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Dict, Optional, Set

import torch

from .hooks import active_step
from .labels import H, R, region_kind

MARK = "_hilore_compiled"
REGION = "_hilore_region"  # a decoder layer's dispatching forward (its compiled region's owner)
HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
# what Dynamo reads to decide whether a module call has hooks (torch/_dynamo/variables/nn_module.py:1138-1156)
SET_ASIDE = HOOK_DICTS + (
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)
_NO_HOOKS: dict = {}  # set in place of a submodule's hook dicts while a region runs (never filled)


def compile_units(engine, activation_budget: float = 1.0, layer_regions: bool = False, **options) -> int:
    """Compile every unit module's ``forward`` in place (``options`` go to ``torch.compile``;
    ``activation_budget``: the partitioner's ``activation_memory_budget`` in [0, 1] for every
    unit graph); ``layer_regions``: also one region per decoder layer (module doc). Returns how
    many modules were compiled (a module already compiled is left as is)."""
    import torch._functorch.config as fconf

    if not 0.0 <= activation_budget <= 1.0:
        raise ValueError(f"the compiled units' activation budget must lie in [0, 1], got {activation_budget}")
    n = 0
    for m in unit_modules(engine):
        if getattr(m.__dict__.get("forward"), MARK, False):
            continue
        compiled = torch.compile(m.forward, **options)

        @functools.wraps(compiled)
        def forward(*args, _compiled=compiled, **kwargs):
            with fconf.patch(donated_buffer=False, activation_memory_budget=activation_budget):
                return _compiled(*args, **kwargs)

        setattr(forward, MARK, True)
        m.forward = forward
        n += 1
    engine.compiled = True
    if layer_regions:
        own = engine.own_hooks()
        for layer in engine.layer_specs:
            if has_region(layer.module):
                continue
            foreign = _foreign_hooks(layer.module, own)
            if foreign or "forward" in vars(layer.module):
                why = (
                    f"its submodule {foreign} carries hooks other than the recovery engine's, which a layer region "
                    "would set aside"
                    if foreign
                    else "its forward is already replaced (a wrapper of its own)"
                )
                warnings.warn(f"hilore: {layer.name} keeps per-unit compiled regions: {why}")
                continue
            _install_region(layer.module, activation_budget, options)
            n += 1
    engine.region_layers = {id(layer.module) for layer in engine.layer_specs if has_region(layer.module)}
    return n


def uncompile_units(engine) -> None:
    """Back to the modules' eager ``forward`` (and the layers' own, without regions)."""
    for m in unit_modules(engine):
        if getattr(m.__dict__.get("forward"), MARK, False):
            del m.forward
    for layer in engine.layer_specs:
        if has_region(layer.module):
            del layer.module.forward
            del layer.module.__dict__[REGION]
    engine.compiled, engine.region_layers = False, set()


def region_units(engine, plan: Dict[str, str]) -> Set[str]:
    """The units of ``plan`` that a planned step runs inside an H layer region: their action
    is fixed to H (an online chooser must not pick L or R for them after forward)."""
    out: Set[str] = set()
    for layer in getattr(engine, "layer_specs", ()) if getattr(engine, "region_layers", None) else ():
        names = [u.name for u in layer.units]
        if id(layer.module) in engine.region_layers and region_kind(plan.get(n) for n in names) == H:
            out.update(names)
    return out


def has_region(layer: torch.nn.Module) -> bool:
    """Whether ``layer`` has a compiled layer region (its forward dispatches to it)."""
    return REGION in vars(layer)


def _foreign_hooks(layer: torch.nn.Module, own: Dict[int, set]) -> Optional[str]:
    """The name of a submodule of ``layer`` with a hook the engine did not register, if any."""
    for name, sub in layer.named_modules():
        if sub is layer:
            continue
        for attr in HOOK_DICTS:
            d = getattr(sub, attr, None) or {}
            if set(d) - own.get(id(d), set()):
                return name
    return None


@contextlib.contextmanager
def _hooks_set_aside(subs):
    """While a layer region runs (and while checkpoint re-runs it): the submodules without
    hooks and without their compiled unit forwards, so the region traces one eager layer."""
    kept = []
    for m in subs:
        kept.append((m, [m.__dict__[a] for a in SET_ASIDE], m.__dict__.pop("forward", None)))
        for a in SET_ASIDE:
            m.__dict__[a] = _NO_HOOKS
    try:
        yield
    finally:
        for m, dicts, fwd in kept:
            for a, d in zip(SET_ASIDE, dicts):
                m.__dict__[a] = d
            if fwd is not None:
                m.__dict__["forward"] = fwd


def _install_region(mod: torch.nn.Module, activation_budget: float, options) -> None:
    """Make ``mod.forward`` dispatch between its compiled layer region and its eager forward."""
    import torch._functorch.config as fconf
    from torch.utils.checkpoint import checkpoint

    cls_forward = type(mod).forward
    eager = cls_forward.__get__(mod)  # HF's layer-checkpointing wrapper included
    code = getattr(cls_forward, "__code__", None)  # HF's wrapper checkpoints by its own flag: the region does that here
    inner = (
        cls_forward.__wrapped__ if code is not None and code.co_name == "forward_with_checkpointing" else cls_forward
    )
    compiled = torch.compile(inner.__get__(mod), **options)
    subs = [m for m in mod.modules() if m is not mod]

    def region(*args, **kwargs):
        with _hooks_set_aside(subs), fconf.patch(donated_buffer=False, activation_memory_budget=activation_budget):
            return compiled(*args, **kwargs)

    def forward(*args, **kwargs):
        st = active_step()
        if st is not None and torch.is_grad_enabled() and id(mod) in st.region:
            kind = st.region[id(mod)]
            if kind is None:
                return eager(*args, **kwargs)  # a mixed layer: its units' own regions, under the engine
            if kind == R:
                return checkpoint(region, *args, use_reentrant=False, **kwargs)
            st.frame.in_region = True  # pack: masks shared between layers, the rest untouched
            try:
                return region(*args, **kwargs)
            finally:
                st.frame.in_region = False
        if (
            getattr(mod, "gradient_checkpointing", False) and mod.training and torch.is_grad_enabled()
        ):  # HF's or policies
            return mod._gradient_checkpointing_func(functools.partial(region, **kwargs), *args)  # gc+compile
        return region(*args, **kwargs)

    mod.forward = forward
    mod.__dict__[REGION] = region


def unit_modules(engine):
    seen = set()
    for layer in engine.layer_specs:
        for unit in layer.units:
            for m in unit.modules:
                if id(m) not in seen:
                    seen.add(id(m))
                    yield m
