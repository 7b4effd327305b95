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
  contiguous, so a strided one is copied back into its strides (``saved.unpack``; a tensor
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
"""
from __future__ import annotations

import functools

import torch

MARK = "_hilore_compiled"


def compile_units(engine, activation_budget: float = 1.0, **options) -> int:
    """Compile every unit module's ``forward`` in place (``options`` go to ``torch.compile``;
    ``activation_budget``: the partitioner's ``activation_memory_budget`` in [0, 1] for every
    unit graph); returns how many modules were compiled (a module already compiled is left as is)."""
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
    return n


def uncompile_units(engine) -> None:
    """Back to the modules' eager ``forward``."""
    for m in unit_modules(engine):
        if getattr(m.__dict__.get("forward"), MARK, False):
            del m.forward
    engine.compiled = False


def unit_modules(engine):
    seen = set()
    for layer in engine.layer_specs:
        for unit in layer.units:
            for m in unit.modules:
                if id(m) not in seen:
                    seen.add(id(m))
                    yield m
