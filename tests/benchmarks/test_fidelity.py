"""The fidelity study's driver: each arm's command, run states, the study's flags and its
pilot, held-out problems and the file the job evaluates them from, the KL between policies,
the report on synthetic files (and the results page's section of it), and (slow) a whole tiny
study resumed."""

import json
import statistics
import subprocess
import sys

import numpy as np
import pytest
import torch

from benchmarks.fidelity.evaluate import heldout_examples, response_kl
from benchmarks.fidelity.report import exact_match
from benchmarks.fidelity.runs import Run, StudyError


def _args(*extra):
    from benchmarks.fidelity.cli import build_parser

    return build_parser().parse_args(list(extra))


def _value(cmd, flag):
    return cmd[cmd.index(flag) + 1]


def test_each_arm_builds_its_command(tmp_path):
    """gc, hilore (L, its gradient measured) and the control (hilore-static, L everywhere: no
    risk or tolerance to refuse it, no leave-one-out, its own budget, codec and calibration)."""
    from benchmarks.fidelity.cli import _runs

    out = tmp_path / "out"
    args = _args("--seeds", "3,4", "--hilore-budget", "1.2", "--control-budget", "1.02", "--control-codec", "fp8-e4m3")
    runs = _runs(args, tmp_path / "runs", out)
    assert [r.name for r in runs] == [f"{m}-seed{s}" for s in (3, 4) for m in ("gc", "hilore", "control")]
    cfg = tmp_path / "study.yaml"
    gc, hilore, control = (r.command(cfg, 40, "smollm2", []) for r in runs[:3])
    assert _value(gc, "--actor_backend") == "gc" and "--measure_grad_error" not in gc and "--hilore.mode" not in gc
    assert (
        _value(gc, "--train.seed") == "3" and _value(gc, "--max_steps") == "40" and _value(gc, "--config") == str(cfg)
    )
    assert _value(hilore, "--actor_backend") == "hilore" and _value(hilore, "--hilore.mode") == "hilore"
    assert "--measure_grad_error" in hilore and _value(hilore, "--hilore.budget") == "1.2"
    assert _value(hilore, "--hilore.calibration") == str(out / "calibration.json")
    want = {
        "--actor_backend": "hilore",
        "--hilore.mode": "hilore-static",
        "--hilore.delta": "100",
        "--hilore.tolerance": "100",
        "--hilore.loo": "false",
        "--hilore.budget": "1.02",
        "--hilore.codec": "fp8-e4m3",
        "--hilore.calibration": str(out / "calibration-fp8-e4m3.json"),
    }
    assert {k: _value(control, k) for k in want} == want and "--measure_grad_error" in control
    default = _runs(_args("--seeds", "0"), tmp_path / "runs", out)
    control = default[2].command(cfg, 40, "smollm2", [])
    assert _value(control, "--hilore.budget") == "1.30" and _value(control, "--hilore.codec") == "int2"
    assert "--hilore.budget" not in default[1].command(cfg, 40, "smollm2", [])  # hilore at the job's budget


