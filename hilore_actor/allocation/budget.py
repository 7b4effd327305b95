"""The memory budget B: bytes, or a ratio of the measured gc peak on the same workload."""

from __future__ import annotations

import re
from typing import Union

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


class BudgetError(ValueError):
    pass


class RoomBelowAllR(BudgetError):
    """The planner's room (B less the resident bytes) is below the all-R peak it profiled:
    ``need`` is that peak, in the room's bytes (the caller knows what B counts besides)."""

    def __init__(self, room: int, need: int, shape=None):
        super().__init__(f"room {room} B is below the all-R peak {need} B of shape {shape}")
        self.room, self.need = room, need


def parse_budget(spec: Union[str, float, int]) -> tuple:
    """``("ratio", 1.10)`` for ``1.10`` / ``"1.10"`` / ``"1.10x"``; ``("bytes", n)`` for an
    integer byte count or ``"12GiB"``-style sizes. Ratios are at most 100."""
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        return ("ratio", float(spec)) if spec <= 100 else ("bytes", int(spec))
    s = str(spec).strip().lower()
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*x?", s)
    if m and float(m.group(1)) <= 100:
        return ("ratio", float(m.group(1)))
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([kmg]i?b|b)?", s)
    if not m:
        raise BudgetError(f"cannot read budget {spec!r}: use a ratio of the gc peak (e.g. 1.10) or a size (e.g. 12GiB)")
    return ("bytes", int(float(m.group(1)) * _UNITS[m.group(2) or ""]))


def resolve_budget(spec, gc_peak: int, base_peak: int) -> int:
    """B in bytes: a ratio of ``gc_peak`` or a size. The floor is ``base_peak``, what the
    workload needs with every unit recomputed (the engine's all-R peak): the least any plan
    needs. B may be below gc's own peak (a ratio below 1) where the engine's all-R peak is
    lower, e.g. when full float32 logits set gc's peak and the chunked head does not make
    them: a run gradient checkpointing cannot make within B. Below the floor: an error that
    says the minimum."""
    kind, value = parse_budget(spec)
    if value <= 0:
        raise BudgetError(f"budget {spec!r}: give a ratio of the gc peak above 0 (e.g. 1.10) or a size (e.g. 12GiB)")
    budget = int(value * gc_peak) if kind == "ratio" else int(value)
    if budget < base_peak:
        raise BudgetError(below_minimum(budget, base_peak, gc_peak))
    return budget


def below_minimum(budget: int, need: int, gc_peak: int) -> str:
    """The one line of a budget below ``need``, what every unit recomputed (all-R) needs."""
    return (
        f"memory budget {budget / 2**20:.1f} MiB is below what this workload needs with every unit recomputed "
        f"(all-R, the least any plan needs); the minimum is {need / 2**20:.1f} MiB ({need / gc_peak:.3f} x the gc "
        f"peak of {gc_peak / 2**20:.1f} MiB)"
    )
