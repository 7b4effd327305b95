"""The memory budget B: bytes, or a ratio of the measured gc peak on the same workload."""

from __future__ import annotations

import re
from typing import Union

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


class BudgetError(ValueError):
    pass


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
    """B in bytes. Below what the workload needs with everything recomputed it cannot be met:
    stop with an error that says the minimum."""
    kind, value = parse_budget(spec)
    budget = int(value * gc_peak) if kind == "ratio" else int(value)
    need = max(gc_peak, base_peak)
    if budget < need:
        raise BudgetError(
            f"memory budget {budget / 2**20:.1f} MiB is below what gradient checkpointing needs on this workload; "
            f"the minimum is {need / 2**20:.1f} MiB ({need / gc_peak:.3f} x the gc peak of {gc_peak / 2**20:.1f} MiB)"
        )
    return budget
