"""Paired speed ratios, bootstrap intervals and the bimodality flag against hand-made cases."""

import random
import statistics

import torch

from benchmarks.bench.stats import bimodal, bootstrap_ci, speed_summary


def test_paired_ratio_median_and_interval():
    seed = torch.seed() % 2**31
    print("seed", seed)
    rng = random.Random(seed)
    gc = [10 + rng.random() for _ in range(9)]
    m = [g / 1.2 for g in gc]  # exactly 1.2x faster in every pair, whatever the drift
    s = speed_summary(gc, m)
    assert abs(s["speed_over_gc"] - 1.2) < 1e-9
    assert abs(s["speed_ci95"][0] - 1.2) < 1e-9 and abs(s["speed_ci95"][1] - 1.2) < 1e-9
    # a 95% interval misses the true median now and then: check its coverage over many samples
    # (binomial: 100 draws at >= 0.9 true coverage fall under 0.8 with probability < 1e-3)
    covered = 0
    for _ in range(100):
        ci = bootstrap_ci([rng.gauss(1.0, 0.05) for _ in range(15)], n=500, seed=rng.randrange(2**31))
        covered += ci[0] <= 1.0 <= ci[1]
    print("coverage", covered / 100)
    assert covered >= 80


def test_bimodal_flags_two_speeds_only():
    assert bimodal([17.4, 17.5, 17.3, 13.9, 14.0, 13.8, 17.6])
    assert not bimodal([14.0, 14.1, 13.9, 14.2, 14.05, 13.95, 14.1])
    assert not bimodal([14.0, 14.1, 13.9, 17.0])  # one outlier is not a mode


def test_geomean_and_total_ratio_beside_the_median(fresh_seed):
    import math

    print("seed", fresh_seed)
    rng = random.Random(fresh_seed)
    gc = [rng.uniform(40, 50) for _ in range(11)]
    m = [g / rng.uniform(1.0, 1.2) for g in gc]
    s = speed_summary(gc, m)
    ratios = [g / x for g, x in zip(gc, m)]
    assert abs(s["speed_geomean"] - math.exp(sum(map(math.log, ratios)) / len(ratios))) < 1e-12
    assert abs(s["speed_total_ratio"] - sum(gc) / sum(m)) < 1e-12
    assert s["speed_over_gc"] == statistics.median(ratios)
    lo, hi = s["speed_geomean_ci95"]
    assert lo <= s["speed_geomean"] <= hi
    aa = speed_summary(gc, m, prefix="aa")
    assert aa["aa_over_gc"] == s["speed_over_gc"] and "speed_over_gc" not in aa


def test_repeats_to_resolve_gives_the_power_it_promises(fresh_seed):
    """At the computed n, a paired z-test of mean log ratio against 0 detects a true 3% speed-up
    about 80% of the time (simulated: 2,000 runs; binomial SE 0.009)."""
    import math

    from benchmarks.bench.stats import repeats_to_resolve

    print("seed", fresh_seed)
    rng = random.Random(fresh_seed)
    sd, d = 0.06, 0.03
    n = repeats_to_resolve(sd, d)
    assert n == math.ceil((2.8 * sd / math.log(1.03)) ** 2)
    hits = 0
    for _ in range(2000):
        xs = [rng.gauss(math.log(1 + d), sd) for _ in range(n)]
        mean = sum(xs) / n
        hits += mean / (sd / math.sqrt(n)) > 1.96
    print("n", n, "power", hits / 2000)
    assert 0.76 <= hits / 2000 <= 0.85


def test_resolvable_difference_inverts_repeats_to_resolve(fresh_seed):
    """n repeats resolve d exactly when ``repeats_to_resolve(sd, d) <= n``; the spread is the
    sample deviation of the log ratios."""
    import math

    from benchmarks.bench.stats import log_spread, repeats_to_resolve, resolvable_difference

    print("seed", fresh_seed)
    rng = random.Random(fresh_seed)
    sd, n = rng.uniform(0.01, 0.08), rng.randint(4, 40)
    d = resolvable_difference(sd, n)
    assert repeats_to_resolve(sd, d * 1.001) <= n < repeats_to_resolve(sd, d * 0.98)
    xs = [math.exp(rng.gauss(0, sd)) for _ in range(n)]
    assert abs(log_spread(xs) - statistics.stdev([math.log(x) for x in xs])) < 1e-12
    assert log_spread([1.0]) is None
