"""How a fit sizes its next candidate plan from the peaks it measured (``Planner._fit``).

A plan's predicted bytes (the per-unit profiles of Eq. 9, summed) and the real peak increase
it causes differ by a ratio that depends on the plan: allocator rounding and codec transients
make it larger, storages shared by several units smaller, and it moves with the plan's mix of
H and L. Every measured candidate is a planning pass, and planning must stay within B, so a
candidate is sized from what was measured, cautiously (the *headroom*: the room less the
all-R peak, the most a plan's stored units can add; docs/DESIGN.md's glossary):

- the first candidate of a fit: ``first_fit`` of the headroom divided by the largest ratio any
  candidate of this preparation measured (a fit at a larger risk scale swaps H for L at the
  same predicted bytes; the ratio of the L-heavier plan is not known before it runs);
- after a candidate within B: half the gap to the headroom its own ratio allows (a full step,
  with a 5% margin, overshot B by up to 10% on SmolLM2: the ratio of the larger plan grew),
  and never more than half the real headroom it left, at one real byte per predicted byte or
  its ratio if larger. A plan's bytes can hide under another part of the step's peak (the
  head, the optimizer step): on cpu-ref a 48 MB L unit raised the peak by nothing, ratio
  0, and the ratio rule alone then sized a 150 GB candidate that measured 5.2 B. The bytes
  beyond the hidden ones cost at least their size, so this bound is safe while the next
  plan's marginal ratio stays below 1 / GROWTH;
- after a candidate above B: the headroom its own ratio allows, less a margin.
"""

from __future__ import annotations

from typing import Dict, Optional

MARGIN = 0.95  # of the headroom a measured ratio allows
GROWTH = 0.5  # share of the remaining gap a fitting candidate grows by


def first_candidate(headroom: float, first_fit: float, ratio: Optional[float]) -> float:
    """Memory budget of a fit's first candidate; ``ratio``: the largest measured so far (None: none)."""
    return first_fit * headroom / max(ratio or 1.0, 1.0)


def next_candidate(headroom: float, memory_budget: float, ratio: float, fits: bool) -> Optional[float]:
    """Memory budget of the next candidate, or None where a fitting plan has no meaningful
    headroom left. ``ratio``: this candidate's real peak increase per predicted byte."""
    target = headroom / max(ratio, 1e-9) * MARGIN
    if not fits:
        return min(target, memory_budget * MARGIN)
    left = headroom - ratio * memory_budget  # the real headroom left had the plan filled its budget (<= what it left)
    if target <= memory_budget * 1.02 or left <= (1 - MARGIN) * headroom:
        return None
    return min(memory_budget + GROWTH * (target - memory_budget), memory_budget + GROWTH * left / max(ratio, 1.0))


def record(
    kinds: Dict[str, int],
    memory_budget: float,
    predicted: int,
    peak_over_budget: float,
    ratio: Optional[float],
    risk_scale: float,
) -> Dict:
    """One measured candidate (``ShapePlan.report["fit_candidates"]``): how many units it keeps
    exact, compressed and partial, and its real peak increase per predicted byte."""
    return dict(
        risk_scale=risk_scale,
        memory_budget=int(memory_budget),
        predicted=int(predicted),
        peak_over_budget=peak_over_budget,
        ratio=ratio,
        **kinds,
    )


def describe(rec: Dict) -> str:
    return (
        f"[hilore] fit candidate at risk scale {rec['risk_scale']}: "
        f"memory budget {rec['memory_budget'] / 2**20:.1f} MB, predicted {rec['predicted'] / 2**20:.1f} MB "
        f"({rec['exact']} exact, {rec['partial']} partial, "
        f"{rec['compressed']} compressed), peak {rec['peak_over_budget']:.3f} B, real/predicted {rec['ratio'] or 0:.3f}"
    )