def test_run_state_resumes_and_refuses_another_studys_folder(tmp_path):
    from benchmarks.fidelity.runs import arm_flags

    run = Run("hilore", 3, tmp_path, arm_flags("hilore", tmp_path))
    cfg, key = tmp_path / "study.yaml", run.key({"data.prompt_dataset": "rg:x"}, "smollm2")
    assert run.state(2, key) == "fresh" and "--resume" not in run.command(cfg, 2, "smollm2", [])
    (run.dir / "checkpoints").mkdir(parents=True)
    (run.dir / "checkpoints" / "latest").write_text("step_1")
    assert run.state(2, key) == "stale"  # a checkpoint nobody says this study made
    (run.dir / "study-run.json").write_text(json.dumps(key))
    assert run.state(2, key) == "partial" and "--resume" in run.command(cfg, 2, "smollm2", [])
    (run.final).mkdir()
    (run.final / "adapter_config.json").write_text("{}")
    (run.dir / "metrics.jsonl").write_text('{"step": 1}\n')
    assert run.state(2, key) == "partial"  # one step of two: not done
    (run.dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    assert run.state(2, key) == "done"
    other = run.key({"data.prompt_dataset": "rg:x", "actor.adam.lr": 1e-3}, "smollm2")
    assert run.state(2, other) == "stale"  # another learning rate: not this study's run


def test_the_study_flags_reach_every_run(tmp_path):
    """Task, options, instruction, learning rate and the in-run held-out evaluation go into the
    shared flags (study.yaml); --set comes last; --eval-every 0 leaves evaluation to the end."""
    from benchmarks.fidelity.cli import _overrides, shared_flags
    from benchmarks.fidelity.runs import INSTRUCTION, JOB

    out = tmp_path / "out"
    args = _args("--task", "rg:chain_sum", "--task-options", '{"min_terms": 2}', "--lr", "1e-3", "--eval-every", "4")
    shared = shared_flags(args, out, _overrides(["rollout.max_new_tokens=48"]))
    assert shared["data.prompt_dataset"] == "rg:chain_sum" and json.loads(shared["data.task_options"]) == {
        "min_terms": 2
    }
    assert shared["actor.adam.lr"] == 1e-3 and shared["rollout.max_new_tokens"] == 48
    assert "<answer>" in shared["data.instruction"]  # another reasoning-gym task: the job's answer-tag request
    assert shared["eval.dataset"] == str(out / "heldout.jsonl") and shared["eval.steps"] == 4
    assert shared["eval.max_samples"] == 64
    default = shared_flags(_args(), out, {})
    assert default["data.instruction"] == INSTRUCTION and default["data.task_options"] == JOB["data.task_options"]
    assert default["actor.adam.lr"] == JOB["actor.adam.lr"] and default["eval.steps"] == 5
    assert "eval.dataset" not in shared_flags(_args("--eval-every", "0"), out, {})


def test_the_study_refuses_flags_the_job_would(tmp_path):
    from benchmarks.fidelity.cli import _check

    with pytest.raises(StudyError, match="the control: --hilore.codec 'fp9'"):
        _check(_args("--control-codec", "fp9"))
    with pytest.raises(StudyError, match="--eval-samples 400"):
        _check(_args("--eval-samples", "400"))
    with pytest.raises(StudyError, match="--methods must include gc"):
        _check(_args("--methods", "hilore,control"))
    _check(_args())


def test_a_second_study_in_the_same_out_folder_is_refused_untouched(tmp_path, capsys):
    """While one study runs (its process holds ``--out``), the same command again stops with one
    line naming the holder, before it writes anything there."""
    from folder_holder import held_by_another_process

    from benchmarks.fidelity.cli import main
    from hilore_actor.train.run_dir import LOCK_FILE

    out = tmp_path / "out"
    out.mkdir()
    with held_by_another_process(out, "--out") as pid:
        assert main(["--out", str(out), "--runs", str(tmp_path / "runs"), "--model", "tiny:qwen2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --out {out} is in use by another run (pid {pid} ") and err.count("\n") == 1
    assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE] and not (tmp_path / "runs").exists()


def test_a_pilot_is_gc_on_the_first_seed_with_the_studys_heldout_set(tmp_path):
    """The pilot's run is the study's gc-seed0 run (same flags, same held-out problems: those
    outside every seed's training prompts), so the full study reuses it."""
    from benchmarks.fidelity.cli import _runs, eval_keys, shared_flags

    pilot, study = _args("--pilot", "--seeds", "0,1,2"), _args("--seeds", "0,1,2")
    (run,) = _runs(pilot, tmp_path)
    assert run.name == "gc-seed0"
    shared = shared_flags(study, tmp_path, {})
    assert shared_flags(pilot, tmp_path, {}) == shared
    assert eval_keys(pilot, [run], shared)["gc-seed0"] == eval_keys(study, _runs(study, tmp_path), shared)["gc-seed0"]
    assert eval_keys(pilot, [run], shared)["base"]["train_seeds"] == [0, 1, 2]


def test_a_runs_evaluation_is_saved_with_its_keys_and_then_current(tmp_path, monkeypatch):
    """``_evaluate`` of a trained run (the policy and greedy decoding stood in for): the file it
    writes holds the run's name and every key the study checks it by, so it is current."""
    import torch

    from benchmarks.fidelity import cli, evaluate
    from benchmarks.fidelity.cli import _fresh, _runs, eval_keys, shared_flags

    args = _args("--pilot", "--seeds", "0")
    (run,) = _runs(args, tmp_path)
    shared = shared_flags(args, tmp_path, {})
    keys = eval_keys(args, [run], shared)
    monkeypatch.setattr(evaluate, "load_final_policy", lambda *a, **k: (None, None))
    monkeypatch.setattr(evaluate, "greedy_accuracy", lambda *a, **k: {"accuracy": 0.5, "scores": [1.0, 0.0], "n": 2})
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    cli._evaluate(args, run, shared, keys, [], None, tmp_path)
    saved = json.loads((tmp_path / "eval" / "gc-seed0.json").read_text())
    assert saved["run"] == "gc-seed0" and saved["accuracy"] == 0.5
    assert _fresh(tmp_path / "eval" / "gc-seed0.json", keys["gc-seed0"])


def test_the_pilot_says_whether_gc_learns(tmp_path):
    from benchmarks.fidelity.cli import pilot_summary

    run = Run("gc", 0, tmp_path)
    assert "not evaluated yet" in pilot_summary(tmp_path, run)
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "base.json").write_text(json.dumps({"scores": [1.0] + [0.0] * 9}))  # 0.10
    (tmp_path / "eval" / "gc-seed0.json").write_text(json.dumps({"scores": [1.0] * 2 + [0.5] * 8}))  # 0.20
    assert "+10.0 pp" in pilot_summary(tmp_path, run) and "aim" in pilot_summary(tmp_path, run)
    assert ": met" in pilot_summary(tmp_path, run)  # double the base
    (tmp_path / "eval" / "base.json").write_text(json.dumps({"scores": [1.0] * 3 + [0.0] * 7}))  # 0.30
    assert "NOT met" in pilot_summary(tmp_path, run)


