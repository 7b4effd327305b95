"""The fidelity study's statistics against closed forms, exact enumeration and simulation:
the t quantiles and interval, the paired bootstrap over problems, and the power (the smallest
difference the seeds, or one seed's problems, could detect)."""

import itertools
import math
import statistics

import numpy as np
import pytest

from benchmarks.fidelity import stats


def test_t_quantiles_match_their_closed_forms():
    for p in (0.9, 0.975, 0.995):
        assert stats.t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-7)
        q = 4 * p * (1 - p)  # df = 2: t = (2p - 1) sqrt(2 / q)
        assert stats.t_quantile(p, 2) == pytest.approx((2 * p - 1) * math.sqrt(2 / q), rel=1e-7)
    assert stats.t_quantile(0.975, 4) == pytest.approx(2.776445105, rel=1e-7)  # tabulated
    assert stats.t_quantile(0.975, 10**6) == pytest.approx(statistics.NormalDist().inv_cdf(0.975), rel=1e-4)
    assert stats.t_quantile(0.025, 3) == -stats.t_quantile(0.975, 3)


def test_t_interval_over_seeds():
    xs = [1.0, -0.5, 2.5]
    lo, hi = stats.t_interval(xs)
    half = 4.302652729911275 * statistics.stdev(xs) / math.sqrt(3)
    assert (lo, hi) == pytest.approx((statistics.fmean(xs) - half, statistics.fmean(xs) + half), rel=1e-8)
    assert stats.t_interval([1.0]) is None


def test_paired_bootstrap_matches_the_exact_bootstrap_distribution():
    """Five problems: the bootstrap distribution of the mean difference enumerated over all 5^5
    resamples; the 10,000-resample interval lands on its exact 2.5% and 97.5% quantiles (the
    data are chosen so that no atom's cumulative probability is near either)."""
    other, ref = [1, 1, 0, 1, 1], [0, 1, 0, 0, 1]
    d = [a - b for a, b in zip(other, ref)]
    means = sorted(sum(d[i] for i in idx) / 5 for idx in itertools.product(range(5), repeat=5))
    n = len(means)
    for q in (0.025, 0.975):
        atom = means[int(q * n)]
        below, upto = sum(m < atom for m in means) / n, sum(m <= atom for m in means) / n
        assert below + 0.005 < q < upto - 0.005  # q sits well inside this atom's step of the CDF
    want = (means[int(0.025 * n)], means[int(0.975 * n)])
    print("bootstrap seed", stats.BOOTSTRAP_SEED)
    assert stats.paired_bootstrap(other, ref) == pytest.approx(want)
    assert stats.paired_bootstrap(other, ref) == stats.paired_bootstrap(other, ref)  # fixed seed: reproducible
    # one seed pooled is that seed's interval (same draws)
    assert stats.pooled_paired_bootstrap([(other, ref)]) == stats.paired_bootstrap(other, ref)


def test_paired_bootstrap_brute_force(fresh_seed):
    """The vectorized resampling against a loop over the same draws."""
    print("seed", fresh_seed)
    rng = np.random.default_rng(fresh_seed)
    other, ref = rng.integers(0, 2, 40), rng.integers(0, 2, 40)
    draws = np.random.default_rng(7).integers(0, 40, size=(500, 40))
    loop = [statistics.fmean(float(other[i] - ref[i]) for i in row) for row in draws]
    assert stats.paired_bootstrap(other, ref, resamples=500, seed=7) == pytest.approx(
        tuple(np.quantile(loop, [0.025, 0.975]))
    )


@pytest.mark.parametrize("n", [3, 5])
def test_detectable_difference_has_80_percent_power_by_simulation(n, fresh_seed):
    """Paired differences N(mde, sd) over n seeds: the two-sided t-test at 5% rejects 80% of
    the time (200,000 simulated studies, standard error 0.0009)."""
    print("seed", fresh_seed)
    sd = 0.7
    mde = stats.detectable_difference(sd, n)
    rng = np.random.default_rng(fresh_seed)
    x = rng.normal(mde, sd, size=(200_000, n))
    t = x.mean(1) / (x.std(1, ddof=1) / math.sqrt(n))
    power = float((np.abs(t) > stats.t_quantile(0.975, n - 1)).mean())
    assert power == pytest.approx(0.80, abs=0.005)
    assert stats.t_test_power(0.0, n - 1) == pytest.approx(0.05, abs=1e-6)  # no difference: the test's level
    assert stats.detectable_difference(sd, 1) is None and stats.detectable_difference(0.0, 3) == 0.0


def test_one_seeds_detectable_difference_from_its_discordant_problems():
    """(z_0.975 + z_0.8) x SD of the per-problem differences / sqrt(n), SD from the counts:
    b problems only the arm answers, c only gc, n in all."""
    b, c, n = 7, 19, 300
    other = [1] * b + [0] * c + [1] * 100 + [0] * (n - b - c - 100)
    ref = [0] * b + [1] * c + [1] * 100 + [0] * (n - b - c - 100)
    sd = math.sqrt((b + c) / n - ((b - c) / n) ** 2)
    z = statistics.NormalDist()
    want = (z.inv_cdf(0.975) + z.inv_cdf(0.8)) * sd / math.sqrt(n)
    assert stats.discordance_detectable(other, ref) == pytest.approx(want, rel=1e-12)
