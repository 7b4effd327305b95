"""The rollout-level replay buffer (``hilore_actor/rollout/replay.py``) and its place in the
training job: age eviction, fresh-anchored batches, priority draws, zero-advantage rollouts,
the checkpoint round trip, and a job run with ``--replay.enable`` resumed bitwise."""

import math
import shutil

import pytest
import torch

from hilore_actor.rollout.packing import pack_row
from hilore_actor.rollout.replay import ReplayBuffer, ReplayItem, split_row
from hilore_actor.train.config import parse_config


def _item(step, adv, n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return ReplayItem(
        torch.randint(0, 100, (n,), generator=g),
        2,
        adv,
        step,
        -torch.rand(n - 1, generator=g),
        -torch.rand(n - 1, generator=g),
    )


@pytest.fixture
def seed():
    s = torch.seed() % 2**31
    print("seed", s)
    return s


def test_nothing_older_than_max_age_is_ever_sampled(seed):
    buf = ReplayBuffer(capacity=1000, max_age=3, seed=seed)
    for step in range(10):
        buf.add([_item(step, 1.0 + i, seed=seed + i) for i in range(5)])
        drawn = buf.sample(4, step + 1)  # the next step draws
        assert drawn and all(step + 1 - it.step <= 3 for it in drawn)
        assert all(step + 1 - it.step <= 3 for it in buf.items)
    assert {it.step for it in buf.items} == {7, 8, 9}  # the draw at step 10 evicted step 6
    assert buf.evict(12) == 10 and {it.step for it in buf.items} == {9} and buf.evict(13) == 5


def test_age_eviction_counts_and_capacity_drops_the_oldest():
    buf = ReplayBuffer(capacity=7, max_age=2)
    for step in range(3):
        assert buf.add([_item(step, 0.5) for _ in range(3)]) == 3
    assert len(buf) == 7 and min(it.step for it in buf.items) == 0 and sum(it.step == 0 for it in buf.items) == 1
    assert buf.evict(3) == 1 and all(it.step >= 1 for it in buf.items)
    assert buf.evict(5) == 6 and len(buf) == 0 and buf.sample(3, 5) == []


def test_zero_advantage_rollouts_are_never_stored():
    buf = ReplayBuffer(capacity=100, max_age=5)
    assert buf.add([_item(0, 0.0), _item(0, 0.3), _item(0, -0.0), _item(0, -1.2)]) == 2
    assert sorted(it.advantage for it in buf.items) == [-1.2, 0.3]


@pytest.mark.parametrize("priority, alpha", [("abs_advantage", 1.0), ("abs_advantage", 2.0), ("uniform", 1.0)])
def test_draws_follow_abs_advantage_to_the_alpha(priority, alpha, seed):
    """One draw per step over many steps: each rollout's frequency is |A|^alpha / sum (or
    uniform) within 4.5 binomial standard errors."""
    advs = [0.1, -0.4, 0.8, 1.6, -2.5]
    buf = ReplayBuffer(capacity=100, max_age=10**9, priority=priority, alpha=alpha, seed=seed % 1000)
    buf.add([_item(0, a, seed=i) for i, a in enumerate(advs)])
    n = 20000
    counts = [0] * len(advs)
    index = {id(it): i for i, it in enumerate(buf.items)}
    for step in range(n):
        counts[index[id(buf.sample(1, step)[0])]] += 1
    w = [abs(a) ** alpha if priority == "abs_advantage" else 1.0 for a in advs]
    for c, wi in zip(counts, w):
        p = wi / sum(w)
        assert abs(c / n - p) <= 4.5 * math.sqrt(p * (1 - p) / n) + 1e-9, (counts, w)


def test_draws_are_without_replacement_and_repeat_for_the_same_step(seed):
    buf = ReplayBuffer(capacity=100, max_age=10, seed=seed)
    buf.add([_item(0, 0.1 * (i + 1), seed=i) for i in range(10)])
    a = [id(it) for it in buf.sample(6, 3)]
    b = [id(it) for it in buf.sample(6, 3)]
    assert len(set(a)) == 6 and a == b and len(buf.sample(50, 4)) == 10


def test_buffer_state_round_trips_through_a_checkpoint(tmp_path, seed):
    buf = ReplayBuffer(capacity=50, max_age=4, priority="abs_advantage", alpha=0.7, seed=seed)
    for step in range(4):
        buf.add([_item(step, (-1) ** i * (i + 1) * 0.2, seed=seed + 10 * step + i) for i in range(4)])
        buf.sample(3, step + 1)
    torch.save(buf.state_dict(), tmp_path / "replay.pt")
    back = ReplayBuffer(capacity=50, max_age=4, priority="abs_advantage", alpha=0.7, seed=seed)
    back.load_state_dict(torch.load(tmp_path / "replay.pt", weights_only=False))
    assert len(back) == len(buf)
    for x, y in zip(buf.items, back.items):
        assert x.to_dict().keys() == y.to_dict().keys()
        for k, v in x.to_dict().items():
            assert torch.equal(v, y.to_dict()[k]) if isinstance(v, torch.Tensor) else v == y.to_dict()[k]
    drawn = [(it.step, it.advantage) for it in buf.sample(5, 7)]
    assert drawn == [(it.step, it.advantage) for it in back.sample(5, 7)]


def test_a_replayed_rollout_keeps_its_log_probs_in_any_row(seed):
    """Packed beside other sequences, a replayed rollout's old and reference log-probs sit at
    its own positions (and nowhere else), and ``split_row`` gives them back."""
    g = torch.Generator().manual_seed(seed)
    fresh = [(torch.randint(0, 50, (n,), generator=g), 2, 0.5) for n in (7, 5)]
    it = _item(3, -0.8, n=6, seed=seed)
    row = pack_row([fresh[0], (it.ids, it.prompt_len, it.advantage, it.old_log_probs, it.ref_log_probs), fresh[1]])
    assert row["replayed"] == 1 and row["given_mask"].sum() == 5
    lengths = [7, 6, 5]
    assert torch.equal(split_row(row["given_old_log_probs"], lengths)[1], it.old_log_probs)
    assert torch.equal(split_row(row["given_ref_log_probs"], lengths)[1], it.ref_log_probs)
    mask = split_row(row["given_mask"], lengths)
    assert not mask[0].any() and mask[1].all() and not mask[2].any()
    assert row["input_ids"].shape[1] == 18 and row["given_mask"].shape == row["action_mask"].shape


def test_every_fresh_rollout_is_in_its_steps_batch(seed):
    """Fresh-anchored: the step's rows hold every fresh rollout once, then the replayed ones
    in whole updates; no row mixes the two."""
    from hilore_actor.train_grpo import draw_replay, shard_rows

    cfg = parse_config(["--preset", "tiny", "--replay.enable", "--replay.ratio", "1.5"])
    buf = ReplayBuffer(100, 2, seed=seed)
    buf.add([_item(0, 0.1 * (i + 1), seed=seed + i) for i in range(20)])
    g = torch.Generator().manual_seed(seed)
    fresh = [
        (torch.randint(0, 50, (int(torch.randint(4, 9, (1,), generator=g)),), generator=g), 2, 0.3) for _ in range(8)
    ]
    replayed = draw_replay(buf, cfg, 1)
    assert len(replayed) == 8  # 1.5 x 8 = 12 -> one whole update of --train.batch_size 8
    seqs = fresh + [(it.ids, it.prompt_len, it.advantage, it.old_log_probs, it.ref_log_probs) for it in replayed]
    rows = [r for rank in shard_rows(seqs, cfg) for r in rank]
    seen = sorted(i for r in rows for i in r["seq_index"])
    assert seen == list(range(16))
    for r in rows:
        assert all(i < 8 for i in r["seq_index"]) != bool(r.get("replayed"))


def test_replay_flags_are_checked():
    from hilore_actor.train.config import ConfigError

    for bad, message in (
        (["--replay.priority", "loss"], "--replay.priority"),
        (["--replay.max_age", "0"], "max_age"),
        (["--replay.ratio", "0.5"], "nothing would be replayed"),
    ):
        with pytest.raises(ConfigError, match=message):
            parse_config(["--preset", "tiny", "--replay.enable"] + bad)


@pytest.mark.slow  # two job runs: about 140 s on 2 cores (pytest -m slow)
def test_job_with_replay_logs_its_metrics_and_resumes_bitwise(tmp_path):
    """The tiny preset with ``--replay.enable`` (H/R, exact): 3 steps uninterrupted; then the
    same run resumed from its step-2 checkpoint (the buffer restored from it) reproduces step
    3 bitwise, the replayed rollouts included."""
    from train_job import job, metrics, same_training

    full = tmp_path / "full"
    r = job(full, "--replay.enable", "--max_steps", "3")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = metrics(full)
    assert [m["replayed"] for m in rows] == [0, 8, 8] and rows[0]["replay_buffer_size"] > 0
    for m in rows[1:]:
        assert m["replay_microbatches"] == m["fresh_microbatches"] == 4
        assert 0 < m["replay_mean_age"] <= 4 and m["replay_mean_abs_advantage"] > 0
        assert m["replay_clip_fraction"] >= m["fresh_clip_fraction"]
        assert m["replay_fraction_H"] + m["replay_fraction_R"] == pytest.approx(1.0)
    ck = full / "checkpoints"
    assert (ck / "step_3" / "replay.pt").is_file()
    part = tmp_path / "part"
    shutil.copytree(ck / "step_2", part / "checkpoints" / "step_2")
    (part / "checkpoints" / "latest").write_text("step_2")
    (part / "metrics.jsonl").write_text(
        "".join(ln + "\n" for ln in (full / "metrics.jsonl").read_text().splitlines()[:2])
    )
    r = job(part, "--replay.enable", "--max_steps", "3", "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "replay buffer restored" in r.stdout
    resumed = metrics(part)
    same_training(
        resumed,
        rows,
        [2],
        keys=(
            "loss",
            "policy_loss",
            "kl",
            "grad_norm",
            "reward_mean",
            "replayed",
            "replay_mean_age",
            "replay_mean_abs_advantage",
            "replay_clip_fraction",
            "replay_buffer_size",
        ),
    )
