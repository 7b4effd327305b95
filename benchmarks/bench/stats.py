"""Speed ratios from interleaved repeats: paired medians, bootstrap intervals, bimodality.

Each repeat times every method of a phase once, in alternating order, so repeat ``i`` of gc
and repeat ``i`` of a method ran side by side: their ratio cancels slow drift of the machine.
A ratio is reported as the median of those paired ratios with a percentile bootstrap 95%
interval over repeats. Shared 2-core machines sometimes switch between two speeds during a
run (the same method at 17.4 s, then 13.9 s); a median hides that, so it is flagged.
"""

from __future__ import annotations

import math
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
    lo, hi = s[: i + 1], s[i + 1 :]
    if len(lo) < 2 or len(hi) < 2:
        return False
    return gap > rel_gap * statistics.median(s) and gap > max(lo[-1] - lo[0], hi[-1] - hi[0])


def geomean(xs: Sequence[float]) -> float:
    return math.exp(statistics.fmean(math.log(x) for x in xs))


def speed_summary(reference: Optional[Sequence[float]], times: Sequence[float], prefix: str = "speed") -> Dict:
    """Median paired speed ratio over the reference, its interval and the raw ratios; beside
    them the geometric mean of the paired ratios (with its interval) and the ratio of total
    times, since the estimator alone can move a headline by a few percent."""
    names = {
        "median": f"{prefix}_over_gc",
        "ci": f"{prefix}_ci95",
        "ratios": f"{prefix}_ratios",
        "geomean": f"{prefix}_geomean",
        "geomean_ci": f"{prefix}_geomean_ci95",
        "total": f"{prefix}_total_ratio",
    }
    if not reference or not times:
        return {names["median"]: None, names["ci"]: None, names["ratios"]: []}
    n = min(len(reference), len(times))
    ratios = paired_ratios(reference[:n], times[:n])
    return {
        names["median"]: statistics.median(ratios),
        names["ci"]: bootstrap_ci(ratios),
        names["ratios"]: ratios,
        names["geomean"]: geomean(ratios),
        names["geomean_ci"]: bootstrap_ci(ratios, stat=geomean),
        names["total"]: sum(reference[:n]) / sum(times[:n]),
    }


def repeats_to_resolve(log_ratio_sd: float, difference: float, z_alpha: float = 1.96, z_power: float = 0.84) -> int:
    """Repeats needed to detect a ``difference`` (e.g. 0.03) in a paired speed ratio at 5%
    two-sided with 80% power: ``n = ((z_a + z_b) * sd / log(1 + d))^2``, ``sd`` the standard
    deviation of the paired log ratios. Against the A/A floor the pair is the method and
    gc-aa of one repeat (gc cancels: gc/gc-aa over gc/method is method/gc-aa's inverse), so
    ``sd`` is that pair's."""
    return math.ceil(((z_alpha + z_power) * log_ratio_sd / math.log1p(difference)) ** 2)


def resolvable_difference(log_ratio_sd: float, repeats: int, z_alpha: float = 1.96, z_power: float = 0.84) -> float:
    """The smallest paired speed difference ``repeats`` repeats detect at 5% two-sided with 80%
    power: ``repeats_to_resolve`` solved for ``d``, ``d = exp((z_a + z_b) * sd / sqrt(n)) - 1``."""
    return math.expm1((z_alpha + z_power) * log_ratio_sd / math.sqrt(repeats))


def log_spread(ratios: Sequence[float]) -> Optional[float]:
    """Standard deviation of the log of paired ratios (``None`` below two)."""
    return statistics.stdev([math.log(x) for x in ratios]) if len(ratios) > 1 else None
