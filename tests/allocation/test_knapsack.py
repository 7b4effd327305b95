"""The Eq. 13 knapsack against brute force on the same grid (R, H and up to two L levels per
unit), and its fill by exact costs against brute force on exact costs."""

import itertools
import random

import pytest

from hilore_actor.allocation.knapsack import Option, grid_cost, solve


def brute_force(items, mem_budget, risk_budget, kb, kd):
    """Best (value, -risk cells, -memory cells) over all assignments feasible on the grid."""
    kd = kd if risk_budget > 0 else 0
    best = None
    for combo in itertools.product(*[range(len(o)) for o in items]):
        mem = sum(grid_cost(items[i][j].memory, mem_budget, kb) for i, j in enumerate(combo))
        risk = sum(grid_cost(items[i][j].risk, risk_budget, kd) for i, j in enumerate(combo))
        if mem > kb or risk > kd:
            continue
        key = (round(sum(items[i][j].value for i, j in enumerate(combo)), 9), -risk, -mem)
        if best is None or key > best[0]:
            best = (key, combo)
    return best


def random_items(rng, n):
    items = []
    for _ in range(n):
        opts = [Option("R", 0.0, 0.0, 0.0)]
        if rng.random() < 0.9:
            opts.append(Option("H", rng.uniform(0, 1), rng.uniform(0, 60), 0.0))
        if rng.random() < 0.8:
            opts.append(Option("L", rng.uniform(0, 1), rng.uniform(0, 20), rng.uniform(0, 0.02)))
        if rng.random() < 0.6:  # a second L level: another codec, its own bytes, time and risk
            opts.append(Option("L:bf16", rng.uniform(0, 1), rng.uniform(0, 40), rng.uniform(0, 0.005)))
        if rng.random() < 0.1:  # exact ties in value
            opts.append(Option("H", opts[-1].value, rng.uniform(0, 60), 0.0))
        items.append(opts)
    return items


@pytest.mark.parametrize("trial", range(60))
def test_dp_matches_brute_force(trial):
    rng = random.Random(random.randrange(2**31))
    items = random_items(rng, rng.randint(1, 6))
    mem_budget = rng.choice([0.0, rng.uniform(5, 150)])
    risk_budget = rng.choice([0.0, rng.uniform(0.001, 0.05)])
    kb, kd = rng.choice([(8, 8), (16, 4), (128, 128)])
    picks = solve(items, mem_budget, risk_budget, kb, kd, fill=False)
    mem = sum(grid_cost(items[i][j].memory, mem_budget, kb) for i, j in enumerate(picks))
    risk = sum(grid_cost(items[i][j].risk, risk_budget, kd if risk_budget > 0 else 0) for i, j in enumerate(picks))
    assert mem <= kb and risk <= (kd if risk_budget > 0 else 0), "infeasible on the grid"
    assert mem_budget > 0 or all(items[i][j].memory == 0 for i, j in enumerate(picks))
    (value, neg_risk, neg_mem), _ = brute_force(items, mem_budget, risk_budget, kb, kd)
    got = sum(items[i][j].value for i, j in enumerate(picks))
    assert got == pytest.approx(value, rel=1e-6, abs=1e-6)
    if abs(got - value) < 1e-9:  # same optimum: ties resolved to the least risk, then memory
        assert (risk, mem) == (-neg_risk, -neg_mem)


def test_costs_round_up_never_overspend():
    items = [[Option("R", 0, 0), Option("H", 1.0, 10.01)] for _ in range(10)]
    picks = solve(items, 100.0, 0.0, grid_memory=10, fill=False)
    assert sum(items[i][j].memory for i, j in enumerate(picks)) <= 100.0
    assert sum(picks) == 5  # 10.01 B rounds up to 2 cells of 10 B: five fit, not nine
    picks = solve(items, 100.0, 0.0, grid_memory=10)  # the fill by exact costs takes the rest
    assert sum(picks) == 9 and sum(items[i][j].memory for i, j in enumerate(picks)) <= 100.0


