"""Interleaved timing: every method of a phase once per repeat, order alternating (A B ... B A)
so slow drift of the machine cancels; compiled peers each get a phase of their own beside gc
(only one compiled model may be live at a time, ``peers.compiled_runner``)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional


@dataclass
class Timings:
    seconds: List[float] = field(default_factory=list)
    cpu_seconds: List[float] = field(default_factory=list)
    overhead: List[float] = field(default_factory=list)
    actions: Counter = field(default_factory=Counter)
    gc_seconds: List[float] = field(default_factory=list)  # gc's times paired with these, repeat by repeat
    taken: Dict[str, Counter] = field(default_factory=dict)  # unit -> action labels over the timed updates


def timing_phase(group, updates, repeats: int, label: str, log, out: Dict[int, Timings]) -> None:
    for m in group:  # warm-up, never kept
        m.update(updates[0])
    for rep in range(repeats):
        order = group if rep % 2 == 0 else list(reversed(group))
        for m in order:
            u = m.update(updates[rep % len(updates)])
            t = out.setdefault(id(m), Timings())
            t.seconds.append(u["seconds"])
            t.cpu_seconds.append(u["cpu_seconds"])
            t.overhead.append(u["overhead"])
            t.actions.update(u["actions"])
            for n, c in u.get("taken", {}).items():
                t.taken.setdefault(n, Counter()).update(c)
        log(f"[bench] {label}: repeat {rep + 1}/{repeats} done")


def time_methods(entries, updates, repeats: int, log) -> Dict[int, Timings]:
    """Times of every entry; each keeps the gc times of its own phase in ``gc_seconds``."""
    out: Dict[int, Timings] = {}
    gc: Optional[object] = next((m for m in entries if m.name == "gc"), None)
    main = [m for m in entries if not m.isolated]
    timing_phase(main, updates, repeats, "main phase", log, out)
    if gc is not None:
        for m in main:
            out[id(m)].gc_seconds = list(out[id(gc)].seconds)
    for m in [m for m in entries if m.isolated]:
        m.rebuild()  # one compiled peer live at a time
        group = [gc, m] if gc is not None else [m]
        phase: Dict[int, Timings] = {}
        timing_phase(group, updates, repeats, f"{m.name} phase", log, phase)
        out[id(m)] = phase[id(m)]
        if gc is not None:
            out[id(m)].gc_seconds = phase[id(gc)].seconds
    return out
