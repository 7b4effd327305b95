"""The fidelity study's driver: run states and commands, held-out problems, the KL between
policies, the paired statistics of the report, and (slow) a whole tiny study resumed."""

import json
import statistics
import subprocess
import sys

import pytest
import torch

from benchmarks.fidelity.evaluate import heldout_examples, response_kl
from benchmarks.fidelity.report import exact_match, summarize
from benchmarks.fidelity.runs import Run


def test_run_state_and_command(tmp_path):
    run = Run("hilore", 3, tmp_path)
    cfg = tmp_path / "study.yaml"
    assert run.state(2) == "fresh"
    cmd = run.command(cfg, 2, tmp_path / "cal.json", "smollm2", [])
    assert "--resume" not in cmd and "--measure_grad_error" in cmd and cmd[cmd.index("--train.seed") + 1] == "3"
    assert cmd[cmd.index("--hilore.calibration") + 1] == str(tmp_path / "cal.json")
    (run.dir / "checkpoints").mkdir(parents=True)
    (run.dir / "checkpoints" / "latest").write_text("step_1")
    assert run.state(2) == "partial" and "--resume" in run.command(cfg, 2, tmp_path / "cal.json", "smollm2", [])
    (run.final).mkdir()
    (run.final / "adapter_config.json").write_text("{}")
    (run.dir / "metrics.jsonl").write_text('{"step": 1}\n')
    assert run.state(2) == "partial"  # one step of two: not done
    (run.dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    assert run.state(2) == "done"
    gc = Run("gc", 3, tmp_path).command(cfg, 2, tmp_path / "cal.json", "smollm2", [])
    assert "--measure_grad_error" not in gc and "--hilore.calibration" not in gc


def test_a_run_recorded_in_the_results_needs_no_weights(tmp_path):
    """A fresh machine loses the runs' folder: runs whose metrics, evaluation and every KL they
    are part of are in the results are skipped; one whose KL is missing must train again."""
    from benchmarks.fidelity.cli import _eval_key, _recorded, _runs, build_parser

    out = tmp_path / "out"
    args = build_parser().parse_args(["--seeds", "0,1", "--steps", "2", "--runs", str(tmp_path / "runs")])
    runs = _runs(args, tmp_path / "runs")
    key = _eval_key(args, {})
    by = {r.name: r for r in runs}
    for name in ("hilore-seed0", "gc-seed0", "hilore-hr-seed0"):
        (out / "runs").mkdir(parents=True, exist_ok=True)
        (out / "runs" / f"{name}.metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
        (out / "eval").mkdir(exist_ok=True)
        (out / "eval" / f"{name}.json").write_text(json.dumps(dict(key, accuracy=0.5)))
    (out / "kl").mkdir()
    (out / "kl" / "gc-hilore-seed0.json").write_text(json.dumps(key))
    assert _recorded(args, by["hilore-seed0"], runs, key, out)
    assert not _recorded(args, by["gc-seed0"], runs, key, out)  # KL(gc || hilore-hr) still needs gc's weights
    (out / "kl" / "gc-hilore-hr-seed0.json").write_text(json.dumps(key))
    assert _recorded(args, by["hilore-hr-seed0"], runs, key, out)
    assert not _recorded(args, by["gc-seed0"], runs, key, out)  # KL(gc || base), the yardstick, is missing
    (out / "kl" / "gc-base-seed0.json").write_text(json.dumps(key))
    assert _recorded(args, by["gc-seed0"], runs, key, out)
    (out / "kl" / "gc-hilore-seed0.json").write_text(json.dumps(dict(key, steps=3)))  # made for another study
    assert not _recorded(args, by["hilore-seed0"], runs, key, out)
    assert not _recorded(args, by["gc-seed1"], runs, key, out)


def test_every_piece_of_a_study_writes_the_same_command():
    from benchmarks.fidelity.cli import _study_command

    want = "python -m benchmarks.fidelity --seeds 0,1\n"
    assert _study_command(["--seeds", "0,1"]) == want
    assert _study_command(["--max-runs", "3", "--seeds", "0,1", "--report-only"]) == want
    assert _study_command(["--max-runs=2", "--seeds", "0,1"]) == want


def test_heldout_problems_are_none_of_the_training_ones():
    opts = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"]}  # a small space
    from hilore_actor.data import load_task

    examples, pool = heldout_examples(40, [0, 1], 150, "rg:basic_arithmetic", opts, " Answer.")
    seen = {
        e.prompt
        for s in (0, 1)
        for e in load_task("rg:basic_arithmetic", size=150, seed=s, options=opts, instruction=" Answer.").examples
    }
    prompts = [e.prompt for e in examples]
    assert len(prompts) == 40 == len(set(prompts)) and not seen & set(prompts)
    assert all(pool.score(f"<answer>{e.answer}</answer>", e) == 1.0 for e in examples)  # scored by their own task


def test_response_kl_matches_a_direct_computation(fresh_seed):
    print("seed", fresh_seed)
    from hilore_actor.models import build_model, tiny_config

    cfg = tiny_config("qwen2", hidden_size=32, num_layers=2, vocab_size=64)
    p, q = build_model(cfg, seed=fresh_seed).eval(), build_model(cfg, seed=fresh_seed + 1).eval()
    g = torch.Generator().manual_seed(fresh_seed)
    seqs = [torch.randint(1, 64, (n,), generator=g).tolist() for n in (9, 6, 12)]
    plens = [4, 2, 7]
    assert response_kl(p, p, seqs, plens, pad=0)["kl_mean_per_token"] == 0.0
    got = response_kl(p, q, seqs, plens, pad=0, batch=2)
    total, count = 0.0, 0
    with torch.no_grad():
        for s, n in zip(seqs, plens):  # one sequence at a time, no padding
            ids = torch.tensor([s])
            lp, lq = (torch.log_softmax(m(input_ids=ids).logits.float(), -1)[0] for m in (p, q))
            for t in range(n - 1, len(s) - 1):  # the positions predicting response tokens
                total += float((lp[t].exp() * (lp[t] - lq[t])).sum())
                count += 1
    assert got["tokens"] == count and got["kl_mean_per_token"] == pytest.approx(total / count, rel=1e-4)


def test_exact_match_finds_the_first_difference():
    from benchmarks.fidelity.report import EXACT_KEYS

    a = [dict(dict.fromkeys(EXACT_KEYS, 0.5), step=i, loss=0.1 * i, kl=0.0) for i in (1, 2, 3)]
    assert exact_match(a, [dict(r) for r in a])["identical"]
    b = [dict(r) for r in a]
    b[1]["loss"] += 1e-12
    assert exact_match(a, b) == {
        "steps_compared": 3,
        "identical": False,
        "first_difference": {"step": 2, "metric": "loss"},
    }
    assert not exact_match(a, a[:2])["identical"]  # a run that stopped early does not reproduce
    bare = [{k: v for k, v in r.items() if k != "kl"} for r in a]  # a metric neither run wrote
    assert exact_match(bare, [dict(r) for r in bare])["first_difference"] == {"step": 1, "metric": "kl (missing)"}
    assert not exact_match([], [])["identical"]


def test_summary_pairs_each_seed_with_its_own_gc(tmp_path, fresh_seed):
    print("seed", fresh_seed)
    g = torch.Generator().manual_seed(fresh_seed)
    runs = [Run(m, s, tmp_path / "runs") for s in (0, 1, 2) for m in ("gc", "hilore")]
    acc, steps = {}, 3
    for r in runs:
        acc[r.name] = float(torch.rand(1, generator=g))
        # step 1: every advantage zero, so no gradient and an error of 0 by convention
        rows = [
            {
                "step": i + 1,
                "reward_mean": float(torch.rand(1, generator=g)),
                "fraction_L": 0.25,
                "grad_norm": float(i > 0),
                **(
                    {"grad_rel_error": 0.01 * i, "grad_rel_error_max": 0.01 * i, "grad_cosine_min": 0.99}
                    if r.method == "hilore"
                    else {}
                ),
            }
            for i in range(steps)
        ]
        (tmp_path / "runs").mkdir(exist_ok=True)
        (tmp_path / "runs" / f"{r.name}.metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
        (tmp_path / "eval").mkdir(exist_ok=True)
        (tmp_path / "eval" / f"{r.name}.json").write_text(json.dumps({"accuracy": acc[r.name]}))
    (tmp_path / "eval" / "base.json").write_text(json.dumps({"accuracy": 0.3, "scores": [1.0, 0.02, 0.0, 1.0]}))
    rep = summarize(tmp_path, runs, steps)
    assert rep["base_heldout_accuracy"] == 0.5  # exact answers only: partial credit is not accuracy
    assert rep["discordant_problems"][0] is None  # these evaluations hold no per-problem scores
    (tmp_path / "eval" / "gc-seed0.json").write_text(json.dumps({"scores": [1.0, 0.0, 1.0, 0.1]}))
    (tmp_path / "eval" / "hilore-seed0.json").write_text(json.dumps({"scores": [1.0, 1.0, 0.0, 0.0]}))
    rep = summarize(tmp_path, runs, steps)
    assert rep["discordant_problems"][0] == {"n": 4, "other_only": 1, "gc_only": 1}
    assert rep["paired_accuracy_difference_pp"]["values"][0] == 0.0
    acc["gc-seed0"] = acc["hilore-seed0"] = 0.5
    diffs = [100 * (acc[f"hilore-seed{s}"] - acc[f"gc-seed{s}"]) for s in (0, 1, 2)]
    d = rep["paired_accuracy_difference_pp"]
    assert rep["complete"] and d["values"] == pytest.approx(diffs)
    assert d["mean"] == pytest.approx(statistics.fmean(diffs)) and d["sd"] == pytest.approx(statistics.stdev(diffs))
    ge = rep["gradient_error"]
    assert ge["mean"] == pytest.approx(0.01) and ge["max"] == pytest.approx(0.02)
    assert ge["steps_with_a_gradient"] == 6 and ge["mean_over_steps_with_a_gradient"] == pytest.approx(0.015)
    (tmp_path / "eval" / "hilore-seed2.json").unlink()  # an unfinished run: reported as missing, not paired
    rep = summarize(tmp_path, runs, steps)
    assert not rep["complete"] and rep["missing_runs"] == ["hilore-seed2"]
    assert rep["paired_accuracy_difference_pp"]["seeds"] == [0, 1]


@pytest.mark.slow
def test_a_tiny_study_resumes_and_hilore_hr_reproduces_gc(tmp_path):
    """One seed of gc, hilore and hilore-hr on a tiny model and a task it gets graded rewards
    on: first 1 step per run, then the same command with 2 steps continues every run."""
    base = [
        sys.executable,
        "-m",
        "benchmarks.fidelity",
        "--model",
        "tiny:qwen2",
        "--seeds",
        "0",
        "--heldout",
        "6",
        "--out",
        str(tmp_path / "out"),
        "--runs",
        str(tmp_path / "runs"),
        "--set",
        "data.prompt_dataset=toy:vowels",
        "--set",
        "data.prompt_max_len=48",
        "--set",
        "rollout.max_new_tokens=16",
        "--set",
        "actor.adam.lr=0.001",
    ]
    for steps in ("1", "2"):
        r = subprocess.run(base + ["--steps", steps], capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("(partial; 2 steps)") == 3  # every run continued from its step-1 checkpoint
    rep = json.loads((tmp_path / "out" / "fidelity.json").read_text())
    assert rep["complete"] and rep["exact_check"]["hilore-hr-seed0"]["identical"]
    assert rep["kl_gc_to"]["hilore-hr-seed0"] == 0.0
    assert rep["gradient_error"]["steps_measured"] == 2
    assert rep["base_heldout_accuracy"] is not None  # the base model, evaluated once on the same problems
    assert rep["kl_gc_to"]["base-seed0"] > 0  # training moved gc away from the base model
    assert (tmp_path / "out" / "fidelity.png").is_file()