@pytest.mark.parametrize("trial", range(40))
def test_fill_stays_feasible_and_between_grid_and_exact_optimum(trial):
    seed = random.randrange(2**31)
    print("seed", seed)
    rng = random.Random(seed)
    items = random_items(rng, rng.randint(1, 6))
    mem_budget, risk_budget = rng.uniform(5, 150), rng.choice([0.0, rng.uniform(0.001, 0.05)])
    kb, kd = rng.choice([(8, 8), (16, 4)])
    grid = solve(items, mem_budget, risk_budget, kb, kd, fill=False)
    filled = solve(items, mem_budget, risk_budget, kb, kd)
    total = lambda picks, f: sum(getattr(items[i][j], f) for i, j in enumerate(picks))  # noqa: E731
    assert total(filled, "memory") <= mem_budget + 1e-9 and total(filled, "risk") <= risk_budget + 1e-12
    exact = max(
        sum(items[i][j].value for i, j in enumerate(c))
        for c in itertools.product(*[range(len(o)) for o in items])
        if total(c, "memory") <= mem_budget and total(c, "risk") <= risk_budget
    )
    assert total(grid, "value") - 1e-9 <= total(filled, "value") <= exact + 1e-9


def test_item_without_free_option_is_refused():
    with pytest.raises(ValueError, match="free option"):
        solve([[Option("H", 1.0, 5.0)]], 10.0, 0.0)


@pytest.mark.parametrize("trial", range(12))
def test_dp_matches_brute_force_with_partial_and_token_l_options(trial):
    """The options the planner builds per unit with P and token L offered (``Planner.options``: R,
    H, P, two L levels, and per MLP unit each L level at two row shares, whose bytes and risk
    come from ``profiling.option_cost`` and ``Planner.risks``): the knapsack's choice equals
    brute force on the same grid; a unit planned ``compressed@f`` is offered only R and L@f."""
    from hilore_actor.allocation import Planner, Runner
    from hilore_actor.allocation.calibration import Calibration
    from hilore_actor.allocation.profiling import UnitCosts
    from hilore_actor.models import build_model, tiny_config

    seed = random.randrange(2**31)
    print("seed", seed)
    rng = random.Random(seed)
    model = build_model(tiny_config("llama", hidden_size=32, num_layers=2, vocab_size=64), seed=seed)
    runner = Runner(model)
    names = runner.engine.unit_names
    cal = {
        a: Calibration(
            codec=c,
            kappa={"g": rng.uniform(0.5, 2)},
            e_bar={n: rng.uniform(0, 0.02) for n in names},
            exposure_mean={n: rng.uniform(0.5, 2) for n in names},
            groups={n: "g" for n in names},
            samples=[],
        )
        for a, c in (("L", "int8-g64"), ("L:bf16", "bf16"))
    }
    h = Planner(runner, 10**9, cal, Planner.Config(partial=True, token_rows=(0.1, 0.25)), log=lambda *_: None)
    costs = UnitCosts("1x256", 1.0, 0)
    for n in names:
        hb = rng.uniform(10, 60)
        costs.dm[n] = {"H": hb, "P": rng.uniform(0.2, 0.8) * hb, "L": rng.uniform(0.2, 0.4) * hb, "L:bf16": 0.5 * hb}
        t = rng.uniform(0, 1)
        costs.dtau[n] = {
            "H": t,
            "P": rng.uniform(0.3, 0.9) * t,
            "L": rng.uniform(0.8, 1) * t,
            "L:bf16": rng.uniform(0.9, 1) * t,
        }
    exposure = {n: rng.uniform(0, 3) for n in names}
    rest = {n: rng.uniform(0, 1) * exposure[n] for n in names if n.endswith("mlp")}
    risks = h.risks(exposure, rest)
    items = [h.options(costs, n, None, risks[n]) for n in names]
    mlp = names[1]
    assert [o.action for o in items[1]] == [
        "R",
        "H",
        "P",
        "L",
        "L:bf16",
        "L@0.1",
        "L@0.25",
        "L:bf16@0.1",
        "L:bf16@0.25",
    ]
    tl = next(o for o in items[1] if o.action == "L@0.25")
    assert tl.memory == pytest.approx(0.25 * costs.dm[mlp]["H"] + 0.75 * costs.dm[mlp]["L"])
    assert tl.risk == pytest.approx(cal["L"].risk(mlp, rest[mlp])) and tl.value == costs.dtau[mlp]["L"]
    assert [o.action for o in h.options(costs, mlp, "compressed@0.25", risks[mlp])] == ["R", "L@0.25"]
    mem_budget, risk_budget = rng.uniform(20, 150), rng.uniform(0.001, 0.05)
    picks = solve(items, mem_budget, risk_budget, 16, 8, fill=False)
    (value, _, _), _ = brute_force(items, mem_budget, risk_budget, 16, 8)
    assert sum(items[i][j].value for i, j in enumerate(picks)) == pytest.approx(value, rel=1e-6, abs=1e-6)