def _record(out, run, keys, shared, model="smollm2", rows=2):
    (out / "runs").mkdir(parents=True, exist_ok=True)
    (out / "runs" / f"{run.name}.metrics.jsonl").write_text(
        "".join(json.dumps({"step": i + 1}) + "\n" for i in range(rows))
    )
    (out / "runs" / f"{run.name}.json").write_text(json.dumps(run.key(shared, model)))
    (out / "eval").mkdir(exist_ok=True)
    (out / "eval" / f"{run.name}.json").write_text(json.dumps(dict(keys[run.name], accuracy=0.5)))


def test_a_run_recorded_in_the_results_needs_no_weights(tmp_path):
    """A fresh machine loses the runs' folder: runs whose metrics, evaluation and every KL they
    are part of are in the results are skipped; one whose KL is missing must train again, and
    so must one whose files another study (other flags) made."""
    from benchmarks.fidelity.cli import _kl_key, _recorded, _runs, eval_keys, shared_flags

    out = tmp_path / "out"
    args = _args("--seeds", "0,1", "--steps", "2", "--methods", "gc,control", "--runs", str(tmp_path / "runs"))
    runs = _runs(args, tmp_path / "runs", out)
    shared = shared_flags(args, out, {})
    keys = eval_keys(args, runs, shared)
    by = {r.name: r for r in runs}
    for name in ("control-seed0", "gc-seed0"):
        _record(out, by[name], keys, shared)
    (out / "kl").mkdir()
    (out / "kl" / "control-seed0.json").write_text(json.dumps(_kl_key(keys, by["control-seed0"], by["gc-seed0"])))
    assert _recorded(args, by["control-seed0"], runs, keys, out, shared)
    assert not _recorded(args, by["gc-seed0"], runs, keys, out, shared)  # KL(base || gc), the yardstick, is missing
    (out / "kl" / "base-seed0.json").write_text(json.dumps(_kl_key(keys, None, by["gc-seed0"])))
    assert _recorded(args, by["gc-seed0"], runs, keys, out, shared)
    other = dict(shared, **{"actor.adam.lr": 1.0})  # metrics another study made
    (out / "runs" / "gc-seed0.json").write_text(json.dumps(by["gc-seed0"].key(other, "smollm2")))
    assert not _recorded(args, by["gc-seed0"], runs, keys, out, shared)
    (out / "kl" / "control-seed0.json").write_text(json.dumps(dict(_kl_key(keys, by["control-seed0"], by["gc-seed1"]))))
    assert not _recorded(args, by["control-seed0"], runs, keys, out, shared)  # a KL against another gc
    assert not _recorded(args, by["gc-seed1"], runs, keys, out, shared)


