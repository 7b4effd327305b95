"""Speed ratios from interleaved repeats: paired medians, bootstrap intervals, bimodality.

Each repeat times every method of a phase once, in alternating order, so repeat ``i`` of gc
and repeat ``i`` of a method ran side by side: their ratio cancels slow drift of the machine.
A ratio is reported as the median of those paired ratios with a percentile bootstrap 95%
interval over repeats. Shared 2-core machines sometimes switch between two speeds during a
run (the same method at 17.4 s, then 13.9 s); a median hides that, so it is flagged.
"""
from __future__ import annotations

import random
import statistics
from typing import Dict, List, Optional, Sequence


def paired_ratios(reference: Sequence[float], times: Sequence[float]) -> List[float]:
    """``reference[i] / times[i]``: > 1 means faster than the reference."""
    return [r / t for r, t in zip(reference, times)]


def bootstrap_ci(xs: Sequence[float], stat=statistics.median, n: int = 2000, seed: int = 0, level: float = 0.95):
    """Percentile bootstrap interval of ``stat`` over resamples of ``xs`` (seeded)."""
    if len(xs) < 2:
        return None
    rng = random.Random(seed)
    vals = sorted(stat(rng.choices(xs, k=len(xs))) for _ in range(n))
    lo = vals[int((1 - level) / 2 * n)]
    hi = vals[min(n - 1, int((1 + level) / 2 * n))]
    return [lo, hi]


def bimodal(xs: Sequence[float], rel_gap: float = 0.05) -> bool:
    """True when the sorted times split at one gap wider than ``rel_gap`` of the median and
    wider than either side's own spread, with at least two times on each side."""
    if len(xs) < 4:
        return False
    s = sorted(xs)
    gaps = [(s[i + 1] - s[i], i) for i in range(len(s) - 1)]
    gap, i = max(gaps)
    lo, hi = s[: i + 1], s[i + 1:]
    if len(lo) < 2 or len(hi) < 2:
        return False
    return gap > rel_gap * statistics.median(s) and gap > max(lo[-1] - lo[0], hi[-1] - hi[0])


def speed_summary(reference: Optional[Sequence[float]], times: Sequence[float]) -> Dict:
    """Median paired speed ratio over the reference, its interval, and the raw ratios."""
    if not reference or not times:
        return {"speed_over_gc": None, "speed_ci95": None, "speed_ratios": []}
    ratios = paired_ratios(reference, times)
    return {"speed_over_gc": statistics.median(ratios), "speed_ci95": bootstrap_ci(ratios), "speed_ratios": ratios}
