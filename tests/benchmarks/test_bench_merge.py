"""Merging benchmark pieces: records combine, mismatched pieces are refused, gap from speeds."""

import json

import pytest

from benchmarks.bench.merge import main, merge


def piece(methods, base=1000, budgets=(1.1,)):
    recs = [
        {
            "method": m,
            "head": "chunked",
            "budget_ratio": b,
            "speed_over_gc": s,
            "peak_over_gc": 1.0,
            "update_seconds": 1.0 / s,
            "fits_budget": True,
        }
        for m, b, s in methods
    ]
    return {
        "workload": {"name": "w"},
        "head": "chunked",
        "budget_from": "gc",
        "budget_scope": "device",
        "budget_base_bytes": base,
        "budget_offset_bytes": 10,
        "codec": "int8",
        "updates": 3,
        "inputs": {},
        "torch": "t",
        "device": "cpu",
        "budgets": list(budgets),
        "command": "c",
        "repeats": 7,
        "records": recs,
    }


def test_merge_combines_and_recomputes_the_gap():
    a = piece([("gc", None, 1.0), ("no-gc", None, 1.25), ("hilore", 1.1, 1.1)])
    b = piece([("gc", None, 1.0), ("sac-budget", 1.25, 1.05)], budgets=(1.25,))
    header, recs = merge([("a", a), ("b", b)])
    assert [(r["method"], r["piece"]) for r in recs] == [
        ("gc", "a"),
        ("no-gc", "a"),
        ("hilore", "a"),
        ("sac-budget", "b"),
    ]
    assert header["budgets"] == [1.1, 1.25] and len(header["pieces"]) == 2
    h = next(r for r in recs if r["method"] == "hilore")
    assert h["gap_recovered"] == pytest.approx((1 - 1 / 1.1) / (1 - 1 / 1.25))


