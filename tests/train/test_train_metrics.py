"""The training job's logging without a job run: metric key -> TensorBoard / W&B name, the
writers (metrics.jsonl, samples.jsonl, TensorBoard, offline W&B) agreeing, the learner's entropy
statistic, the W&B and --eval.* checks of the flags, and the summary line's loss format."""

import json
from pathlib import Path

import pytest
import torch

from hilore_actor.train.config import logging_errors
from hilore_actor.train.metrics import (
    MetricsLog,
    _scalars,
    learner_means,
    pick_samples,
    rollout_metrics,
    scalars,
    summary,
    tag,
    wandb_options,
)

from train_job import tensorboard_counts, tensorboard_scalars, wandb_history, wandb_scalars  # noqa: E402

# a step's row as train_grpo.step_metrics (+ replay, --compare_gc, --measure_grad_error, eval) writes it
ROW = {
    "reward_mean": 0.5,
    "reward_std": 0.1,
    "reward_min": 0.2,
    "reward_max": 0.9,
    "accuracy": 0.25,
    "response_length": 12.5,
    "response_length_max": 16,
    "loss": 1e-6,
    "policy_loss": -0.01,
    "kl": 0.001,
    "entropy": 2.5,
    "clip_fraction": 0.0,
    "grad_norm": 0.3,
    "lr": 1e-3,
    "skipped_updates": 0,
    "oom_reruns": 0,
    "update_seconds": 1.5,
    "rollout_seconds": 0.5,
    "ref_seconds": 0.1,
    "tokens_per_second": 100.0,
    "peak_over_budget": {"0": 0.9, "1": 0.95},
    "peak_over_budget_max": 0.95,
    "plan_peak_over_budget": 0.97,
    "budget_scope": "device",
    "coordinator_restarts": 0,
    "learner_nodes": {"0": "abc", "1": "abc"},
    "fraction_H": 0.5,
    "fraction_L": 0.0,
    "fraction_P": 0.0,
    "fraction_R": 0.5,
    "coordinator": {"0": {"peak_over_budget": 0.9, "microbatches": 2, "actions": {"H": 3}, "tokens": [5, 6]}},
    "fresh_fraction_H": 0.5,
    "fresh_clip_fraction": 0.0,
    "fresh_microbatches": 2,
    "replay_fraction_H": 0.4,
    "replay_clip_fraction": 0.1,
    "replay_microbatches": 1,
    "replay_buffer_size": 8,
    "replayed": 8,
    "replay_mean_age": 1.5,
    "replay_mean_abs_advantage": 0.7,
    "compare_gc_seconds": 2.0,
    "compare_hilore_seconds": 1.5,
    "compare_speedup_vs_gc": 1.33,
    "grad_rel_error": 0.0,
    "grad_rel_error_max": 0.0,
    "grad_cosine_min": 1.0,
    "eval_accuracy": 0.5,
    "eval_reward_mean": 0.6,
    "eval_response_length": 10.0,
    "eval_prompts": 4,
    "eval_seconds": 3.0,
}


def test_every_key_has_a_distinct_name_in_its_area():
    got = scalars(ROW)
    assert len(got) == len(_scalars(ROW))  # one name per number: no two keys share one
    expect = {
        "reward/mean": 0.5,
        "reward/std": 0.1,
        "actor/loss": 1e-6,
        "actor/kl": 0.001,
        "actor/entropy": 2.5,
        "actor/clip_fraction": 0.0,
        "actor/grad_norm": 0.3,
        "perf/update_seconds": 1.5,
        "memory/peak_over_budget/1": 0.95,
        "hilore/fraction_H": 0.5,
        "rollout/response_length": 12.5,
        "eval/accuracy": 0.5,
        "eval/reward_mean": 0.6,
        "coordinator/0/actions/H": 3.0,
        "coordinator/restarts": 0.0,
        "replay/buffer_size": 8.0,
        "hilore/replay_fraction_H": 0.4,
        "actor/fresh_clip_fraction": 0.0,
        "perf/compare_speedup_vs_gc": 1.33,
        "hilore/grad_rel_error": 0.0,
    }
    for name, v in expect.items():
        assert got[name] == v, name
    assert not [n for n in got if n.startswith("train/")]  # every key of a job's row has an area
    assert tag("something_new") == "train/something_new"  # a key added later still shows, apart
    assert "train/budget_scope" not in got and "train/learner_nodes/0" not in got  # text is not a scalar


