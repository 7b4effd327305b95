"""DeepSpeed ZeRO-3 parameters seen by saved-tensor hooks.

Under ZeRO-3 a parameter's ``.data`` is a gathered full tensor only while its module runs;
otherwise it is empty (``ds_status == NOT_AVAILABLE``). Autograd normally hands a saved
parameter back to backward as the same Python object, and DeepSpeed's
``LinearFunctionForZeroStage3.backward`` checks ``ds_status`` on it to re-gather. Once
saved-tensor hooks are active (ours, or ``torch.utils.checkpoint``'s), autograd returns a fresh
alias instead, without those attributes, so DeepSpeed would read an empty weight. When a
partitioned parameter is unpacked we therefore gather it, take an alias of the full data and
re-partition at once: the alias keeps the full weight alive only while backward uses it, as
DeepSpeed's own gather would. The module needs no deepspeed import: it is duck-typed.
"""
from __future__ import annotations

import contextlib

import torch


def is_partitioned(t: torch.Tensor) -> bool:
    status = getattr(t, "ds_status", None)
    return status is not None and getattr(status, "name", None) == "NOT_AVAILABLE"


def gathered_alias(param: torch.Tensor) -> torch.Tensor:
    """A detached alias of the full ZeRO-3 parameter; the parameter itself stays partitioned."""
    param.all_gather()
    try:
        return param.detach()
    finally:
        param.partition()


@contextlib.contextmanager
def residency_preserved(modules):
    """Leave ZeRO-3 parameter residency as it was around a replay in backward.

    A replay re-runs module forwards, and DeepSpeed's forward hooks gather on entry and release
    on exit. In backward, DeepSpeed has already gathered the parameters of the module whose
    backward is running; the replay's release would partition them under it (its gradient then
    lands on an empty parameter). So: re-gather what the replay released, and release what it
    gathered, restoring each parameter's set of active submodules.
    """
    params = {id(p): p for m in modules for p in m.parameters() if hasattr(p, "ds_status")}
    before = {k: (p.ds_status.name, set(p.ds_active_sub_modules)) for k, p in params.items()}
    try:
        yield
    finally:
        for k, p in params.items():
            status, active = before[k]
            now = p.ds_status.name
            if status == "AVAILABLE" and now == "NOT_AVAILABLE":
                p.all_gather()
            elif status == "NOT_AVAILABLE" and now == "AVAILABLE" and not p.ds_active_sub_modules:
                p.partition()
            p.ds_active_sub_modules.clear()
            p.ds_active_sub_modules.update(active)
