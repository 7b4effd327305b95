"""Named policies and how they map to pre-forward plans and post-forward actions.

``no-gc`` (store everything, no engine) and ``gc`` (HF decoder-layer checkpointing, what
OpenRLHF runs; torch's per layer where HF has none) are baselines applied to the model itself;
``all-h``, ``all-l``, ``all-r`` and explicit maps run through the engine.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Tuple, Union

from .labels import (
    ACTIONS,
    CHECKPOINT,
    COMPRESSED,
    EXACT,
    PARTIAL,
    PLANS,
    SEP,
    H,
    L,
    P,
    R,
    action_for_plan,
    check_labels,
    plan_for_label,
    split_label,
)

ENGINE_POLICIES = {
    "all-h": (EXACT, H),
    "all-l": (COMPRESSED, L),
    "all-p": (PARTIAL, P),
    "all-p:core": (PARTIAL + SEP + "core", P + SEP + "core"),
    "all-r": (CHECKPOINT, R),
}
BASELINES = ("no-gc", "gc")


def _check_names(mapping: Dict[str, str], unit_names) -> None:
    unknown = sorted(set(mapping) - set(unit_names))
    if unknown:
        raise ValueError(f"unknown unit(s) {unknown}; units are e.g. {list(unit_names)[:4]}")


def resolve_plan(
    plan: Union[str, Dict[str, str], None], unit_names
) -> Tuple[Dict[str, str], Union[str, Dict[str, str], None]]:
    """(plan per unit, default actions) for ``engine.step(plan)``."""
    if plan is None:
        return {n: EXACT for n in unit_names}, None
    if isinstance(plan, str):
        if plan in BASELINES:
            raise ValueError(
                f"{plan!r} is a baseline applied to the model (see hilore_actor.recovery.apply_baseline), "
                "not an engine policy"
            )
        if plan not in ENGINE_POLICIES:
            raise ValueError(f"unknown policy {plan!r}; engine policies: {sorted(ENGINE_POLICIES)}")
        p, a = ENGINE_POLICIES[plan]
        return {n: p for n in unit_names}, {n: a for n in unit_names}
    _check_names(plan, unit_names)
    values = set(plan.values())
    bases = {split_label(v)[0] for v in values}
    check_labels(values)
    if bases <= set(PLANS):
        return {n: plan.get(n, EXACT) for n in unit_names}, None
    if bases <= set(ACTIONS):
        return {n: plan_for_label(plan.get(n, H)) for n in unit_names}, {n: plan.get(n, H) for n in unit_names}
    raise ValueError(
        f"a plan maps units to one of {PLANS} (or actions {ACTIONS}; L and compressed may name a codec, "
        f"e.g. L:bf16), got {sorted(values)}"
    )


def resolve_actions(actions: Union[str, Dict[str, str], None], plans: Dict[str, str]) -> Dict[str, str]:
    """Actions per unit: a policy name, a partial ``{unit: H|L|R}`` map, or None (defaults)."""
    if actions is None:
        return {n: action_for_plan(p) for n, p in plans.items()}
    if isinstance(actions, str):
        if actions not in ENGINE_POLICIES:
            raise ValueError(f"unknown policy {actions!r}; engine policies: {sorted(ENGINE_POLICIES)}")
        return {n: ENGINE_POLICIES[actions][1] for n in plans}
    _check_names(actions, plans)
    bad = {a for a in actions.values() if split_label(a)[0] not in ACTIONS}
    if bad:
        raise ValueError(f"actions must be one of {ACTIONS} (L may name a codec, e.g. L:bf16), got {sorted(bad)}")
    check_labels(actions.values())
    return {n: actions.get(n, action_for_plan(p)) for n, p in plans.items()}


def apply_baseline(model, name: str) -> None:
    """``gc``: HF gradient checkpointing on every decoder layer (non-reentrant, as OpenRLHF
    uses it), or, for an architecture transformers has none for, ``torch.utils.checkpoint``
    around each decoder layer's forward (the same mechanism); ``no-gc``: off."""
    # transformers >= 5.2x renamed the methods (activation_checkpointing_*); 5.15 (OpenRLHF
    # 0.11.2's pin) has gradient_checkpointing_*. Same mechanism either way.
    kwargs = {"use_reentrant": False}
    if name not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}; choose one of {BASELINES}")
    if not getattr(model, "supports_gradient_checkpointing", True):
        _checkpoint_layers(model, name == "gc")
    elif name == "gc":
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()


def _checkpoint_layers(model, on: bool) -> None:
    """``gc`` where transformers has none: each decoder layer's ``forward`` (the engine's
    ``find_decoder_layers``) under non-reentrant ``torch.utils.checkpoint``, as HF's
    ``GradientCheckpointingLayer`` does it; ``on=False`` restores the class's forward."""
    import functools

    from torch.utils.checkpoint import checkpoint

    from .units import find_decoder_layers

    found = find_decoder_layers(model)
    if found is None:
        raise ValueError(f"{type(model).__name__}: no decoder layers found to checkpoint")
    from .compiled import has_region

    for layer in found[1]:
        if has_region(layer):  # a compiled layer region: its forward checkpoints the region itself
            layer.gradient_checkpointing = on
            layer._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)
        elif on and "forward" not in vars(layer):
            layer.forward = functools.partial(checkpoint, type(layer).forward.__get__(layer), use_reentrant=False)
        elif not on and "forward" in vars(layer):
            del layer.forward


def stores_nothing(plan: Dict[str, str]) -> bool:
    """True when every unit is planned ``checkpoint``: the run is plain layer checkpointing,
    and torch's own (``layer_checkpointing``) does it without the engine's bookkeeping."""
    return bool(plan) and all(q == CHECKPOINT for q in plan.values())


@contextlib.contextmanager
def layer_checkpointing(model):
    """HF decoder-layer checkpointing (``gc``) for the block, off again afterwards: what an
    all-R plan runs, bitwise the same gradients as the engine's all-R and as no checkpointing.
    A wrapper with a ``module`` (DeepSpeed's engine) is unwrapped to the model it holds."""
    model = getattr(model, "module", model)
    apply_baseline(model, "gc")
    try:
        yield
    finally:
        apply_baseline(model, "no-gc")
