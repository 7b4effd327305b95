"""The benchmark command end to end on a tiny model config: records, JSON fields, plot."""

import json

import pytest

from benchmarks.bench.cli import main
from benchmarks.bench.outputs import FIELDS
from hilore_actor.models import tiny_config


@pytest.fixture
def tiny_cfg(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(tiny_config("llama", hidden_size=64, num_layers=2, vocab_size=2048).to_json_string())
    return path


def test_bench_runs_and_reports(tmp_path, tiny_cfg):
    out = tmp_path / "r.json"
    rc = main(
        [
            "--workload",
            "cpu-small",
            "--model-config",
            str(tiny_cfg),
            "--methods",
            "no-gc,gc,all-h,all-r,all-l,hilore-hr",
            "--budgets",
            "1.10,1.20",
            "--repeats",
            "1",
            "--updates",
            "1",
            "--calib",
            "1",
            "--calib-tokens",
            "256",
            "--no-loo",
            "--json",
            str(out),
            "--plot",
            str(tmp_path / "p.png"),
            "--markdown",
            str(tmp_path / "t.md"),
        ]
    )
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["torch"] and data["device"] and data["workload"]["name"] == "cpu-small"
    assert data["head"] == "chunked" and data["budget_from"] == "gc" and data["budget_scope"] == "device"
    assert data["git_commit"] and data["threads"] >= 1 and "glibc_tunables" in data
    recs = {(r["method"], r["budget_ratio"]): r for r in data["records"]}
    assert set(recs) == {
        ("no-gc", None),
        ("gc", None),
        ("all-h", None),
        ("all-r", None),
        ("all-l", None),
        ("hilore-hr", 1.1),
        ("hilore-hr", 1.2),
    }
    for r in data["records"]:
        assert set(FIELDS) <= set(r)
    assert recs[("all-h", None)]["grad_rel_err_max"] == 0.0 and recs[("all-r", None)]["grad_rel_err_max"] == 0.0
    assert recs[("all-l", None)]["grad_rel_err_max"] > 0.0
    hr = recs[("hilore-hr", 1.1)]
    assert hr["peak_over_gc"] <= 1.1 and hr["fits_budget"] is True
    assert all(x <= hr["budget_bytes"] for u in hr["peaks_by_update"] for x in u["device"] + [u["step_device"]])
    assert all(r["head"] == "chunked" for r in data["records"])
    assert set(hr["units"]) == set(hr["plan"]) and all(u["bytes_H"] > 0 for u in hr["units"].values())
    assert all(sum(u["taken"].values()) == 2 for u in hr["units"].values())  # 1 update x 2 microbatches, timed
    assert (
        len(recs[("gc", None)]["update_seconds_all"]) == 1 and len(recs[("all-l", None)]["paired_gc_seconds_all"]) == 1
    )
    assert (tmp_path / "p.png").stat().st_size > 10_000
    md = (tmp_path / "t.md").read_text()
    assert "| method |" in md and "### HiLoRe plans" in md and "Best left R" in md


def test_unknown_method_is_a_clear_error(tiny_cfg, capsys):
    assert main(["--model-config", str(tiny_cfg), "--methods", "magic", "--repeats", "1"]) == 2
    assert "unknown method 'magic'" in capsys.readouterr().err


def test_methods_help_names_every_known_method():
    """The --methods help is typed out (the parser stays free of the heavy method modules);
    it must not drift from the names the command accepts."""
    import re

    from benchmarks.bench.cli import build_parser
    from benchmarks.bench.methods import OURS, PEERS
    from hilore_actor.recovery.policies import ENGINE_POLICIES

    action = next(a for a in build_parser()._actions if a.dest == "methods")
    named = set(re.findall(r"[a-z][a-z0-9:+-]*[a-z0-9]", action.help.split(";")[0].split(":", 1)[1]))
    assert {"no-gc", "gc", *ENGINE_POLICIES, *PEERS, *OURS} <= named


def test_full_suffix_and_activation_scope(tmp_path, tiny_cfg):
    out = tmp_path / "r.json"
    rc = main(
        [
            "--model-config",
            str(tiny_cfg),
            "--methods",
            "gc,gc+full,hilore-hr",
            "--budget-from",
            "gc+full",
            "--budget-scope",
            "activations",
            "--budgets",
            "1.0",
            "--repeats",
            "2",
            "--updates",
            "1",
            "--no-loo",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    data = json.loads(out.read_text())
    recs = {r["method"]: r for r in data["records"]}
    assert data["budget_scope"] == "activations" and data["budget_from"] == "gc+full"
    assert recs["gc+full"]["head"] == "full" and recs["gc"]["head"] == "chunked"
    assert abs(recs["gc+full"]["peak_over_gc"] - 1.0) < 0.05  # B's base is gc+full's own peak
    assert recs["gc"]["peak_bytes"] < recs["gc+full"]["peak_bytes"]
    assert len(recs["gc"]["speed_ratios"]) == 2 and recs["gc+full"]["speed_ci95"] is not None
    # two repeats and gc: the A/A twin gc-aa is timed beside everyone, and every row carries its floor
    aa = recs["gc-aa"]
    assert aa["peak_bytes"] == recs["gc"]["peak_bytes"] and aa["grad_rel_err_all"] == recs["gc"]["grad_rel_err_all"]
    assert aa["speed_ratios"] == recs["gc"]["aa_ratios"] == recs["hilore-hr"]["aa_ratios"]
    assert recs["hilore-hr"]["paired_aa_seconds_all"] == aa["update_seconds_all"]
    assert [p["label"] for p in data["phases"]] == ["main"]
    assert set(data["phases"][0]["times"]) == {"gc", "gc-aa", "gc+full", "hilore-hr@1.00"}
    assert data["cpu_meter"] == "profiler"


@pytest.mark.slow
@pytest.mark.parametrize("regions", [[], ["--compile-layer-regions"]], ids=["units", "layer-regions"])
def test_compiled_units_rows_share_one_compiled_copy(tmp_path, tiny_cfg, regions, capsys):
    """gc+compile and HiLoRe+compile run on one copy whose units (and layers) are compiled:
    all-H and all-R there give eager no-gc's gradient up to inductor's rounding, HiLoRe's plan
    fits B, and every +compile row is timed in the main phase beside gc and gc-aa (about 2 min).
    With layer regions every layer of the copy gets its region (the copy carries none of the
    first engine's hooks, which would make compile_units keep per-unit regions)."""
    out = tmp_path / "r.json"
    rc = main(
        [
            "--model-config",
            str(tiny_cfg),
            "--methods",
            "no-gc,gc,gc+compile,all-h+compile,all-r+compile,hilore-hr+compile",
            "--budgets",
            "1.2",
            "--repeats",
            "2",
            "--updates",
            "1",
            "--no-loo",
            "--json",
            str(out),
        ]
        + regions
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert f"[bench] compiled {8 + (2 if regions else 0)} unit modules" in printed  # 2 layers of 4 units
    data = json.loads(out.read_text())
    recs = {r["method"]: r for r in data["records"]}
    for m in ("all-h+compile", "all-r+compile", "gc+compile"):
        assert recs[m]["grad_rel_err_max"] < 1e-5, (m, recs[m]["grad_rel_err_max"])
    assert recs["hilore-hr+compile"]["fits_budget"] is True and recs["hilore-hr+compile"]["budget_ratio"] == 1.2
    assert {"gc+compile", "hilore-hr+compile@1.20", "gc", "gc-aa"} <= set(data["phases"][0]["times"])
    assert recs["gc+compile"]["r_frac"] == 1.0


def test_compile_suffix_on_a_peer_is_a_clear_error(tiny_cfg, capsys):
    assert main(["--model-config", str(tiny_cfg), "--methods", "gc,sac+compile", "--repeats", "1"]) == 2
    assert "+compile applies to" in capsys.readouterr().err


def test_compile_activation_budget_outside_0_1_is_a_clear_error(tiny_cfg, capsys):
    assert (
        main(
            [
                "--model-config",
                str(tiny_cfg),
                "--methods",
                "gc,hilore+compile",
                "--compile-activation-budget",
                "2",
                "--repeats",
                "1",
            ]
        )
        == 2
    )
    assert "--compile-activation-budget must lie in [0, 1], got 2.0" in capsys.readouterr().err
