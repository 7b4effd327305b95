"""Interleaved timing: every phase carries gc, its A/A twin gc-aa, and (in a compiled peer's
phase) hilore at the peer's budget; each method gets the gc and gc-aa times of its phase."""

import random

from benchmarks.bench.timing import AA, key, time_methods


class FakeMethod:
    """A method whose update takes a drawn time; it logs when it ran."""

    def __init__(self, name, budget_ratio, rng, log, isolated=False):
        self.name, self.budget_ratio, self.isolated, self.rng, self.log = name, budget_ratio, isolated, rng, log
        self.rebuilt = 0

    def rebuild(self):
        self.rebuilt += 1

    def update(self, mbs):
        self.log.append(key(self))
        return {"seconds": self.rng.uniform(1, 2), "cpu_seconds": 1.0, "overhead": 0.0, "actions": {}, "taken": {}}


def test_phases_pair_gc_aa_and_hilore_with_compiled_peers(fresh_seed):
    print("seed", fresh_seed)
    rng, ran = random.Random(fresh_seed), []
    gc, aa = FakeMethod("gc", None, rng, ran), FakeMethod(AA, None, rng, ran)
    h10, h25 = FakeMethod("hilore", 1.1, rng, ran), FakeMethod("hilore", 1.25, rng, ran)
    peer = FakeMethod("compile-budget", 1.1, rng, ran, isolated=True)
    out, phases = time_methods([gc, aa, h10, h25, peer], [["mb"]], 3, lambda *_: None)
    assert [p.label for p in phases] == ["main", "compile-budget@1.10"]
    main, cp = phases
    assert set(main.times) == {"gc", AA, "hilore@1.10", "hilore@1.25"}
    assert set(cp.times) == {"gc", AA, "hilore@1.10", "compile-budget@1.10"}  # hilore at the peer's budget only
    assert all(len(t) == 3 for p in phases for t in p.times.values())
    # each method carries the gc and gc-aa times of its own phase, repeat by repeat
    assert out[id(h10)].seconds == main.times["hilore@1.10"] and out[id(h10)].gc_seconds == main.times["gc"]
    assert out[id(h10)].aa_seconds == main.times[AA]
    assert out[id(peer)].gc_seconds == cp.times["gc"] and out[id(peer)].aa_seconds == cp.times[AA]
    assert out[id(aa)].gc_seconds == main.times["gc"]  # gc-aa's own speed over gc is the floor
    assert peer.rebuilt == 1
    # interleaved, order alternating: warm-up, then A B C D, D C B A, A B C D in the main phase
    order = ["gc", AA, "hilore@1.10", "hilore@1.25"]
    assert ran[:16] == order + order + order[::-1] + order


def test_a_run_without_gc_pairs_nothing(fresh_seed):
    rng, ran = random.Random(fresh_seed), []
    m = FakeMethod("no-gc", None, rng, ran)
    out, phases = time_methods([m], [["mb"]], 2, lambda *_: None)
    assert set(phases[0].times) == {"no-gc"}
    assert out[id(m)].gc_seconds == [] and out[id(m)].aa_seconds == []


def test_compiled_units_rows_join_the_compiled_peers_phase_and_warm_up_on_every_update(fresh_seed):
    print("seed", fresh_seed)
    rng, ran = random.Random(fresh_seed), []
    gc, aa = FakeMethod("gc", None, rng, ran), FakeMethod(AA, None, rng, ran)
    gcc, hc10 = FakeMethod("gc+compile", None, rng, ran), FakeMethod("hilore+compile", 1.1, rng, ran)
    hc25 = FakeMethod("hilore+compile", 1.25, rng, ran)
    peer = FakeMethod("compile-budget", 1.1, rng, ran, isolated=True)
    for m in (gcc, hc10, hc25, peer):
        m.compiled = True
    updates = [["u0"], ["u1"], ["u2"]]
    out, phases = time_methods([gc, aa, gcc, hc10, hc25, peer], updates, 2, lambda *_: None)
    # rows that join the peer's phase are timed there only; hilore+compile @ 1.25 joins none
    assert set(phases[0].times) == {"gc", AA, "hilore+compile@1.25"}
    assert set(phases[1].times) == {"gc", AA, "gc+compile", "hilore+compile@1.10", "compile-budget@1.10"}
    assert out[id(hc10)].seconds == phases[1].times["hilore+compile@1.10"]
    assert out[id(hc10)].gc_seconds == phases[1].times["gc"] and out[id(gcc)].aa_seconds == phases[1].times[AA]
    assert out[id(hc25)].gc_seconds == phases[0].times["gc"]
    # warm-up: gc and gc-aa once, each compiled method on all three updates
    assert ran[:8] == ["gc", AA] + ["hilore+compile@1.25"] * 3 + ["gc", AA, "hilore+compile@1.25"]