class Ex:
    def __init__(self, prompt):
        self.prompt, self.answer = prompt, "a" + prompt


def test_rollout_spread_samples_and_means():
    m = rollout_metrics([0.0, 1.0, 1.0, 0.0], [3, 7, 5, 1])
    assert m == {"reward_std": 0.5, "reward_min": 0.0, "reward_max": 1.0, "response_length_max": 7}
    assert rollout_metrics([0.3], [2])["reward_std"] == 0.0  # population std: no NaN for one response
    s = pick_samples([Ex("p0"), Ex("p1")], ["r00", "r01", "r10", "r11"], [0.1, 0.2, 0.3, 0.4], 2, 3)
    assert [(x["prompt"], x["response"], x["reward"]) for x in s] == [
        ("p0", "r00", 0.1),
        ("p1", "r10", 0.3),
        ("p0", "r01", 0.2),
    ]
    assert pick_samples([Ex("p0")], ["r"], [1.0], 1, 0) == []
    assert learner_means([{"entropy": 1.0}, {"entropy": 3.0}], ["entropy"]) == {"entropy": 2.0}
    assert learner_means([{"loss": 1.0}], ["entropy"]) == {}


def test_summary_shows_a_small_loss():
    line = summary(ROW)
    assert "loss +1e-06" in line and "entropy 2.500" in line and "eval acc 0.500" in line


@pytest.fixture
def fresh_wandb():
    """wandb keeps its settings (WANDB_MODE ...) in a per-process singleton: reset it around a
    test that sets them (a job's driver is a fresh process)."""
    wandb = pytest.importorskip("wandb")
    wandb.teardown()
    yield wandb
    wandb.teardown()


def _cfg(tmp_path, *flags):
    from hilore_actor.train.config import parse_config

    return parse_config(["--preset", "tiny", "--save_path", str(tmp_path / "run"), *flags])


