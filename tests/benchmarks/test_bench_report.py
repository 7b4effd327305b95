"""The benchmark's markdown: the per-plan counts in "HiLoRe plans" against a brute-force count."""

import random
import re

from benchmarks.bench.outputs import plans

LABELS = (
    "exact",
    "checkpoint",
    "partial",
    "partial:core",
    "compressed",
    "compressed:bf16",
    "compressed@0.1",
    "compressed:bf16@0.25",
)


def test_plan_counts_every_label_form():
    """Every unit is counted once by its representation, whatever codec or row share its label names."""
    seed = random.randrange(2**31)
    print("seed", seed)
    rng = random.Random(seed)
    units = {
        f"u{i}": {"plan": rng.choice(LABELS), "dtau_H": rng.random(), "bytes_H": rng.randint(1, 2**20)}
        for i in range(40)
    }
    rec = {
        "method": "hilore",
        "budget_ratio": 1.1,
        "units": units,
        "room_bytes": 2**30,
        "all_r_peak_bytes": 2**29,
        "memory_budget_bytes": 2**28,
    }
    base = [re.split("[:@]", v["plan"])[0] for v in units.values()]
    want = (
        f"plan keeps {base.count('exact')} H, {base.count('partial')} P "
        f"({sum(v['plan'] == 'partial:core' for v in units.values())} of them P:core) and "
        f"{base.count('compressed')} L of 40."
    )
    assert want in plans([rec])
