"""``python -m benchmarks.bench.knapsack``: time the Eq. 13 solver at the paper's scale
(U units, three options each, a K_B x K_delta grid); median of repeated solves."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench.knapsack", description=__doc__)
    p.add_argument("--units", type=int, default=72)
    p.add_argument("--grid", type=int, default=128)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from hilore_actor.allocation.knapsack import Option, solve

    rng = random.Random(0)
    items = [
        [
            Option("R", 0.0, 0.0, 0.0),
            Option("H", rng.uniform(0.01, 1), rng.uniform(1, 50), 0.0),
            Option("L", rng.uniform(0.005, 0.8), rng.uniform(0.3, 15), rng.uniform(0, 0.004)),
        ]
        for _ in range(args.units)
    ]
    for _ in range(5):
        solve(items, 400.0, 0.015, args.grid, args.grid)
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        solve(items, 400.0, 0.015, args.grid, args.grid)
        times.append(time.perf_counter() - t)
    res = {
        "units": args.units,
        "grid": [args.grid, args.grid],
        "repeats": args.repeats,
        "median_ms": statistics.median(times) * 1e3,
        "min_ms": min(times) * 1e3,
        "max_ms": max(times) * 1e3,
    }
    print(
        f"knapsack U={args.units} on {args.grid}x{args.grid}: median {res['median_ms']:.2f} ms "
        f"(min {res['min_ms']:.2f}, max {res['max_ms']:.2f}) over {args.repeats} solves"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