def test_offline_wandb_and_tensorboard_hold_the_same_scalars(tmp_path, monkeypatch, fresh_wandb):
    """Two steps through MetricsLog with W&B offline: the .wandb file's history and the
    TensorBoard events hold the same numbers under the same names; samples go to
    samples.jsonl, TensorBoard text and a W&B table; a resume keeps only the covered steps."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = _cfg(tmp_path, "--use_wandb", "--wandb_run_name", "unit")
    opts = wandb_options(cfg)
    assert opts["name"] == "unit" and opts["dir"] == cfg.save_path and "logger.wandb.key" not in opts["config"]
    log = MetricsLog(cfg.save_path, wandb=opts)
    samples = [
        {"split": "train", "prompt": "say a", "response": "a", "reward": 1.0, "answer": "a"},
        {
            "split": "eval",
            "prompt": [{"role": "user", "content": "say b"}],
            "response": "c",
            "reward": 0.0,
            "answer": "b",
        },
    ]
    log.log(1, ROW, samples)
    log.log(2, dict(ROW, reward_mean=0.75, peak_over_budget={"0": 1.01, "1": 0.5}))
    log.close()
    tb = tensorboard_scalars(log.tb_dir)
    wb = wandb_scalars(cfg.save_path)
    assert set(tb) == set(wb) and len(tb) == 2 * len(scalars(ROW))
    for k, v in tb.items():
        assert wb[k] == pytest.approx(v, rel=1e-6), k  # TensorBoard stores float32
    assert tb[("reward/mean", 2)] == 0.75 and wb[("memory/peak_over_budget/0", 2)] == 1.01
    assert wandb_history(cfg.save_path)[1]["rollout/samples._type"] == "table-file"
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["split"], r["reward"]) for r in rows] == [(1, "train", 1.0), (1, "eval", 0.0)]
    assert [json.loads(ln)["step"] for ln in log.path.read_text().splitlines()] == [1, 2]
    MetricsLog(cfg.save_path, resume_step=1).close()  # --resume from step 1's checkpoint
    assert [json.loads(ln)["step"] for ln in log.path.read_text().splitlines()] == [1]
    MetricsLog(cfg.save_path, resume_step=0).close()
    assert (tmp_path / "run" / "samples.jsonl").read_text() == ""


def test_a_resume_leaves_each_step_once_in_tensorboard(tmp_path):
    """A run logged steps 1-3, its last checkpoint is step 1's (a crash before step 2's commit):
    the resumed log logs steps 2-3 again, and every event file read on its own (no purge by a
    reader) holds each (tag, step) once, the resumed run's values for steps 2-3; the writer also
    marks the restart for TensorBoard (purge_step)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    log = MetricsLog(tmp_path)
    for step in (1, 2, 3):
        log.log(step, dict(ROW, reward_mean=step / 10))
    log.close()
    assert max(tensorboard_counts(log.tb_dir).values()) == 1
    log = MetricsLog(tmp_path, resume_step=1)
    for step in (2, 3):
        log.log(step, dict(ROW, reward_mean=step / 100))
    log.close()
    counts = tensorboard_counts(log.tb_dir)
    assert set(counts.values()) == {1} and {s for _, s in counts} == {1, 2, 3}
    assert len(counts) == 3 * len(scalars(ROW))
    tb = tensorboard_scalars(log.tb_dir)
    assert [tb[("reward/mean", s)] for s in (1, 2, 3)] == pytest.approx([0.1, 0.02, 0.03])
    files = sorted(Path(log.tb_dir).glob("events.out.tfevents.*"))
    assert len(files) == 2
    starts = [e.step for f in files for e in EventFileLoader(str(f)).Load() if e.HasField("session_log")]
    assert starts == [2]
    assert [json.loads(ln)["step"] for ln in log.path.read_text().splitlines()] == [1, 2, 3]


def test_each_steps_actions_and_pictures_go_to_the_run_folder_tensorboard_and_wandb(tmp_path, monkeypatch, fresh_wandb):
    """Three made-up steps through MetricsLog (``synthetic_run``): actions.jsonl holds each step's
    units and every rank's microbatches, rank by rank; the heatmap and the peaks go to
    ``pictures/``, to TensorBoard (read back with EventAccumulator, at the PNG's size) and to the
    offline W&B run as images; a resume keeps the covered steps' lines and pictures, a fresh run none."""
    import random

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from hilore_actor.report.pictures import png_size
    from hilore_actor.train.metrics import PICTURES

    from synthetic_run import RANKS, UNITS, write_run

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    seed = random.randrange(2**31)
    print("seed", seed)
    cfg = _cfg(tmp_path, "--use_wandb", "--wandb_run_name", "pictures")
    run = Path(cfg.save_path)
    acts = write_run(run, seed, steps=3, wandb=wandb_options(cfg))
    lines = [json.loads(ln) for ln in (run / "actions.jsonl").read_text().splitlines()]
    assert [a["step"] for a in lines] == [1, 2, 3] and all(a["units"] == UNITS for a in lines)
    for a, want in zip(lines, acts):
        assert list(a["ranks"]) == [str(r) for r in range(RANKS)]
        assert [[(m["actions"], m["skipped"]) for m in a["ranks"][str(r)]] for r in range(RANKS)] == want
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"images": 0})
    acc.Reload()
    history = wandb_history(run)
    for name, image in PICTURES.items():
        files = [run / "pictures" / f"step_{s:06d}_{name}.png" for s in (1, 2, 3)]
        assert [(e.step, e.width, e.height) for e in acc.Images(image)] == [
            (s, *png_size(f)) for s, f in zip((1, 2, 3), files)
        ]
        assert [history[s][f"{image}._type"] for s in (1, 2, 3)] == ["image-file"] * 3
    MetricsLog(run, resume_step=2).close()
    assert [json.loads(ln)["step"] for ln in (run / "actions.jsonl").read_text().splitlines()] == [1, 2]
    assert sorted(f.name[:11] for f in (run / "pictures").iterdir()) == ["step_000001"] * 2 + ["step_000002"] * 2
    MetricsLog(run).close()  # a fresh run into the folder (--overwrite_output_dir): nothing of the old one
    assert not (run / "actions.jsonl").exists() and not list((run / "pictures").iterdir())


