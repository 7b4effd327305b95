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
    around each decoder layer's forward (the same mechanism); ``no-gc``: off. Either leaves the
    input embedding's hooks as it found them (``_hooks_as_found``): turned on and off per all-R
    microbatch, HF's would otherwise add one each time."""
    # transformers >= 5.2x renamed the methods (activation_checkpointing_*); 5.15 (OpenRLHF
    # 0.11.2's pin) has gradient_checkpointing_*. Same mechanism either way.
    kwargs = {"use_reentrant": False}
    if name not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}; choose one of {BASELINES}")
    if not getattr(model, "supports_gradient_checkpointing", True):
        _checkpoint_layers(model, name == "gc")
    elif name == "gc":
        with _hooks_as_found(model, keep=_reentrant):
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        with _hooks_as_found(model):
            (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()


# A module's hook tables (torch.nn.Module) and the attributes transformers keeps its input-grad hooks in.
_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)
_HOOK_ATTRS = ("_require_grads_hooks", "_require_grads_hook")


@contextlib.contextmanager
def _hooks_as_found(model, keep=None):
    """The hooks of the modules transformers hooks on a checkpointing toggle, and its record of
    them, as they were before the block (unless ``keep(model)`` after it). transformers (5.2x)
    registers a forward hook on the input embedding on every enable whose model reads
    ``input_ids`` (``enable_input_require_grads``: the embedding's output made to require grad),
    overwriting the attribute that would remove the previous one, and removes them on disable
    only for a model with ``_hf_peft_config_loaded`` (peft's ``get_peft_model`` does not set it):
    toggled per all-R microbatch, the hooks pile up, each forward calls them all, and layer 0's
    input gradient is computed for nothing. Only reentrant checkpointing needs the hook: its
    output requires grad only when an input does (a frozen embedding under LoRA: the adapters
    inside get no gradient). ``gc`` is non-reentrant, which reaches them whatever the input, so
    the embedding output requires grad exactly when it does without checkpointing; where a
    model's own enable made it reentrant anyway (``keep=_reentrant``), transformers' hooks stay.
    A hook the model had before (peft's, or its owner's ``enable_input_require_grads``) stays,
    disable included. The modules are the ones ``enable_input_require_grads`` walks: each
    submodule with ``get_input_embeddings`` and the embedding it returns (one pass over the
    modules; a copy of every module's tables would cost more than the toggle itself)."""
    owners, seen = [], {}
    for m in model.modules():
        if getattr(type(m), "get_input_embeddings", None) is None:
            continue
        owners.append(m)
        try:
            emb = m.get_input_embeddings()
        except Exception:  # noqa: BLE001  no embedding here to watch
            continue
        if hasattr(emb, "_forward_hooks"):  # a module
            seen[id(emb)] = emb
    tables = [(e, [dict(getattr(e, k)) for k in _HOOK_DICTS]) for e in seen.values()]
    attrs = [(m, {a: vars(m)[a] for a in _HOOK_ATTRS if a in vars(m)}) for m in owners]
    try:
        yield
    finally:
        if keep is None or not keep(model):
            for e, before in tables:
                for k, was in zip(_HOOK_DICTS, before):
                    now = getattr(e, k)
                    if list(now.items()) != list(was.items()):
                        now.clear()  # in place: handles held elsewhere keep working on the same table
                        now.update(was)
            for m, was in attrs:
                for a in _HOOK_ATTRS:
                    if a in was:
                        vars(m)[a] = was[a]
                    else:
                        vars(m).pop(a, None)


def _reentrant(model) -> bool:
    """Whether a layer checkpoints reentrantly (torch's default where ``use_reentrant`` is unset)."""
    return any(
        vars(m).get("gradient_checkpointing") is True
        and getattr(vars(m).get("_gradient_checkpointing_func"), "keywords", {}).get("use_reentrant") is not False
        for m in model.modules()
    )


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
