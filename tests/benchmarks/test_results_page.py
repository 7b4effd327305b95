"""``benchmarks/RESULTS.md`` and the README's headline table are generated from the committed
JSON: the committed files must equal what the generator makes now, and the generator's noise
floor and peer choice must agree with a brute-force reference."""

import json
import random
import shutil
import statistics
from pathlib import Path

import pytest

from benchmarks.bench import results_page as rp

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def test_committed_results_page_and_readme_match_their_json():
    stale = rp.write(RESULTS, ROOT / "benchmarks" / "RESULTS.md", ROOT / "README.md", check=True)
    assert not stale, (
        f"{stale} differ from what the JSON gives: run python -m benchmarks.bench.report "
        "--results benchmarks/results --out benchmarks/RESULTS.md --readme README.md"
    )


def test_a_changed_figure_makes_the_check_fail(tmp_path):
    """The check can fail: one speed changed in a copy of a result changes the page."""
    res = tmp_path / "results"
    res.mkdir()
    shutil.copy(RESULTS / "cpu-real-b.json", res / "cpu-real-b.json")
    shutil.copy(RESULTS / "page.yaml", res / "page.yaml")  # which results the page shows, and their notes
    page = tmp_path / "RESULTS.md"
    assert rp.write(res, page) == [str(page)]  # written the first time
    assert rp.write(res, page, check=True) == []
    data = json.loads((res / "cpu-real-b.json").read_text())
    rec = next(r for r in data["records"] if r["method"] == "hilore")
    rec["speed_over_gc"] += 0.01
    (res / "cpu-real-b.json").write_text(json.dumps(data))
    assert rp.write(res, page, check=True) == [str(page)]
    readme = tmp_path / "README.md"
    readme.write_text("intro\n" + rp.BEGIN + "\nold table\n" + rp.END + "\nrest\n")
    rp.write(res, page, readme)
    text = readme.read_text()
    assert text.startswith("intro\n" + rp.BEGIN) and text.endswith(rp.END + "\nrest\n")
    assert f"{rec['speed_over_gc']:.3f}" in text and "old table" not in text


def _brute_floor(times):
    ratios = [times[i] / times[i + 1] for i in range(len(times) - 1)]
    return statistics.median(ratios)


def test_noise_floor_and_fastest_peer_against_brute_force():
    seed = random.randrange(2**31)
    print("seed", seed)
    rng = random.Random(seed)
    for _ in range(20):
        times = [rng.uniform(10, 20) for _ in range(rng.randint(2, 9))]
        assert abs(rp.aa_floor(times)["median"] - _brute_floor(times)) < 1e-12
        b = rng.choice([1.1, 1.25])
        recs = []
        for m in ("gc", "sac-budget", "compile-budget", "no-gc", "all-l", "hilore"):
            budgeted = m in ("sac-budget", "compile-budget", "hilore")
            peak = rng.uniform(0.9, 1.5)
            recs.append(
                {
                    "method": m,
                    "budget_ratio": b if budgeted else None,
                    "speed_over_gc": rng.uniform(0.9, 1.5),
                    "peak_over_gc": peak,
                    "fits_budget": (peak <= b) if budgeted else [x for x in (1.1, 1.25) if peak <= x],
                }
            )
        want = max(
            (r for r in recs if r["method"] in rp.EXACT_PEERS and r["peak_over_gc"] <= b),
            key=lambda r: r["speed_over_gc"],
            default=None,
        )
        assert rp.fastest_peer(recs, b) is want


def test_interleaved_floor_and_peer_pairs_only_within_a_phase(fresh_seed):
    """A record with gc-aa times uses its interleaved floor; one without falls back to the
    adjacent-repeat floor, marked. HiLoRe over a peer is printed only from a phase that timed
    both."""
    print("seed", fresh_seed)
    rng = random.Random(fresh_seed)
    gc = [rng.uniform(10, 11) for _ in range(6)]
    h = [g / 1.1 for g in gc]
    rec = {"method": "hilore", "budget_ratio": 1.1, "aa_over_gc": 1.0, "aa_ci95": [0.98, 1.02], "piece": None}
    assert rp.floor_of({"records": [rec]}, rec)["kind"] == "interleaved"
    old = {"method": "gc", "budget_ratio": None, "update_seconds_all": gc, "piece": None}
    f = rp.floor_of({"records": [old]}, old)
    assert f["kind"] == "adjacent" and rp.floor_cell(f).endswith("(adjacent)")
    peer = {"method": "compile-budget", "budget_ratio": 1.1, "speed_over_gc": 1.3}
    data = {"phases": [{"label": "main", "times": {"gc": gc, "hilore@1.10": h}}]}
    assert rp.over_peer(data, peer, 1.1) == "not paired"
    data["phases"].append(
        {
            "label": "compile-budget@1.10",
            "times": {"gc": gc, "hilore@1.10": h, "compile-budget@1.10": [g / 1.21 for g in gc]},
        }
    )
    assert rp.over_peer(data, peer, 1.1) == "hilore / it 0.909 [0.909, 0.909], paired"