def test_wandb_checks_before_ray(tmp_path, monkeypatch, fresh_wandb):
    import importlib.util

    from hilore_actor.train.config import ConfigError

    assert logging_errors(_cfg(tmp_path)) == []  # off: wandb is not even looked up
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"^--use_wandb needs the wandb package: pip install 'hilore-actor\[wandb\]'"):
        _cfg(tmp_path, "--use_wandb")
    monkeypatch.setattr(importlib.util, "find_spec", real)
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    monkeypatch.chdir(tmp_path)
    errs = logging_errors(_ns(tmp_path))
    assert len(errs) == 1 and "WANDB_MODE=offline" in errs[0] and "wandb login" in errs[0]


def _ns(tmp_path):
    """A parsed config with W&B switched on after validation (so the check can be called alone)."""
    cfg = _cfg(tmp_path)
    cfg.logger.wandb.enable = True
    return cfg


def test_eval_flags(tmp_path):
    from hilore_actor.train.config import ConfigError
    from hilore_actor.train.evaluation import due

    with pytest.raises(ConfigError, match="a held-out set is a dataset file"):
        _cfg(tmp_path, "--eval.dataset", "rg:basic_arithmetic")
    with pytest.raises(ConfigError, match="--eval.max_samples must be >= 1"):
        _cfg(tmp_path, "--eval.dataset", "x.jsonl", "--eval.max_samples", "0")
    cfg = _cfg(tmp_path, "--eval.dataset", "x.jsonl", "--eval.steps", "2", "--max_steps", "5")
    assert [s for s in range(1, 6) if due(cfg, s)] == [2, 4, 5]
    cfg.eval.steps = 0
    assert [s for s in range(1, 6) if due(cfg, s)] == [5]


@pytest.mark.parametrize("chunked", [True, False])
def test_entropy_statistic_leaves_the_loss_and_gradient_unchanged(chunked):
    """The learner's loss with ``entropy``: stats["entropy"] is the mean entropy of the full
    softmax over the response tokens (action mask), and the loss and every gradient are
    bitwise those without it."""
    from hilore_actor.grpo.microbatch import Microbatch, microbatch_loss
    from hilore_actor.models import LoraSpec, build_model, tiny_config

    torch.manual_seed(0)
    model = build_model(tiny_config("qwen2", hidden_size=64, vocab_size=300), lora=LoraSpec(4, 8))
    ids = torch.randint(3, 300, (1, 40))
    pos = torch.cat([torch.arange(15), torch.arange(25)])[None]
    mask = torch.zeros(1, 39)
    mask[0, 8:14] = mask[0, 25:] = 1
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits[:, :-1].float()  # as the learner
    logp = logits.log_softmax(-1)
    want = ((-(logp.exp() * logp).sum(-1)) * mask).sum() / mask.sum()
    old = logp.gather(-1, ids[:, 1:, None]).squeeze(-1) + 0.05 * torch.randn(1, 39)
    mb = Microbatch(ids, pos, old, old + 0.01, torch.randn(1, 39), mask, loss_options=dict(kl_coef=0.01))
    outs, grads = [], []
    for entropy in (False, True):
        model.zero_grad()
        out = microbatch_loss(model, mb, chunked_head=chunked, entropy=entropy)
        out.loss.backward()
        outs.append(out)
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert "entropy" not in outs[0].stats
    assert float(outs[1].stats["entropy"]) == pytest.approx(float(want), rel=1e-5)
    assert torch.equal(outs[0].loss, outs[1].loss)
    assert all(torch.equal(a, b) for a, b in zip(*grads)) and len(grads[0]) > 0
