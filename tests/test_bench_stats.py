"""Paired speed ratios, bootstrap intervals and the bimodality flag against hand-made cases."""
import random

import torch

from hilore_actor.bench.stats import bimodal, bootstrap_ci, speed_summary


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
