"""Budgets: ratios of the gc peak or sizes; below the minimum is a clear error."""

import pytest

from hilore_actor.allocation import BudgetError, parse_budget, resolve_budget


@pytest.mark.parametrize(
    "spec,expected",
    [
        (1.1, ("ratio", 1.1)),
        ("1.10", ("ratio", 1.1)),
        ("1.2x", ("ratio", 1.2)),
        (3_000_000, ("bytes", 3_000_000)),
        ("12GiB", ("bytes", 12 * 2**30)),
        ("500MB", ("bytes", 500 * 10**6)),
    ],
)
def test_parse(spec, expected):
    assert parse_budget(spec) == expected


def test_resolve_and_minimum():
    """B's floor is the all-R peak (``base_peak``), which may be below gc's peak: a ratio below 1 down to it."""
    assert resolve_budget(1.10, gc_peak=1000, base_peak=1000) == 1100
    assert resolve_budget(0.9, gc_peak=1000, base_peak=900) == 900
    with pytest.raises(BudgetError, match=r"minimum is 0\.0 MiB \(0\.900 x the gc peak"):
        resolve_budget(0.89, gc_peak=1000, base_peak=900)
    with pytest.raises(BudgetError, match="above 0"):
        resolve_budget(0, gc_peak=1000, base_peak=900)
    with pytest.raises(BudgetError, match="cannot read budget"):
        parse_budget("lots")