def test_mismatched_pieces_are_refused(tmp_path, capsys):
    (tmp_path / "a.json").write_text(json.dumps(piece([("gc", None, 1.0)])))
    (tmp_path / "b.json").write_text(json.dumps(piece([("gc", None, 1.0)], base=999)))
    assert main([str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--json", str(tmp_path / "o.json")]) == 2
    assert "budget_base_bytes" in capsys.readouterr().err


def test_real_inputs_compare_the_measured_rows_not_the_pool_size():
    """A piece that reused a calibration file generated a smaller rollout pool (fewer groups,
    another mean reward) for the same measured rows: it merges; other measured rows do not."""
    rows = {"task": "rg:t", "response_token_share": 0.6549, "clip_frac_last_row": 0.0}
    a, b, c = (piece([("gc", None, 1.0)]) for _ in range(3))
    a["inputs"] = dict(rows, groups=15, mean_reward=0.044)
    b["inputs"] = dict(rows, groups=14, mean_reward=0.038)
    c["inputs"] = dict(rows, groups=15, mean_reward=0.044, response_token_share=0.6509)
    assert len(merge([("a", a), ("b", b)])[1]) == 1
    with pytest.raises(ValueError, match="inputs"):
        merge([("a", a), ("c", c)])


def test_a_later_piece_replaces_a_method_it_re_measured(capsys):
    old = piece([("gc", None, 1.0), ("no-gc", None, 1.25), ("all-l", None, 1.2)])
    new = piece([("gc", None, 1.0), ("all-l", None, 1.1)])
    _, recs = merge([("old", old), ("new", new)])
    by = {r["method"]: r for r in recs}
    assert by["all-l"]["piece"] == "new" and by["all-l"]["speed_over_gc"] == 1.1
    assert by["gc"]["piece"] == "old" and by["no-gc"]["piece"] == "old" and len(recs) == 3
    assert "kept new" in capsys.readouterr().err


def test_hilore_over_coarse_pairs_repeats_of_one_piece_only(fresh_seed):
    """report.versus: the median of reference/method over the same repeats, by brute force;
    a reference timed in another piece is never paired."""
    import random
    import statistics

    from benchmarks.bench.outputs import versus

    print("seed", fresh_seed)
    rng = random.Random(fresh_seed)
    coarse, fine = [rng.uniform(9, 11) for _ in range(7)], [rng.uniform(8, 10) for _ in range(7)]
    recs = [
        {"method": "hilore-coarse", "budget_ratio": 1.1, "piece": "p3", "update_seconds_all": coarse},
        {"method": "hilore", "budget_ratio": 1.1, "piece": "p3", "update_seconds_all": fine},
        {"method": "hilore", "budget_ratio": 1.25, "piece": "p3", "update_seconds_all": fine},
        {"method": "hilore-coarse", "budget_ratio": 1.25, "piece": "p5", "update_seconds_all": coarse},
    ]
    out = versus(recs)
    want = statistics.median(c / f for c, f in zip(coarse, fine))
    assert f"| 1.10 | {want:.3f} [" in out and "| 1.25 |" not in out, out
    assert versus(recs[2:]) == ""


def test_a_paired_ratio_stands_beside_the_floor_of_its_own_phases(fresh_seed):
    """report.versus: hilore+compile over compile-budget with the A/A floor (gc over gc-aa) of
    the phase that timed both, not of the other phase, by brute force; the reading says above
    only when the intervals do not overlap."""
    import random
    import statistics

    from benchmarks.bench.outputs import reading, versus
    from benchmarks.bench.stats import bootstrap_ci

    print("seed", fresh_seed)
    rng = random.Random(fresh_seed)
    n = 7
    gc = [rng.uniform(40, 50) for _ in range(n)]
    main = {"gc": gc, "gc-aa": [g * 1.5 for g in gc], "hilore+compile@1.10": [g / 1.3 for g in gc]}
    aa = [g * rng.uniform(0.97, 1.03) for g in gc]
    cb = [g / 1.3 * rng.uniform(0.98, 1.02) for g in gc]
    for speedup, want in ((1.0, "within the floor"), (1.25, "above the floor")):
        hc = [c * a / g / speedup for c, a, g in zip(cb, aa, gc)]  # the floor's own ratios, times speedup
        phase = {"gc": gc, "gc-aa": aa, "hilore+compile@1.10": hc, "compile-budget@1.10": cb}
        header = {"phases": [{"label": "main", "times": main}, {"label": "compile-budget@1.10", "times": phase}]}
        recs = [
            {"method": "hilore+compile", "budget_ratio": 1.1, "update_seconds_all": hc},
            {"method": "compile-budget", "budget_ratio": 1.1, "update_seconds_all": cb},
        ]
        out = versus(recs, "hilore+compile", "compile-budget", header=header)
        ratios, floor = [c / h for c, h in zip(cb, hc)], [g / a for g, a in zip(gc, aa)]
        assert f"| 1.10 | {statistics.median(ratios):.3f} [" in out, out
        assert f"| {n} | {statistics.median(floor):.3f} [" in out, out
        lo, hi = bootstrap_ci(ratios)
        flo, fhi = bootstrap_ci(floor)
        brute = "above the floor" if lo > fhi else "below the floor" if hi < flo else "within the floor"
        assert brute == want and out.rstrip().endswith(f"| {want} |"), out
        # an unbudgeted peer (gc+compile) is paired under its one key
        gcc = [g / 1.03 for g in gc]
        phase["gc+compile"] = gcc
        out = versus(
            recs + [{"method": "gc+compile", "budget_ratio": None, "update_seconds_all": gcc}],
            "hilore+compile",
            "gc+compile",
            header=header,
        )
        assert f"| 1.10 | {statistics.median(g / h for g, h in zip(gcc, hc)):.3f} [" in out, out
    assert reading({"speed_ci95": [0.90, 0.95]}, {"speed_ci95": [0.98, 1.02]}) == "below the floor"
    assert reading({"speed_ci95": [0.90, 0.99]}, None) == "-"


def timed_piece(rng, plan, n=5):
    """A piece with raw times: gc, gc-aa and hilore @ 1.1 timed n repeats, with its phase."""
    gc = [rng.uniform(40, 50) for _ in range(n)]
    aa = [g * rng.uniform(0.97, 1.03) for g in gc]
    h = [g / rng.uniform(1.0, 1.1) for g in gc]
    d = piece([("gc", None, 1.0), ("gc-aa", None, 1.0), ("hilore", 1.1, 1.05)])
    times = {"gc": gc, "gc-aa": aa, "hilore": h}
    for r in d["records"]:
        r.update(
            update_seconds_all=times[r["method"]],
            paired_gc_seconds_all=gc,
            paired_aa_seconds_all=aa,
            cpu_seconds_all=[1.0] * n,
        )
        if r["method"] == "hilore":
            r["plan"] = plan
    d["phases"] = [{"label": "main", "times": {"gc": gc, "gc-aa": aa, "hilore@1.10": h}}]
    return d


def test_pool_keeps_every_ratio_paired_and_every_piece_s_plan(fresh_seed):
    """--pool: a method's speed is recomputed over the pairs of every piece (brute force: the
    median of the concatenated per-repeat ratios); each piece's plan is kept."""
    import random
    import statistics

    from benchmarks.bench.merge import pool
    from benchmarks.bench.outputs import paired

    print("seed", fresh_seed)
    rng = random.Random(fresh_seed)
    a, b = timed_piece(rng, {"u": "exact"}), timed_piece(rng, {"u": "exact"}, n=4)
    header, recs = pool([("a", a), ("b", b)])
    h = next(r for r in recs if r["method"] == "hilore")
    gc = a["phases"][0]["times"]["gc"] + b["phases"][0]["times"]["gc"]
    ht = a["phases"][0]["times"]["hilore@1.10"] + b["phases"][0]["times"]["hilore@1.10"]
    aa = a["phases"][0]["times"]["gc-aa"] + b["phases"][0]["times"]["gc-aa"]
    assert h["speed_over_gc"] == statistics.median(g / x for g, x in zip(gc, ht))
    assert h["aa_over_gc"] == statistics.median(g / x for g, x in zip(gc, aa))
    assert len(h["speed_ratios"]) == 9 and header["repeats"] == 14 and h["piece"] == "a + b"
    # the phases of both pieces stay, and a pair across them is formed repeat by repeat only
    s = paired(header, "hilore@1.10", "gc-aa")
    assert s["speed_over_gc"] == statistics.median(x / y for x, y in zip(aa, ht)) and len(s["phases"]) == 2
    assert paired(header, "hilore@1.10", "compile-budget@1.10") is None
    assert h["plans_by_piece"] == [{"u": "exact"}] * 2 and h["plans_differ"] is False
    _, recs = pool([("a", a), ("c", timed_piece(rng, {"u": "checkpoint"}))])
    assert next(r for r in recs if r["method"] == "hilore")["plans_differ"] is True
