"""The GRPO training job end to end on CPU through Ray (tiny preset: 2 learner ranks under
DeepSpeed ZeRO-2, 1 HF rollout worker, a reference worker, the budget coordinator), its
checkpoints and resume, and its answers to bad input and a dying worker."""

import json
import math

import pytest
import torch

from hilore_actor.train.checkpoint import CheckpointDir
from hilore_actor.train.config import ConfigError, parse_config

from train_job import job, metrics, same_training  # noqa: E402


@pytest.fixture(scope="module")
def preempted(tmp_path_factory):
    """A run preempted in step 2 (SIGTERM to the driver), which ends after that step with its
    checkpoint: the SIGTERM test checks the stop, the resume test resumes it (one job run for both)."""
    out = tmp_path_factory.mktemp("preempted")
    return out, job(out, "--max_steps", "3", env={"HILORE_FAULT": "sigterm:1"})


def test_three_steps_write_metrics_checkpoints_and_weights(uninterrupted):
    out, r = uninterrupted
    rows = metrics(out)
    assert [m["step"] for m in rows] == [1, 2, 3]
    for m in rows:
        assert 0.0 <= m["reward_mean"] <= 1.0 and m["update_seconds"] > 0 and m["tokens_per_second"] > 0
        assert set(m["peak_over_budget"]) == {"0", "1"}  # both ranks reported to the coordinator
        assert m["coordinator"]["0"]["microbatches"] == 2 and m["coordinator"]["1"]["microbatches"] == 2
        assert m["fraction_H"] + m["fraction_L"] + m["fraction_R"] == pytest.approx(1.0)
        assert m["grad_norm"] > 0
    assert any(m["reward_mean"] != rows[0]["reward_mean"] for m in rows)  # fresh rollouts every step
    ck = out / "checkpoints"
    assert (ck / "latest").read_text() == "step_3" and CheckpointDir(ck).resumable(log=print)[1] == []
    for name in ("meta.json", "rng_rank0.pt", "rng_rank1.pt", "hilore_rank0.json", "hilore_rank1.json", "ds"):
        assert (ck / "step_3" / name).exists(), name
    assert not list(ck.glob(".*tmp"))
    assert (out / "final" / "adapter_config.json").is_file()
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert "step  reward" in r.stdout  # the reward table
    for rank in (0, 1):  # the driver showed each rank's planning (plain lines: not a terminal)
        assert f"[plan] learner-{rank}: " in r.stderr, r.stderr[-2000:]
    # the preset's B (below gc's peak, above HiLoRe's all-R peak) makes its first step mix actions, said why
    first = json.loads((out / "actions.jsonl").read_text().splitlines()[0])
    taken = {c for mbs in first["ranks"].values() for mb in mbs for c in mb["actions"]}
    said = [ln for ln in r.stdout.splitlines() if ln.startswith("[train] rank 0's plan: ")]
    print(said, "step 1's actions", sorted(taken))
    assert len(taken) >= 2 and said and "the knapsack" in said[0], (taken, said)
    assert "B is 0." in r.stdout and "x gc's peak: a run gradient checkpointing cannot make" in r.stdout


# what a resumed run may log differently from the uninterrupted one: wall-clock times, the Ray node
# ids, and the held-out evaluation and W&B logging only the reference run does
NOT_REPRODUCED = ("update_seconds", "rollout_seconds", "ref_seconds", "tokens_per_second", "learner_nodes")
PEAKS = ("peak_over_budget", "peak_over_budget_max")  # measured: within 1% (test below)
# a rank's record at the coordinator: its measured peaks, and the predictions sized from them (``RankPlanner.observe``)
MEASURED = ("peak_over_budget", "max_peak_bytes", "peaks_over_budget", "predicted_over_budget")


# what the plan decides: each run plans from its own timings (``same_row``)
PLANNED = (
    "plan_peak_over_budget",
    "plan_peak_phase",
    *(f"{p}fraction_{a}" for p in ("", "fresh_", "replay_") for a in "HPLR"),
)


def unit_actions(path):
    """Each step's actions per rank and microbatch (``actions.jsonl``), each step once."""
    rows = [json.loads(ln) for ln in (path / "actions.jsonl").read_text().splitlines()]
    assert len({r["step"] for r in rows}) == len(rows), [r["step"] for r in rows]
    return {r["step"]: {rank: [mb["actions"] for mb in mbs] for rank, mbs in r["ranks"].items()} for r in rows}


