"""Interleaved timing: every method of a phase once per repeat, order alternating (A B ... B A)
so slow drift of the machine cancels; compiled peers each get a phase of their own beside gc
(only one compiled model may be live at a time, ``peers.compiled_runner``).

Every phase carries its own noise floor and its own comparisons:

- ``gc-aa`` (a second gc, timed as one more method) runs in every phase, so gc / gc-aa over
  the phase's repeats is the A/A ratio: what a "speed-up" of a method that does gc's work
  reads as. A ratio is called faster only when its interval clears this one.
- a compiled peer's phase also times ``hilore`` at the peer's budget and every ``+compile``
  method at that budget or unbudgeted, so HiLoRe against the peer is a paired ratio from one
  phase, not two ratios over two different gc runs.
- a method that runs compiled code warms up on every distinct update, so no compile (a new
  token count) is timed.
- every phase's raw times are returned (``Phase``) and written to the JSON, so any pair of
  methods timed together can be compared from them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple


@dataclass
class Timings:
    seconds: List[float] = field(default_factory=list)
    cpu_seconds: List[float] = field(default_factory=list)
    overhead: List[float] = field(default_factory=list)
    actions: Counter = field(default_factory=Counter)
    gc_seconds: List[float] = field(default_factory=list)  # gc's times paired with these, repeat by repeat
    aa_seconds: List[float] = field(default_factory=list)  # gc-aa's times in the same phase (the A/A floor)
    taken: Dict[str, Counter] = field(default_factory=dict)  # unit -> action labels over the timed updates


AA = "gc-aa"
PAIRED_WITH_PEERS = "hilore"  # the method timed inside every compiled peer's phase


def key(m) -> str:
    """A method's name in a phase's times: ``name`` or ``name@budget``."""
    return m.name if m.budget_ratio is None else f"{m.name}@{m.budget_ratio:.2f}"


@dataclass
class Phase:
    label: str
    times: Dict[str, List[float]]  # key(method) -> its update seconds, repeat by repeat


def timing_phase(group, updates, repeats: int, label: str, log, out: Dict[int, Timings], progress=None) -> None:
    """``progress(label, {key: times so far}, repeat, repeats)`` after each repeat (``partial``)."""
    for m in group:  # warm-up, never kept
        for u in updates if getattr(m, "compiled", False) else updates[:1]:
            m.update(u)
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
        if progress is not None:
            progress(label, {key(m): list(out[id(m)].seconds) for m in group}, rep + 1, repeats)


def _companion(h, peer) -> bool:
    """Whether ``h`` is timed inside ``peer``'s phase: hilore at its budget, +compile rows at
    its budget or unbudgeted."""
    return (h.name == PAIRED_WITH_PEERS and h.budget_ratio == peer.budget_ratio) or (
        h.name.endswith("+compile") and h.budget_ratio in (None, peer.budget_ratio)
    )


def time_methods(entries, updates, repeats: int, log, progress=None) -> Tuple[Dict[int, Timings], List[Phase]]:
    """Times of every entry (each keeps the gc and gc-aa times of its own phase in
    ``gc_seconds`` / ``aa_seconds``) and every phase's raw times. A +compile row that joins a
    compiled peer's phase is timed there only (its record: the first such phase), not again
    in the main phase."""
    out: Dict[int, Timings] = {}
    phases: List[Phase] = []
    gc: Optional[object] = next((m for m in entries if m.name == "gc"), None)
    aa: Optional[object] = next((m for m in entries if m.name == AA), None)
    peers = [m for m in entries if m.isolated]
    shared = [h for h in entries if h.name.endswith("+compile") and any(_companion(h, p) for p in peers)]
    main = [m for m in entries if not m.isolated and m not in shared]
    timing_phase(main, updates, repeats, "main phase", log, out, progress)
    phases.append(Phase("main", {key(m): list(out[id(m)].seconds) for m in main}))
    _pair(main, out, gc, aa, out)
    for m in peers:
        m.rebuild()  # one compiled peer live at a time
        ours = [h for h in entries if not h.isolated and _companion(h, m)]
        group = [x for x in (gc, aa, *ours) if x is not None] + [m]
        phase: Dict[int, Timings] = {}
        timing_phase(group, updates, repeats, f"{m.name} phase", log, phase, progress)
        phases.append(Phase(key(m), {key(x): list(phase[id(x)].seconds) for x in group}))
        firsts = [x for x in group if x is m or (x in shared and id(x) not in out)]
        for x in firsts:
            out[id(x)] = phase[id(x)]
        _pair(firsts, out, gc, aa, phase)
    return out, phases


def _pair(group, out: Dict[int, Timings], gc, aa, phase: Dict[int, Timings]) -> None:
    """Give each of ``group`` the gc and gc-aa times of the phase it was timed in."""
    for m in group:
        if gc is not None:
            out[id(m)].gc_seconds = list(phase[id(gc)].seconds)
        if aa is not None:
            out[id(m)].aa_seconds = list(phase[id(aa)].seconds)
