"""DeepSpeed ZeRO-3 parameters seen by saved-tensor hooks.

Under ZeRO-3 a parameter's ``.data`` is a gathered full tensor only while its module runs;
otherwise it is empty (``ds_status == NOT_AVAILABLE``). Autograd normally hands a saved
parameter back to backward as the same Python object, and DeepSpeed's
``LinearFunctionForZeroStage3.backward`` checks ``ds_status`` on it to re-gather. Once
saved-tensor hooks are active (ours, or ``torch.utils.checkpoint``'s), autograd returns a fresh
alias instead, without those attributes, so DeepSpeed would read an empty weight. When a
partitioned parameter is unpacked we therefore gather it, take an alias of the full data and
re-partition at once: the alias keeps the full weight alive only while backward uses it, as
DeepSpeed's own gather would. A replay in backward runs with DeepSpeed's module hooks set aside
(``replay_outside_coordinator``). The module needs no deepspeed import: it is duck-typed.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch.utils._python_dispatch import _disable_current_modes


def is_partitioned(t: torch.Tensor) -> bool:
    status = getattr(t, "ds_status", None)
    return status is not None and getattr(status, "name", None) == "NOT_AVAILABLE"


def gather_coalesced(params: list) -> None:
    """Gather partitioned ZeRO-3 parameters in one asynchronous collective, waited on the compute stream.

    DeepSpeed's ``param.all_gather(param_list=...)`` issues one collective per parameter and ends in
    ``get_accelerator().synchronize()``: a device-wide stall inside backward that also stops the
    gradient reduce-scatter from overlapping compute. ``all_gather_coalesced`` (what DeepSpeed's own
    coordinator uses) flattens the list into one collective per dtype; its handle's ``wait`` makes the
    current stream wait for it, the host does not. It orders the list by ``ds_id`` itself, so every rank
    gathers the same flat layout.
    """
    if params:
        params[0].all_gather_coalesced(params).wait()


def gathered_alias(param: torch.Tensor) -> torch.Tensor:
    """A detached alias of the full ZeRO-3 parameter; the parameter itself stays partitioned."""
    gather_coalesced([param])
    try:
        return param.detach()
    finally:
        param.partition()


def _offload(modules):
    """DeepSpeed's ZeRO-3 offload object (``DeepSpeedZeRoOffload``) whose module hooks are on ``modules``,
    or None: its pre-forward hook is a closure over it (``_register_deepspeed_module``)."""
    for m in modules:
        for fn in m._forward_pre_hooks.values():
            fn = inspect.unwrap(fn)
            cells = getattr(fn, "__closure__", None) or ()
            for name, cell in zip(getattr(getattr(fn, "__code__", None), "co_freevars", ()), cells):
                if name == "self" and hasattr(cell.cell_contents, "pre_sub_module_forward_function"):
                    return cell.cell_contents
    return None


@contextlib.contextmanager
def replay_outside_coordinator(modules):
    """Run a replay in backward with DeepSpeed's module hooks set aside on its modules.

    DeepSpeed's coordinator records the order of module fetches over a step and prefetches by it
    from the next step on. A replay's forwards inside backward would enter that order wherever the
    plan has an R unit: a plan that changes per microbatch would invalidate the trace (no prefetch,
    the next step records again, order checks across ranks). Its hooks would also release, under
    the module whose backward is running, parameters that module needs, and reset the backward
    counters of the replayed modules. So here each module, as it starts, gathers its partitioned
    parameters itself in one coalesced collective (``gather_coalesced``; waiting for those in flight,
    which the coordinator gathered, counts and will release) and partitions them as it ends (or as
    the replay ends, when it stopped early). The coordinator does not run meanwhile, so its count of
    available parameters is exact whenever it reads it. Every rank replays the same units, so the
    gathers stay collective.
    """
    mods = list({id(s): s for m in modules for s in m.modules()}.values())
    if not any(hasattr(p, "ds_id") for m in mods for p in m.parameters(recurse=False)):
        yield
        return
    off = _offload(mods)
    if off is None:
        raise RuntimeError("hilore: ZeRO-3 parameters, but DeepSpeed's module hooks were not found on the units")
    fetch = {h.id for h in off.forward_hooks}  # pre- and post-forward
    ours = fetch | {h.id for h in off.backward_hooks}
    inflight = getattr(off.module, "ds_inflight_param_registry", {})
    held = {}  # module -> the parameters its pre-forward gathered

    def gather(module, *_):
        params = dict.fromkeys(module.parameters(recurse=getattr(module, "_z3_leaf", False)))
        params.update(dict.fromkeys(p for _, p in module.ds_external_parameters()))
        with torch.no_grad(), _disable_current_modes():  # a P unit's cached mode would look these ops up
            for p in params:
                if p.ds_status.name == "INFLIGHT":
                    if p not in inflight:
                        raise RuntimeError(f"hilore: ZeRO-3 parameter {p.ds_id} in flight without a handle")
                    inflight.pop(p).wait()
            todo = [p for p in params if p.ds_status.name == "NOT_AVAILABLE"]
            if todo:
                gather_coalesced(todo)
                held.setdefault(module, []).extend(todo)

    def release(module, *_):
        done = [p for p in held.pop(module, ()) if p.ds_status.name == "AVAILABLE" and not p.ds_active_sub_modules]
        if done:
            with torch.no_grad(), _disable_current_modes():
                done[0].partition(param_list=done)

    saved = [
        (d, list(d.items()), gather if d is m._forward_pre_hooks else release)
        for m in mods
        for d in (m._forward_pre_hooks, m._forward_hooks)
        if ours & d.keys()
    ]
    try:
        for d, items, fn in saved:  # DeepSpeed's forward hooks -> gather, release; its backward hooks left out
            d.clear()
            d.update((k, fn if k in fetch else f) for k, f in items if k not in ours or k in fetch)
        yield
    finally:
        for d, items, _ in saved:
            d.clear()
            d.update(items)
        for m in list(held):  # a replay that stopped early (``_ReplayDone``) skipped these post-forwards
            release(m)