def test_every_piece_of_a_study_writes_the_same_command():
    from benchmarks.fidelity.cli import _study_command

    want = "python -m benchmarks.fidelity --seeds 0,1\n"
    assert _study_command(["--seeds", "0,1"]) == want
    assert _study_command(["--max-runs", "3", "--seeds", "0,1", "--report-only"]) == want
    assert _study_command(["--max-runs=2", "--pilot", "--seeds", "0,1"]) == want


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


def test_the_heldout_file_is_what_the_job_reads_as_the_heldout_problems(tmp_path):
    """heldout.jsonl holds the held-out problems without the instruction; the job's loader
    (a dataset file, the instruction appended as to training prompts) gives the same prompts
    and answers, in order, and its scorer accepts each answer."""
    from benchmarks.fidelity.cli import shared_flags, write_heldout
    from hilore_actor.data import load_task

    out = tmp_path / "out"
    args = _args("--seeds", "0,1", "--heldout", "20", "--eval-samples", "8")
    shared = shared_flags(args, out, {})
    examples, _ = write_heldout(args, shared, out)
    task = load_task(shared["eval.dataset"], instruction=shared["data.instruction"])
    assert [e.prompt for e in task.examples] == [e.prompt for e in examples]
    assert [e.answer for e in task.examples] == [e.answer for e in examples] and len(examples) == 20
    assert all(task.score(e.answer, e) == 1.0 for e in task.examples)
    before = (out / "heldout.jsonl").stat().st_mtime_ns
    write_heldout(args, shared, out)
    assert (out / "heldout.jsonl").stat().st_mtime_ns == before  # written once


