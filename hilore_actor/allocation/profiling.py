"""Recovery utility and memory per unit, Eq. 9, measured and cached per shape class.

``dtau_u(a) = [T(all-R) - T(all-R but u -> a)]_+`` and ``dm_u(a)`` = the peak bytes u adds.
Measuring 2U+1 complete updates per shape is too slow for long microbatches, so the
difference is measured *in place*, paired within one run: under all-R the engine times each
unit's forward replay in backward (exactly the time H removes), and under all-L it times
each unit's encode + decode (what L adds back). Runs are warmed up and repeated; medians are
kept. Memory: the bytes each unit's bundle holds after forward, exact (H) or compressed (L),
from the engine's allocator-level accounting, counted as if the unit were the only one kept
(a storage shared by several units, such as an attention mask, is charged to each), plus, for an attention unit, the MLP input
that must then be kept for the MLP's own replay. Schedule validation (``schedule.py``)
measures the joint effect: real peak, and leave-one-out utility.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Dict, List

from ..grpo.microbatch import Microbatch


def shape_class(mb: Microbatch, bucket: int = 256) -> str:
    """Microbatches whose row count and token count round to the same bucket share costs."""
    rows, tokens = mb.input_ids.shape
    return f"{rows}x{-(-tokens // bucket) * bucket}"


@dataclass
class UnitCosts:
    shape: str
    base_seconds: float  # all-R update time
    base_peak: int  # all-R measured peak bytes (M_base)
    dtau: Dict[str, Dict[str, float]] = field(default_factory=dict)  # unit -> {"H": s, "L": s}
    dm: Dict[str, Dict[str, int]] = field(default_factory=dict)  # unit -> {"H": bytes, "L": bytes}


def profile_units(runner, mb: Microbatch, repeats: int = 3) -> UnitCosts:
    names = runner.engine.unit_names
    runner.run(mb, "all-r")  # warm-up
    runner.run(mb, "all-l")
    rec: Dict[str, List[float]] = {n: [] for n in names}
    codec: Dict[str, List[float]] = {n: [] for n in names}
    base: List[float] = []
    for _ in range(repeats):
        r = runner.run(mb, "all-r", profile=True)
        base.append(r.seconds)
        for n in names:
            rec[n].append(r.unit_seconds[n]["recompute"])
        l_run = runner.run(mb, "all-l", profile=True)
        for n in names:
            codec[n].append(l_run.unit_seconds[n]["codec"])
    exact = runner.run(mb, "all-h").bytes_alone
    comp = l_run.bytes_alone
    peak = runner.run(mb, "all-r", measure_peak=True).peak_bytes
    # keeping a layer's attention while its MLP is R breaks the shared layer replay: the MLP
    # then needs its own input kept (one hidden-state tensor)
    mixed = {}
    for layer in runner.engine.layer_specs:
        if [u.kind for u in layer.units] == ["attn", "mlp"]:
            mixed[layer.units[0].name] = layer.units[1].name
    mixed_bytes = {}
    if mixed:
        plan = {n: ("exact" if n in mixed else "checkpoint") for n in names}
        held = runner.run(mb, plan).bytes_by_unit
        mixed_bytes = {a: held[m]["checkpoint"] for a, m in mixed.items()}
    costs = UnitCosts(shape_class(mb), statistics.median(base), int(peak))
    for n in names:
        t = statistics.median(rec[n])
        extra = mixed_bytes.get(n, 0)
        costs.dtau[n] = {"H": t, "L": max(0.0, t - statistics.median(codec[n]))}
        costs.dm[n] = {"H": exact[n]["exact"] + extra, "L": comp[n]["compressed"] + comp[n]["exact"] + extra}
    return costs
