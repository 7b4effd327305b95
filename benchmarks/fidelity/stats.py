"""The study's statistics: paired bootstrap intervals over held-out problems, t intervals over
seeds, and the smallest difference the study could detect (its power).

No scipy here (it is not a dependency): the t distribution and the paired t-test's power
are integrated numerically (Simpson's rule), accurate to far better than the figures need;
``tests/benchmarks/test_fidelity_stats.py`` checks them against closed forms and simulation.
"""

from __future__ import annotations

import math
import statistics
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

BOOTSTRAP_SEED = 20_250_101  # fixed: a report recomputed from the same files gives the same intervals
RESAMPLES = 10_000
Z = statistics.NormalDist()


def paired_bootstrap(
    other: Sequence[float], ref: Sequence[float], resamples: int = RESAMPLES, seed: int = BOOTSTRAP_SEED
) -> Tuple[float, float]:
    """Percentile 95% interval of mean(other - ref) over problems resampled with replacement,
    paired by problem (both policies answered the same problems): the evaluation's own noise
    in the accuracy difference of one seed."""
    d = np.asarray(other, dtype=float) - np.asarray(ref, dtype=float)
    if d.size == 0:
        raise ValueError("no problems to resample")
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, d.size, size=(resamples, d.size))].mean(axis=1)
    lo, hi = np.quantile(means, [0.025, 0.975])
    return float(lo), float(hi)


def pooled_paired_bootstrap(
    pairs: Sequence[Tuple[Sequence[float], Sequence[float]]], resamples: int = RESAMPLES, seed: int = BOOTSTRAP_SEED
) -> Tuple[float, float]:
    """Percentile 95% interval of the mean over seeds of mean(other - ref), each seed's
    problems resampled on their own: the evaluation's noise in the mean difference of these
    trained policies (not training's: that is the t interval over seeds)."""
    rng = np.random.default_rng(seed)
    total = np.zeros(resamples)
    for other, ref in pairs:
        d = np.asarray(other, dtype=float) - np.asarray(ref, dtype=float)
        total += d[rng.integers(0, d.size, size=(resamples, d.size))].mean(axis=1)
    lo, hi = np.quantile(total / len(pairs), [0.025, 0.975])
    return float(lo), float(hi)


def _simpson(y: np.ndarray, h: float) -> float:
    return float(h / 3 * (y[0] + y[-1] + 4 * y[1:-1:2].sum() + 2 * y[2:-1:2].sum()))


def t_cdf(x: float, df: float, points: int = 4001) -> float:
    """Student's t CDF: 1/2 plus the density's integral from 0 to |x|."""
    if x < 0:
        return 1.0 - t_cdf(-x, df, points)
    t = np.linspace(0.0, x, points)
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    return 0.5 + _simpson(c * (1 + t * t / df) ** (-(df + 1) / 2), x / (points - 1))


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t (bisection on ``t_cdf``)."""
    if p < 0.5:
        return -t_quantile(1 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, 2 * hi
    for _ in range(80):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def t_interval(xs: Sequence[float], level: float = 0.95) -> Optional[Tuple[float, float]]:
    """mean +- t * SD / sqrt(n) over ``xs`` (the seeds): None with fewer than two."""
    if len(xs) < 2:
        return None
    m, half = statistics.fmean(xs), t_quantile((1 + level) / 2, len(xs) - 1) * statistics.stdev(xs) / len(xs) ** 0.5
    return m - half, m + half


_erf = np.vectorize(math.erf)


def t_test_power(shift: float, df: int, alpha: float = 0.05, points: int = 4001, crit: Optional[float] = None) -> float:
    """Power of the two-sided t-test at level ``alpha`` when the t statistic's numerator is
    N(``shift``, 1) (``shift`` = true mean / SD x sqrt(n)): the probability over the SD's
    chi distribution (s = sqrt(V / df), V ~ chi2(df)) that |Z + shift| > c s."""
    c = t_quantile(1 - alpha / 2, df) if crit is None else crit
    s = np.linspace(0.0, 12.0, points)
    inner = s[1:]
    f = np.empty_like(s)
    f[0] = math.sqrt(2 / math.pi) if df == 1 else 0.0  # the chi density at 0
    f[1:] = np.exp(
        math.log(2) + (df / 2) * math.log(df / 2) - math.lgamma(df / 2) + (df - 1) * np.log(inner) - df * inner**2 / 2
    )
    phi = lambda x: 0.5 * (1 + _erf(x / math.sqrt(2)))  # noqa: E731
    return _simpson(f * (phi(shift - c * s) + phi(-shift - c * s)), 12.0 / (points - 1))


def detectable_difference(sd: float, n: int, power: float = 0.8, alpha: float = 0.05) -> Optional[float]:
    """The smallest true mean difference a two-sided paired t-test over ``n`` seeds detects
    with ``power`` at ``alpha``, given the SD of the per-seed differences: what the seeds
    could see. None with fewer than two seeds."""
    if n < 2:
        return None
    if sd == 0:
        return 0.0
    crit = t_quantile(1 - alpha / 2, n - 1)
    lo, hi = 0.0, 1.0
    while t_test_power(hi, n - 1, alpha, crit=crit) < power:
        lo, hi = hi, 2 * hi
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_test_power(mid, n - 1, alpha, crit=crit) < power else (lo, mid)
    return (lo + hi) / 2 * sd / n**0.5


def discordance_detectable(other: Sequence[float], ref: Sequence[float], power: float = 0.8, alpha: float = 0.05):
    """The smallest accuracy difference one seed's held-out evaluation resolves, from its
    per-problem paired differences (only discordant problems contribute): (z_(1-alpha/2) +
    z_power) x SD(d) / sqrt(n), the normal approximation of McNemar's test."""
    d = np.asarray(other, dtype=float) - np.asarray(ref, dtype=float)
    if d.size == 0:
        return None
    return (Z.inv_cdf(1 - alpha / 2) + Z.inv_cdf(power)) * float(d.std()) / d.size**0.5


def mean_sd(xs: List[float]) -> Dict:
    return {
        "n": len(xs),
        "mean": statistics.fmean(xs) if xs else None,
        "sd": statistics.stdev(xs) if len(xs) > 1 else None,
        "values": xs,
    }