def _synthetic_study(tmp_path, seed):
    """A finished 3-arm, 3-seed study's files: metrics with held-out accuracy every 2 steps and
    (for the arms with L) gradient error and L share, evaluations with per-problem scores, KLs;
    each made with the keys the study's command gives."""
    from benchmarks.fidelity.cli import _kl_key, _runs, eval_keys, shared_flags

    rng = np.random.default_rng(seed)
    out = tmp_path / "out"
    args = _args("--seeds", "0,1,2", "--steps", "4", "--heldout", "50", "--eval-every", "2", "--eval-samples", "20")
    runs = _runs(args, tmp_path / "runs", out)
    shared = shared_flags(args, out, {})
    keys = eval_keys(args, runs, shared)
    share = {"gc": 0.0, "hilore": 0.3, "control": 0.95}
    for r in runs:
        rows = []
        for i in range(4):
            row = {"step": i + 1, "reward_mean": float(rng.random())}
            if (i + 1) % 2 == 0:
                row["eval_accuracy"] = float(rng.random())
            if r.method != "gc":
                row.update(
                    fraction_L=share[r.method] + 0.01 * i,
                    grad_rel_error=float(rng.random()) / 10,
                    grad_rel_error_max=0.2,
                    grad_cosine_min=float(0.9 + rng.random() / 20),
                )
            rows.append(row)
        _record(out, r, keys, shared)
        (out / "runs" / f"{r.name}.metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
        scores = [float(x) for x in rng.integers(0, 2, 50)]
        scores[0] = 0.5  # partial credit: not an exact answer
        (out / "eval" / f"{r.name}.json").write_text(json.dumps(dict(keys[r.name], scores=scores)))
    base = [1.0] * 5 + [0.0] * 45
    (out / "eval" / "base.json").write_text(json.dumps(dict(keys["base"], scores=base)))
    (out / "kl").mkdir()
    for r in runs:
        gc = next(g for g in runs if g.method == "gc" and g.seed == r.seed)
        p, path = (None, f"base-seed{r.seed}") if r.method == "gc" else (r, r.name)
        kl = dict(_kl_key(keys, p, gc), kl_mean_per_token=0.01 * (r.seed + 1) + (0.1 if r.method == "control" else 0))
        (out / "kl" / f"{path}.json").write_text(json.dumps(kl))
    return out, runs, keys


def test_the_report_on_a_synthetic_study(tmp_path, fresh_seed):
    """Per arm and seed the final accuracy (exact answers only); paired differences to gc with
    their bootstrap and t intervals and the power, as the statistics give them from the same
    files; gradient error and L share per step; learning curves; KL; then a file of another
    study counts as missing."""
    from benchmarks.fidelity import stats
    from benchmarks.fidelity.report import SCHEMA, summarize, write_report

    print("seed", fresh_seed)
    out, runs, keys = _synthetic_study(tmp_path, fresh_seed)
    rep = summarize(out, runs, 4, keys, eval_samples=20)
    assert rep["schema"] == SCHEMA and rep["complete"] and rep["arms"] == ["gc", "hilore", "control"]
    ev = {r.name: json.loads((out / "eval" / f"{r.name}.json").read_text())["scores"] for r in runs}
    ex = {n: [float(x >= 1.0) for x in v] for n, v in ev.items()}
    assert rep["accuracy"]["gc"]["by_seed"]["1"] == pytest.approx(statistics.fmean(ex["gc-seed1"]))
    assert rep["base_accuracy"] == 0.1 and rep["curves_step0"] == 0.25  # the first 20 problems: 5 of 20
    for arm in ("hilore", "control"):
        p = rep["paired"][arm]
        diffs = [
            100 * (statistics.fmean(ex[f"{arm}-seed{s}"]) - statistics.fmean(ex[f"gc-seed{s}"])) for s in (0, 1, 2)
        ]
        assert [p["by_seed"][str(s)]["difference_pp"] for s in (0, 1, 2)] == pytest.approx(diffs)
        lo, hi = stats.paired_bootstrap(ex[f"{arm}-seed1"], ex["gc-seed1"])
        assert p["by_seed"]["1"]["ci95_pp"] == pytest.approx([100 * lo, 100 * hi])
        assert p["ci95_pp"] == pytest.approx(list(stats.t_interval(diffs)))
        assert p["mean_pp"] == pytest.approx(statistics.fmean(diffs)) and p["sd_pp"] == pytest.approx(
            statistics.stdev(diffs)
        )
        assert p["detectable_pp"] == pytest.approx(stats.detectable_difference(statistics.stdev(diffs), 3))
        assert p["within_0.5pp"] == (abs(statistics.fmean(diffs)) <= 0.5)
        assert p["ci_excludes_0"] == (p["ci95_pp"][0] > 0 or p["ci95_pp"][1] < 0)
        d = p["by_seed"]["2"]["discordant"]
        assert d["other_only"] - d["gc_only"] == pytest.approx(diffs[2] / 100 * 50)
    gr = rep["gradient"]
    assert set(gr) == {"hilore", "control"} and gr["control"]["steps_measured"] == 12
    assert [r["fraction_L"] for r in gr["control"]["by_step"]] == pytest.approx([0.95, 0.96, 0.97, 0.98])
    assert gr["hilore"]["grad_rel_error_max"] == 0.2
    rows = {
        s: [json.loads(x) for x in (out / "runs" / f"hilore-seed{s}.metrics.jsonl").read_text().splitlines()]
        for s in (0, 1, 2)
    }
    assert gr["hilore"]["by_step"][1]["grad_rel_error"] == pytest.approx(
        statistics.fmean(rows[s][1]["grad_rel_error"] for s in rows)
    )
    cv = rep["curves"]["hilore"]
    assert cv["steps"] == [2, 4] and cv["mean"][1] == pytest.approx(
        statistics.fmean(rows[s][3]["eval_accuracy"] for s in rows)
    )
    assert rep["kl_to_gc"]["control"]["2"] == pytest.approx(0.13) and rep["kl_to_gc"]["base"]["0"] == pytest.approx(
        0.01
    )
    assert rep["gc_learns"]["all_seeds"] == all(aim for aim in (v["met"] for v in rep["gc_learns"]["by_seed"].values()))
    partial = summarize(out, [r for r in runs if r.name != "gc-seed2"], 4, keys, eval_samples=20)["gc_learns"]
    met = [v["met"] for v in partial["by_seed"].values()]
    assert partial["all_seeds"] == (False if not all(met) else None)  # a missing seed: unknown unless one missed
    # a file another study made is not this study's: the run is missing, its pairs and KL with it
    (out / "eval" / "control-seed2.json").write_text(
        json.dumps(dict(keys["control-seed2"], steps=3, scores=[1.0] * 50))
    )
    rep = summarize(out, runs, 4, keys, eval_samples=20)
    assert not rep["complete"] and rep["missing_runs"] == ["control-seed2"]
    assert rep["paired"]["control"]["seeds"] == [0, 1]
    write_report(out, runs, 4, keys, eval_samples=20)
    assert json.loads((out / "fidelity.json").read_text())["missing_runs"] == ["control-seed2"]
    md = (out / "fidelity.md").read_text()
    assert "Power (control)" in md and "within 0.5 pp" in md and "| 4 |" in md
    assert (out / "fidelity.png").stat().st_size > 0


def test_the_results_page_renders_the_report_or_says_the_study_has_not_run(tmp_path, fresh_seed):
    from benchmarks.bench import results_studies
    from benchmarks.fidelity.report import write_report

    print("seed", fresh_seed)
    out, runs, keys = _synthetic_study(tmp_path, fresh_seed)
    write_report(out, runs, 4, keys, eval_samples=20)
    results = tmp_path / "results"
    results.mkdir()
    out.rename(results / "fidelity")
    text = results_studies.fidelity(results)
    assert "| control |" in text and "detectable at 80% power" in text and "fidelity.png" in text
    assert "L share by step (mean of seeds): 0.95 0.96 0.97 0.98" in text and "Not recomputable" not in text
    (results / "fidelity" / "runs" / "gc-seed0.metrics.jsonl").unlink()
    assert "Not recomputable here: the per-step metrics of 1 of 9 runs" in results_studies.fidelity(results)
    (results / "fidelity" / "fidelity.json").write_text(json.dumps({"steps": 30, "complete": True}))  # an earlier form
    text = results_studies.fidelity(results)
    assert "has not run yet" in text and "0.0" not in text


@pytest.mark.slow
def test_a_tiny_study_resumes_and_hilore_hr_reproduces_gc(tmp_path):
    """One seed of gc, the control and hilore-hr on a tiny model and a task it gets graded
    rewards on, held-out accuracy every step: first 1 step per run, then the same command with
    2 steps continues every run."""
    base = [
        sys.executable,
        "-m",
        "benchmarks.fidelity",
        "--model",
        "tiny:qwen2",
        "--seeds",
        "0",
        "--methods",
        "gc,control",
        "--exact-check",
        "hilore-hr",
        "--control-budget",
        "1.5",
        "--heldout",
        "6",
        "--eval-every",
        "1",
        "--eval-samples",
        "4",
        "--task",
        "toy:vowels",
        "--lr",
        "0.001",
        "--out",
        str(tmp_path / "out"),
        "--runs",
        str(tmp_path / "runs"),
        "--set",
        "data.prompt_max_len=48",
        "--set",
        "rollout.max_new_tokens=16",
    ]
    for steps in ("1", "2"):
        r = subprocess.run(base + ["--steps", steps], capture_output=True, text=True, timeout=1800)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("(partial; 2 steps)") == 3  # every run continued from its step-1 checkpoint
    rep = json.loads((tmp_path / "out" / "fidelity.json").read_text())
    assert rep["complete"] and rep["exact_check"]["hilore-hr-seed0"]["identical"]
    assert rep["kl_to_gc"]["hilore-hr"]["0"] == 0.0
    assert rep["gradient"]["control"]["steps_measured"] == 2
    assert rep["curves"]["gc"]["steps"] == [1, 2]  # the job's held-out evaluation after every step
    assert rep["base_accuracy"] is not None  # the base model, evaluated once on the same problems
    assert rep["kl_to_gc"]["base"]["0"] > 0  # training moved gc away from the base model
    assert (tmp_path / "out" / "fidelity.png").is_file()