def test_a_pooled_run_says_what_its_repeats_resolve(fresh_seed):
    """A record timed beside gc-aa gets the three estimators side by side and its power: the
    repeats it has, the log spread of its ratios over gc-aa (brute force: stdev of the logs)
    and the difference those repeats resolve; a record without gc-aa gets no such line."""
    import math

    print("seed", fresh_seed)
    rng = random.Random(fresh_seed)
    n = rng.randint(6, 20)
    over = [math.exp(rng.gauss(0.05, 0.03)) for _ in range(n)]
    h = {
        "method": "hilore",
        "budget_ratio": 1.1,
        "speed_over_gc": 1.05,
        "speed_geomean": 1.04,
        "speed_geomean_ci95": [1.0, 1.08],
        "speed_total_ratio": 1.03,
        "over_aa_ratios": over,
        "over_aa_over_gc": statistics.median(over),
        "over_aa_ci95": [1.0, 1.1],
    }
    line = rp._power({"pooled": True, "pieces": [{}, {}]}, h, 1.1)[0]
    sd = statistics.stdev(math.log(x) for x in over)
    assert f"Power: {n} paired repeats from 2 pieces, log spread over gc-aa {sd:.4f}" in line
    assert f"resolve a {math.expm1(2.8 * sd / math.sqrt(n)):.1%} difference" in line
    assert "geometric mean 1.040 [1.000, 1.080], total-time ratio 1.030" in line
    assert rp._power({}, dict(h, over_aa_ratios=[]), 1.1) == []
    two = [{"a": "exact", "b": "checkpoint"}, {"a": "exact", "b": "exact"}]
    line = rp._power({}, dict(h, plans_by_piece=two, plans_differ=True), 1.1)[0]
    assert line.endswith("Plans by piece: 1 H, 0 L, 0 P, 1 R; 2 H, 0 L, 0 P, 0 R (1 of 2 units planned differently).")
    same = [{"a": "exact", "b": "checkpoint"}] * 2
    assert rp._power({}, dict(h, plans_by_piece=same), 1.1)[0].endswith("(identical).")


def test_the_fidelity_section_shows_no_figures_of_an_earlier_form_of_the_study(tmp_path):
    """The committed fidelity report renders: in the current form as its section
    (``tests/benchmarks/test_fidelity.py`` checks that on a synthetic study); none yet, or one of
    an earlier form, as a notice that the study has not run, no figures in it."""
    from benchmarks.bench import results_studies

    report = RESULTS / "fidelity" / "fidelity.json"
    d = json.loads(report.read_text()) if report.exists() else {}  # none until the study's first run ends
    text = results_studies.fidelity(RESULTS)
    if d.get("schema") == results_studies.FIDELITY_SCHEMA:
        assert "| gc |" in text
        return
    assert "has not run yet" in text and not any(c.isdigit() for c in text.split("\n", 2)[2])


def test_the_skip_section_reads_its_ratios_against_the_floor(tmp_path, fresh_seed):
    """The skip demo's section: per step A / B and A / A' medians of the paired repeats, and the
    reading against the floor (a B no faster than A is within it; a faster one above it)."""
    from benchmarks.bench.results_runs import DemoRun
    from benchmarks.bench.results_studies import skip_demo

    print("seed", fresh_seed)
    rng = random.Random(fresh_seed)
    rows = []
    noise = lambda: 1 + 0.02 * (rng.random() - 0.5)  # noqa: E731
    for step, speed in ((1, 4.0), (2, 1.0)):
        a = [6.0 * noise() for _ in range(7)]
        again = [x * noise() for x in a]  # at speed 1 the skip's times are the floor's own: the same interval
        times = {"all": a, "skip": [x / speed * noise() for x in a] if speed > 1 else list(again), "all_again": again}
        rows.append(
            dict(step=step, reward_mean=0.1, zero_adv_share=0.5, zero_adv_token_share=0.4, update_seconds=3.0)
            | {"compare_skip_times": times}
        )
    (tmp_path / "s.metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = skip_demo(tmp_path, [DemoRun(name="s", title="t", commit="c", note="n")])
    print(text)
    cells = {
        ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[1:-1]]
        for ln in text.splitlines()
        if ln.startswith("| ")
    }
    for step, speed in (("1", 4.0), ("2", 1.0)):
        ab, aa, reading = cells[step][7], cells[step][8], cells[step][9]
        assert float(ab.split()[0][1:]) == pytest.approx(speed, rel=0.03) and float(aa.split()[0][1:]) == pytest.approx(
            1, rel=0.03
        )
        assert (reading == "above the floor") == (speed > 1), (step, reading)
    assert skip_demo(tmp_path, [DemoRun(name="missing", title="t", commit="c", note="n")]) == ""