def same_row(got, want, planned):
    """``got`` logs what ``want`` logs: every metric bitwise but wall-clock times and node ids,
    measured peaks within 1%; what the plan decides only where ``planned`` (the runs planned alike)."""
    skip = set(NOT_REPRODUCED) | set(PEAKS) | {"coordinator"} | (set() if planned else set(PLANNED))
    assert set(got) == set(want), set(got) ^ set(want)
    for key in set(got) - skip:
        assert got[key] == want[key], (got["step"], key, got[key], want[key])
    for rank in want["coordinator"]:
        g, w = got["coordinator"][rank], want["coordinator"][rank]
        assert set(g) == set(w), rank
        for key in set(g) - set(MEASURED) - (set() if planned else {"actions", "tightened"}):
            assert g[key] == w[key], (got["step"], rank, key, g[key], w[key])
        if planned:
            for key in MEASURED:
                assert g[key] == pytest.approx(w[key], rel=0.01), (got["step"], rank, key, g[key], w[key])
            assert got["peak_over_budget"][rank] == pytest.approx(want["peak_over_budget"][rank], rel=0.01)
    if planned:
        assert got["peak_over_budget_max"] == pytest.approx(want["peak_over_budget_max"], rel=0.01)
    return True


def test_resume_reproduces_the_uninterrupted_run(uninterrupted, preempted, tmp_path):
    """The preempted run (stopped after step 2) as a crash inside step 2's checkpoint commit leaves
    it (the folder still staged, ``latest`` naming step 1), resumed: it redoes steps 2 and 3.

    Its redone step 2 is the preempted run's step 2: every logged metric bitwise (the plan restored
    from the checkpoint: H/R split, planning peak, each unit's action), each rank's peak, a
    measurement on a process that started afresh, within 1%. Against the uninterrupted run (H/R
    mode: exact gradients whatever the plan): the final LoRA weights and every metric of every step
    bitwise (learning rate, loss, KL, gradient norm, rewards, B ...), except wall-clock times, Ray
    node ids and the held-out evaluation the reference alone runs. What the plan decides (which
    units are stored, the split, planning's peak) is compared with the uninterrupted run only when
    both runs planned alike: each run plans from its own timings, and units of one shape tie in
    time, so two runs may store different ones. metrics.jsonl, samples.jsonl, actions.jsonl and
    TensorBoard hold each step once, TensorBoard the values metrics.jsonl holds."""
    import os
    import shutil

    from safetensors.torch import load_file

    from hilore_actor.train.metrics import scalars
    from train_job import tensorboard_counts, tensorboard_scalars

    full, _ = uninterrupted
    assert preempted[1].returncode == 0, preempted[1].stderr[-3000:]
    shutil.copytree(preempted[0], tmp_path, dirs_exist_ok=True)  # stopped after step 2, checkpointed
    assert [m["step"] for m in metrics(tmp_path)] == [1, 2]
    ck = tmp_path / "checkpoints"
    assert (ck / "latest").read_text() == "step_2"
    os.replace(ck / "step_2", ck / ".step_2.tmp")  # the commit's rename and `latest` never happened
    (ck / "latest").write_text("step_1")
    r = job(tmp_path, "--max_steps", "3", "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resuming from {ck / 'step_1'}" in r.stdout
    assert "restores its budget and plan from the checkpoint" in r.stdout
    resumed, ref, before = metrics(tmp_path), metrics(full), metrics(preempted[0])
    assert [m["step"] for m in resumed] == [1, 2, 3]
    acts, ref_acts, before_acts = (unit_actions(p) for p in (tmp_path, full, preempted[0]))
    assert sorted(acts) == [1, 2, 3] and acts[2] == before_acts[2]  # the plan restored from the checkpoint
    assert same_row(resumed[1], before[1], planned=True)  # the redone step 2 is the one the preemption cut
    alike = ref_acts[1] == before_acts[1]
    print("the two runs planned alike" if alike else f"the runs planned apart: {ref_acts[1]} and {before_acts[1]}")
    for got, want in zip(resumed, ref):
        evaluated = {k for k in want if k.startswith("eval_")}
        assert set(got) == set(want) - evaluated, set(got) ^ set(want)
        assert same_row(got, {k: v for k, v in want.items() if k not in evaluated}, planned=alike)
        assert got["lr"] == want["lr"] > 0
    weights, want_weights = (load_file(p / "final" / "adapter_model.safetensors") for p in (tmp_path, full))
    assert weights.keys() == want_weights.keys() and len(weights) > 0
    assert all(torch.equal(weights[k], want_weights[k]) for k in weights)
    samples = [json.loads(ln) for ln in (tmp_path / "samples.jsonl").read_text().splitlines()]
    train = [json.loads(ln) for ln in (full / "samples.jsonl").read_text().splitlines()]
    assert samples == [s for s in train if s["split"] == "train"] and [s["step"] for s in samples] == [1, 1, 2, 2, 3, 3]
    counts = tensorboard_counts(tmp_path / "tensorboard")
    assert set(counts.values()) == {1} and {step for _, step in counts} == {1, 2, 3}, counts.most_common(3)
    tb = tensorboard_scalars(tmp_path / "tensorboard")
    for m in resumed:
        logged = scalars({k: v for k, v in m.items() if k != "step"})
        assert {t for t, step in tb if step == m["step"]} == set(logged)
        for t, v in logged.items():
            assert tb[(t, m["step"])] == pytest.approx(v, rel=1e-6), (t, m["step"])  # TensorBoard keeps float32


def test_resume_refuses_a_changed_model_or_data_and_replans_a_changed_budget(
    uninterrupted, tmp_path, monkeypatch, capsys
):
    """--resume compares this run's flags with the checkpoint's before Ray starts: a changed model or
    seed is refused (exit 2, one line naming the flag and both values); a changed budget makes every
    rank plan anew, said once, and the new B is the one in force (banner, coordinator, checkpoint)."""
    import shutil

    from train_job import TINY, main_without_ray

    run = tmp_path / "run"
    shutil.copytree(uninterrupted[0], run)  # its checkpoint of step 3, with the flags it was saved with
    refused = (
        (
            ["--pretrain", "tiny:llama"],
            "--actor.model_name_or_path (--pretrain) 'tiny:llama' (the checkpoint's 'tiny:qwen2')",
        ),
        (["--train.seed", "7"], "--train.seed 7 (the checkpoint's 42)"),
    )
    for args, want in refused:  # refused before Ray: in this process, with Ray's start an error
        argv = [*TINY, "--save_path", str(run), "--max_steps", "4", "--resume", *args]
        code, out, err, _ = main_without_ray(argv, monkeypatch, capsys)
        assert code == 2, out[-2000:] + err[-2000:]
        assert err.strip().splitlines() == [err.strip()] and want in err, err
        assert "Traceback" not in err and "[train] starting" not in out
    assert (run / "checkpoints" / "latest").read_text() == "step_3" and [m["step"] for m in metrics(run)] == [1, 2, 3]
    r = job(run, "--max_steps", "4", "--resume", "--hilore.budget", "1.3")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("plans anew") == 1 and "--hilore.budget '1.3' (the checkpoint's '0.58')" in r.stdout
    assert "(1.3, device scope" in r.stdout  # the banner: the budget in force
    rows = metrics(run)
    assert [m["step"] for m in rows] == [1, 2, 3, 4]
    for rank in ("0", "1"):
        before, after = rows[2]["coordinator"][rank]["budget_bytes"], rows[3]["coordinator"][rank]["budget_bytes"]
        assert after == pytest.approx(before * 1.3 / 0.58, rel=0.02), rank  # the tiny preset's 0.58 x gc
    saved = json.loads((run / "checkpoints" / "step_4" / "hilore_rank0.json").read_text())
    assert saved["info"]["budget_spec"] == "1.3"
    assert json.loads((run / "checkpoints" / "step_4" / "meta.json").read_text())["config"]["hilore.budget"] == "1.3"


RESUMED_RANK = """
import json, sys
from hilore_actor.runtime.distributed import free_port
from hilore_actor.models.chunked_head import head_is_linear
from hilore_actor.train.config import flatten_ns, parse_config
from hilore_actor.train.learner import Learner

cfg = parse_config(["--preset", "tiny", "--hilore.mode", "hilore-hr", "--actor.num_gpus_per_node", "1"])
cfg.hilore.plan_tokens = json.load(open(sys.argv[1] + "/meta.json"))["config"]["hilore.plan_tokens"]
port = free_port()
rank = Learner(flatten_ns(cfg), 0, "127.0.0.1", port, None, sys.argv[1])  # rank 0's saved plan, restored
print("chunked head:", rank.chunked_head, head_is_linear(rank.ds))
"""


def test_a_resumed_rank_takes_the_chunked_head_as_an_uninterrupted_one(uninterrupted):
    """A resumed rank restores its plan and runs no pass on the bare model; its loss still goes through
    the chunked head (never the full logits, 1.7x the peak here), and the head check holds on the
    DeepSpeed engine too (whose ``config`` is DeepSpeed's). A process of its own: one learner rank,
    not through Ray."""
    import os
    import subprocess
    import sys

    step = uninterrupted[0] / "checkpoints" / "step_3"
    r = subprocess.run(
        [sys.executable, "-c", RESUMED_RANK, str(step)],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, DS_ACCELERATOR="cpu"),
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "chunked head: True True" in r.stdout, r.stdout[-2000:]


def test_offline_wandb_tensorboard_samples_entropy_and_held_out_evaluation(uninterrupted):
    """The reference run logs to W&B offline and evaluates a held-out file every step: the .wandb
    file holds exactly TensorBoard's scalars under the same grouped names; every step has the
    policy's entropy, the reward spread and eval/accuracy; samples.jsonl has 2 training and 2
    held-out generations per step; the report prints the held-out rows."""
    from train_job import tensorboard_scalars, wandb_scalars

    out, r = uninterrupted
    rows = metrics(out)
    assert [m["step"] for m in rows] == [1, 2, 3]
    for m in rows:
        assert m["entropy"] > 0 and m["reward_std"] >= 0 and m["reward_min"] <= m["reward_mean"] <= m["reward_max"]
        assert m["response_length_max"] >= m["response_length"] and m["eval_prompts"] == 3
        assert 0 <= m["eval_accuracy"] <= 1 and 0 <= m["eval_reward_mean"] <= 1
    tb, wb = tensorboard_scalars(out / "tensorboard"), wandb_scalars(out)
    assert set(tb) == set(wb)
    for k, v in tb.items():
        assert wb[k] == pytest.approx(v, rel=1e-6), k
    names = {k for k, _ in tb}
    assert {
        "reward/mean",
        "reward/std",
        "actor/loss",
        "actor/kl",
        "actor/entropy",
        "actor/clip_fraction",
        "actor/grad_norm",
        "perf/update_seconds",
        "memory/peak_over_budget/0",
        "memory/peak_over_budget/1",
        "hilore/fraction_H",
        "rollout/response_length",
        "eval/accuracy",
        "eval/reward_mean",
    } <= names
    assert tb[("actor/entropy", 2)] == pytest.approx(rows[1]["entropy"], rel=1e-6)
    samples = [json.loads(ln) for ln in (out / "samples.jsonl").read_text().splitlines()]
    assert [(s["step"], s["split"]) for s in samples] == [
        (k, split) for k in (1, 2, 3) for split in ("train", "eval") for _ in range(2)
    ]
    assert samples[2]["prompt"] == "What is 0 + 1?" and samples[2]["answer"] == "1"
    assert "held-out after step 3: accuracy" in r.stdout and "Traceback" not in r.stderr


@pytest.mark.slow  # a job of several steps: 50-120 s on 2 cores (pytest -m slow)
def test_l_is_calibrated_once_on_real_rollouts_and_resumed_from_the_checkpoint(tmp_path):
    """Mode hilore: the first step runs H/R, then L's risk is calibrated once for the job on
    that step's real microbatches (both ranks' shares pooled), every rank re-plans with it,
    and a resumed run reads it from the checkpoint instead of calibrating again."""
    r = job(
        tmp_path,
        "--hilore.mode",
        "hilore",
        "--max_steps",
        "2",
        "--hilore.calibration_batches",
        "4",
        "--measure_grad_error",
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("calibrated L's risk on 4 real microbatches") == 1, r.stdout[-3000:]
    rows = metrics(tmp_path)
    assert rows[0]["fraction_L"] == 0.0  # step 1: H/R while the calibration is pending
    assert rows[0]["grad_rel_error"] == 0.0 and rows[0]["grad_cosine_min"] == pytest.approx(1.0)  # H/R: exact
    # step 2 under the calibrated plan: an error where L was taken, none without it
    assert (rows[1]["grad_rel_error_max"] > 0) == (rows[1]["fraction_L"] > 0) and rows[1]["grad_rel_error_max"] < 0.1
    saved = [json.loads((tmp_path / "checkpoints" / "step_2" / f"hilore_rank{k}.json").read_text()) for k in (0, 1)]
    assert saved[0]["calibrations"] == saved[1]["calibrations"]  # one calibration for the job
    assert {s["batch"] for s in saved[0]["calibrations"]["L"]["samples"]} == {0, 1, 2, 3}
    assert saved[0]["info"]["calibration"] == "job"
    r = job(tmp_path, "--hilore.mode", "hilore", "--max_steps", "3", "--hilore.calibration_batches", "4", "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from" in r.stdout and "calibrated L's risk" not in r.stdout and "plans anew" not in r.stdout
    again = json.loads((tmp_path / "checkpoints" / "step_3" / "hilore_rank0.json").read_text())
    assert again["calibrations"] == saved[0]["calibrations"]


@pytest.mark.slow  # a job of several steps: 50-120 s on 2 cores (pytest -m slow)
def test_a_dead_learner_fails_cleanly_and_a_damaged_checkpoint_is_skipped_on_resume(uninterrupted, tmp_path):
    """Rank 1 dies in step 3: exit 1, one message naming the last checkpoint (step 2), metrics
    of steps 1-2. Then that checkpoint is damaged (its largest file cut short), so --resume
    names it, falls back to step 1's, and reproduces the uninterrupted steps 2-3 bitwise, one
    metrics row per step, ending on a checkpoint that checks out."""
    r = job(tmp_path, "--max_steps", "3", env={"HILORE_FAULT": "learner:1:2"})  # rank 1 dies in step 3 (index 2)
    assert r.returncode == 1
    assert "a Ray worker died" in r.stderr and "--resume" in r.stderr and "step_2" in r.stderr
    assert "Traceback" not in r.stderr
    ck = tmp_path / "checkpoints"
    assert (ck / "latest").read_text() == "step_2" and (ck / "step_1" / "meta.json").is_file()
    assert [m["step"] for m in metrics(tmp_path)] == [1, 2] and not list(ck.glob(".*tmp*"))
    victim = max(
        (f for f in (ck / "step_2").rglob("*") if f.is_file() and f.name != "meta.json"), key=lambda f: f.stat().st_size
    )
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    r = job(tmp_path, "--max_steps", "3", "--resume")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"checkpoint {ck / 'step_2'} is damaged" in r.stdout and f"resuming from {ck / 'step_1'}" in r.stdout
    rows = metrics(tmp_path)
    assert [m["step"] for m in rows] == [1, 2, 3]
    same_training(rows, metrics(uninterrupted[0]), (1, 2))
    assert CheckpointDir(ck).resumable(log=print) == (ck / "step_3", [])


def test_sigterm_finishes_the_step_checkpoints_it_and_exits_0(preempted):
    """A preemption (SIGTERM to the driver during step 2): the job ends after that step with a
    checkpoint that checks out, exit 0 and a message saying how to resume."""
    tmp_path, r = preempted
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "SIGTERM received" in r.stdout and "stopped after step 2 of 3" in r.stdout and "--resume" in r.stdout
    ck = tmp_path / "checkpoints"
    assert CheckpointDir(ck).resumable(log=print) == (ck / "step_2", [])
    assert [m["step"] for m in metrics(tmp_path)] == [1, 2] and not (tmp_path / "final").exists()
    from train_job import tensorboard_counts

    counts = tensorboard_counts(tmp_path / "tensorboard")  # the step it finished is logged, once
    assert set(counts.values()) == {1} and {step for _, step in counts} == {1, 2}


@pytest.mark.slow  # a job of several steps: 50-120 s on 2 cores (pytest -m slow)
def test_too_many_non_finite_updates_in_a_row_stop_the_job(tmp_path):
    """NaN on rank 1 in every step with a limit of 2 in a row: both updates are skipped and
    counted, then exit 1 after step 2 with one message naming the last checkpoint. That checkpoint
    keeps the streak (1 in a row): resumed with the same fault, the job stops after step 2 again, as
    the uninterrupted run did (a streak counted from 0 would have run step 3)."""
    args, env = ("--max_steps", "3", "--train.max_skipped_updates", "2"), {"HILORE_FAULT": "nonfinite:1:*"}
    r = job(tmp_path, *args, env=env)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "2 updates in a row had a non-finite gradient (the last in step 2)" in r.stderr
    assert "the last checkpoint is" in r.stderr and "step_1" in r.stderr.splitlines()[-1]
    rows = metrics(tmp_path)
    assert [m["step"] for m in rows] == [1, 2] and [m["skipped_updates"] for m in rows] == [1, 1]
    assert CheckpointDir(tmp_path / "checkpoints").resumable(log=print) == (tmp_path / "checkpoints" / "step_1", [])
    assert CheckpointDir.meta(tmp_path / "checkpoints" / "step_1")["skipped_in_a_row"] == 1
    r = job(tmp_path, *args, "--resume", env=env)
    assert r.returncode == 1 and "2 updates in a row had a non-finite gradient (the last in step 2)" in r.stderr
    assert [m["step"] for m in metrics(tmp_path)] == [1, 2]


@pytest.mark.slow  # a job of several steps: 50-120 s on 2 cores (pytest -m slow)
def test_faults_a_run_survives(uninterrupted, tmp_path):
    """Four faults in one five-step run, one per step, with one metrics row per step:
    step 1: the rollout worker dies in generate: Ray restarts it, it gets the current weights,
    the step's rollouts are redone with the same seeds;
    step 2: the budget coordinator dies at the first report: Ray restarts it, it reloads step
    1's checkpointed state, the ranks wait for it and re-register;
    step 3: rank 1 runs out of memory in its first microbatch: it reruns it all-R with the same
    random state, its plan stores less, the coordinator records it;
    (steps 1-3 equal the uninterrupted run bitwise: none of these changes what is learned)
    step 4: rank 0's first microbatch has a NaN loss: DeepSpeed skips the update on both ranks,
    the step counts it, and step 5 trains on."""
    r = job(tmp_path, "--max_steps", "5", env={"HILORE_FAULT": "rollout:0:0,coordinator:1,oom:1:2,nonfinite:0:3"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = metrics(tmp_path)
    assert [m["step"] for m in rows] == [1, 2, 3, 4, 5]
    same_training(rows, metrics(uninterrupted[0]), (0, 1, 2))
    assert r.stdout.count("a rollout worker died in step 1") == 1 and "redoing the step's rollouts" in r.stdout
    assert [m["coordinator_restarts"] for m in rows] == [0, 1, 1, 1, 1]
    assert "step 2: the budget coordinator died and was restarted" in r.stdout
    state = json.loads((tmp_path / "checkpoints" / "step_5" / "coordinator.json").read_text())
    assert (
        sorted(state["steps"]) == ["0", "1", "2", "3", "4"] and state["restarts"] == 1
    )  # step 1 came back from its checkpoint
    assert all(state["steps"]["1"][rank]["microbatches"] == 2 for rank in ("0", "1"))
    assert [m["oom_reruns"] for m in rows] == [0, 0, 1, 0, 0]
    ooms = rows[2]["coordinator"]["1"]["out_of_memory"]
    assert len(ooms) == 1 and ooms[0]["microbatch"] == 0 and rows[2]["coordinator"]["0"]["out_of_memory"] == []
    assert ooms[0]["by_bytes"] > 0  # the plan stored units at that size (fraction_H > 0) and gave up half of them
    assert "step 3: 1 microbatch(es) ran out of memory (rank 1) and were rerun all-R" in r.stdout
    assert [m["skipped_updates"] for m in rows] == [
        0,
        0,
        0,
        1,
        0,
    ] and "step 4: an update had a non-finite gradient" in r.stdout
    assert (
        not math.isfinite(rows[3]["grad_norm"])
        and math.isfinite(rows[4]["grad_norm"])
        and math.isfinite(rows[4]["loss"])
    )
    assert CheckpointDir(tmp_path / "checkpoints").resumable(log=print) == (tmp_path / "checkpoints" / "step_5", [])


def test_budget_below_minimum_is_a_clear_error(tmp_path):
    """A size above the bytes the model's config says a rank holds (13.4 MiB, refused before Ray
    below that) but below the all-R peak is found by the learners once profiling measured that
    peak: the worker's error reaches the terminal as one line with the path of its full trace."""
    r = job(tmp_path, "--hilore.budget", "15MiB")
    assert r.returncode == 2
    last = r.stderr.strip().splitlines()[-1]
    assert "below what this workload needs with every unit recomputed" in last and "Traceback" not in r.stderr
    assert f"full trace: {tmp_path / 'error.log'}" in last and "BudgetError" in (tmp_path / "error.log").read_text()


def test_malformed_dataset(tmp_path, monkeypatch, capsys):
    from train_job import TINY, main_without_ray

    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "1+1", "answer": "2"}\n{"prompt": "2+2",\n')
    argv = [*TINY, "--save_path", str(tmp_path)]
    code, _, err, _ = main_without_ray([*argv, "--data.prompt_dataset", str(data)], monkeypatch, capsys)
    assert code == 2 and "bad.jsonl:2: malformed JSON" in err
    code, _, err, _ = main_without_ray([*argv, "--resume"], monkeypatch, capsys)
    assert code == 2 and "no complete checkpoint" in err


def test_flags_aliases_and_yaml(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("rollout:\n  n_samples_per_prompt: 2\n  batch_size: 4\nhilore.budget: 1.3\nactor_backend: gc\n")
    cfg = parse_config(["--preset", "tiny", "--config", str(y), "--actor.eps_clip", "0.3", "--pretrain", "tiny:llama"])
    assert cfg.rollout.n_samples_per_prompt == 2 and cfg.hilore.budget == "1.3" and cfg.actor.backend == "gc"
    assert cfg.actor.eps_clip == 0.3 and cfg.actor.model_name_or_path == "tiny:llama"
    assert parse_config(["--preset", "tiny", "--actor.backend", "none"]).actor.backend == "none"
    y.write_text("rollout:\n  n_sample: 2\n")
    with pytest.raises(ConfigError, match="unknown key 'rollout.n_sample'"):
        parse_config(["--preset", "tiny", "--config", str(y)])


def test_help_documents_every_flag():
    from hilore_actor.train.config import FLAGS, build_parser

    text = build_parser().format_help()
    for spec in FLAGS:
        assert "--" + spec[0] in text
    assert "--actor_backend" in text and "--pretrain" in text and "--resume" in text


@pytest.mark.slow  # two steps with compiled units on both ranks: about 3 min on 2 cores (pytest -m slow)
def test_compiled_units_train_as_eager_does(uninterrupted, tmp_path):
    """--hilore.compile: both ranks compile their units in place and plan on them; the first
    step's loss (before any update) equals the eager job's up to inductor's rounding, and
    the second step runs on the compiled units too."""
    r = job(tmp_path, "--max_steps", "2", "--hilore.compile", "true", timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows, ref = metrics(tmp_path), metrics(uninterrupted[0])
    assert [m["step"] for m in rows] == [1, 2]
    assert rows[0]["reward_mean"] == ref[0]["reward_mean"]  # same rollouts: the actor was not yet updated
    assert rows[0]["loss"] == pytest.approx(ref[0]["loss"], rel=1e-4, abs=1e-6)
    assert rows[0]["grad_norm"] == pytest.approx(ref[0]["grad_norm"], rel=1e-3)
    assert all(math.isfinite(m["loss"]) and m["fraction_H"] + m["fraction_R"] == pytest.approx(1.0) for m in rows)


def test_without_the_kl_loss_the_job_starts_no_reference_worker(uninterrupted, skip_runs):
    """``--algo.kl.use_loss false`` (both ``skip_runs``): nothing reads reference log-probs, so Ray's
    list of the job's actors holds no reference worker, one start-up line says so, and no step logs
    ``kl`` (or reference seconds), in metrics.jsonl or TensorBoard. The uninterrupted run (the tiny
    preset's KL loss) lists one and logs both."""
    from train_job import tensorboard_scalars

    def actors(stdout):
        [line] = [ln for ln in stdout.splitlines() if ln.startswith("[train] Ray actors: ")]
        return line[len("[train] Ray actors: ") :].split(", ")

    learners_and_more = ["hilore-coordinator", "hilore-learner-0", "hilore-learner-1", "hilore-rollout-0"]
    assert actors(uninterrupted[1].stdout) == sorted(learners_and_more + ["hilore-reference"])
    assert all("kl" in m and m["ref_seconds"] > 0 for m in metrics(uninterrupted[0]))
    for setting in ("on", "ref"):
        out = skip_runs[setting]
        said = (out / "driver.log").read_text()
        assert actors(said) == learners_and_more, said[-2000:]
        assert said.count("no reference worker (--algo.kl.use_loss is off") == 1, said[-2000:]
        rows = metrics(out)
        assert [m["step"] for m in rows] == [1, 2, 3]
        assert all("kl" not in m and "ref_seconds" not in m and math.isfinite(m["loss"]) for m in rows)
        assert not any(t == "actor/kl" for t, _ in tensorboard_scalars(out / "tensorboard"))


def test_zero3_ranks_agree_on_every_units_action(skip_runs):
    """ZeRO-3: an R unit's replay gathers its weights with the other rank, so both ranks take one
    action per unit (and the all-R path together). Three steps under H/R plans that mix H and R
    (B close to gc's peak), with the zero-advantage skip's shrunk rows and pads, train as the
    reference does: ``skip_runs``' gc run under ZeRO-2 (exact gradients; the reductions' order
    differs). The ranks' agreement per microbatch is read from actions.jsonl
    (``tests/report/test_page.py``)."""
    rows, ref = metrics(skip_runs["on"]), metrics(skip_runs["ref"])
    assert [m["step"] for m in rows] == [1, 2, 3]
    assert any(0 < m["fraction_R"] < 1 for m in rows)  # both actions ran
    for m, base in zip(rows, ref):
        assert m["reward_mean"] == base["reward_mean"]
        assert m["loss"] == pytest.approx(base["loss"], rel=1e-5, abs=1e-8)  # as in tests/train/test_skip.py
        assert m["grad_norm"] == pytest.approx(base["grad_norm"], rel=1e-6)


def test_verl_parquet_and_reward_drive_the_run_the_presets_instruction_stays_out_a_reward_error_is_one_line(
    tmp_path,
):
    """verl's data as its users have it: a parquet of chat-list prompts with the label nested
    (``reward_model.ground_truth``), ``data_source`` and ``extra_info``, read through a dotted
    ``--data.label_key`` and scored by verl's ``compute_score`` with a value known in advance,
    under ``--preset cpu-demo`` (a tiny model in place of its SmolLM2); the held-out set is a
    JSONL of other field names (``--eval.input_key``/``--eval.label_key``). The preset's own
    instruction reaches neither: ``samples.jsonl`` holds the prompts as the files wrote them. In
    step 2 (once step 1's checkpoint exists) the function raises: exit 1, one line naming the
    function and the error, the trace in error.log, step 1's metrics and checkpoint kept."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"split": "train", "index": i},
        }
        for i, (a, b) in enumerate([(1, 2), (3, 4), (2, 2), (5, 1)])
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text('{"q": "Name a vowel.", "gold": "a"}\n{"q": "Name a consonant.", "gold": "b"}\n')
    out = tmp_path / "run"
    reward = tmp_path / "score.py"
    reward.write_text(
        "import os\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        f"    if os.path.exists({str(out / 'checkpoints' / 'step_1')!r}):\n"
        "        raise KeyError('step two')\n"
        "    assert isinstance(ground_truth, str)\n"
        "    if data_source == 'openai/gsm8k':\n"
        "        assert extra_info['split'] == 'train', extra_info\n"
        "        return 0.5 + extra_info['index'] / 8\n"
        "    return 1.0 if ground_truth in solution_str else 0.0\n"
    )
    r = job(
        out,
        *("--preset", "cpu-demo", "--pretrain", "tiny:qwen2", "--compare_gc", "false", "--max_steps", "2"),
        *("--ckpt.save_steps", "1", "--rollout.max_new_tokens", "8", "--hilore.mode", "hilore-hr"),
        *("--data.prompt_dataset", str(tmp_path / "train.parquet"), "--data.label_key", "reward_model.ground_truth"),
        *("--eval.dataset", str(held_out), "--eval.input_key", "q", "--eval.label_key", "gold", "--eval.steps", "1"),
        *("--reward.path", str(reward), "--logger.samples_per_step", "16"),
    )
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    err = r.stderr.strip().splitlines()[-1]
    assert "reward function compute_score" in err and "raised KeyError: 'step two'" in err and "error.log" in err, err
    assert "Traceback" not in r.stderr and "KeyError" in (out / "error.log").read_text()
    [m] = metrics(out)
    # every prompt of the step once, its 4 samples scored by its index: the reward saw the nested row
    assert m["step"] == 1 and m["reward_mean"] == pytest.approx(sum(0.5 + i / 8 for i in range(4)) / 4)
    assert "eval_accuracy" in m and (out / "checkpoints" / "latest").read_text() == "step_1"
    samples = [json.loads(ln) for ln in (out / "samples.jsonl").read_text().splitlines()]
    train = [s for s in samples if s["split"] == "train"]
    held = [s for s in samples if s["split"] != "train"]
    assert {json.dumps(s["prompt"]) for s in train} == {json.dumps(row["prompt"]) for row in rows}
    assert {s["prompt"] for s in held} == {"Name a vowel.", "Name a consonant."}
    assert {s["answer"] for s in held} == {"a", "b"} and "Answer with the number only" not in r.stdout
