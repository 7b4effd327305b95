"""Checkpoint folders: ``latest`` only ever names a complete checkpoint."""

import hashlib
import json

import pytest

from hilore_actor.train.checkpoint import CheckpointDir


def test_commit_is_atomic_and_prunes(tmp_path):
    ck = CheckpointDir(tmp_path / "ck")
    assert ck.latest() is None
    for step in (1, 2, 3):
        stage = ck.staging(step)
        (stage / "ds").mkdir()
        (stage / "ds" / "state.pt").write_bytes(b"x" * step)
        assert ck.latest() is None or CheckpointDir.meta(ck.latest())["step"] == step - 1  # staging is invisible
        ck.commit(stage, step, {"metrics": {"loss": step}}, keep=2)
        meta = CheckpointDir.meta(ck.latest())
        assert meta["metrics"] == {"loss": step} and meta["step"] == step
        assert meta["files"] == {"ds/state.pt": {"bytes": step, "sha256": hashlib.sha256(b"x" * step).hexdigest()}}
    assert sorted(p.name for p in (tmp_path / "ck").glob("step_*")) == ["step_2", "step_3"]
    # a crash mid-save (staging written, never committed) leaves latest on the last complete one
    stage = ck.staging(4)
    (stage / "partial").write_text("half")
    assert ck.latest().name == "step_3"
    # a rerun of the same step replaces the staging folder and then the checkpoint
    stage = ck.staging(4)
    assert not (stage / "partial").exists()
    ck.commit(stage, 4, {}, keep=0)
    assert ck.latest().name == "step_4" and json.loads((ck.latest() / "meta.json").read_text())["step"] == 4
    (tmp_path / "ck" / "latest").write_text("step_9")  # points at nothing complete
    assert ck.latest() is None


@pytest.mark.parametrize(
    "harm, why", [("truncate", "bytes"), ("flip", "checksum"), ("delete", "missing"), ("meta", "meta.json unreadable")]
)
def test_a_damaged_checkpoint_is_skipped_for_the_previous_one(tmp_path, harm, why):
    """Each way a checkpoint's files go bad: ``resumable`` names it and why, and returns the
    newest older one that checks out; with none left it returns None."""
    ck = CheckpointDir(tmp_path / "ck")
    for step in (1, 2):
        stage = ck.staging(step)
        (stage / "ds").mkdir()
        (stage / "ds" / "state.pt").write_bytes(bytes(range(256)) * 4 * step)
        (stage / "rng_rank0.pt").write_bytes(b"rng%d" % step)
        ck.commit(stage, step, {}, keep=2)
    assert ck.resumable(log=lambda m: None) == (tmp_path / "ck" / "step_2", [])
    bad = tmp_path / "ck" / "step_2"
    target = bad / "ds" / "state.pt"
    if harm == "truncate":
        target.write_bytes(target.read_bytes()[:100])
    elif harm == "flip":
        data = bytearray(target.read_bytes())
        data[7] ^= 1
        target.write_bytes(bytes(data))
    elif harm == "delete":
        target.unlink()
    else:
        (bad / "meta.json").write_text('{"step": 2, "fil')
    said = []
    good, skipped = ck.resumable(log=said.append)
    assert good == tmp_path / "ck" / "step_1" and [p for p, _ in skipped] == [bad] and why in skipped[0][1]
    assert len(said) == 1 and str(bad) in said[0] and str(good) in said[0] and why in said[0]
    (tmp_path / "ck" / "step_1" / "rng_rank0.pt").write_bytes(b"rng9")  # same size, other bytes
    assert ck.resumable(log=said.append)[0] is None


def test_checkpoints_from_before_checksums_are_taken_as_they_are(tmp_path):
    ck = CheckpointDir(tmp_path / "ck")
    stage = ck.staging(1)
    (stage / "x.pt").write_bytes(b"x")
    ck.commit(stage, 1, {})
    meta = json.loads((ck.latest() / "meta.json").read_text())
    del meta["files"]
    (ck.latest() / "meta.json").write_text(json.dumps(meta))
    assert ck.resumable(log=lambda m: None)[0] == ck.latest()


def test_resume_compares_the_saved_flags_refuses_replans_or_applies(tmp_path):
    """``train/resume.py`` on a committed checkpoint: the model, the optimizer's settings and the data
    are refused in one line naming flag and values; budget settings re-plan ("1.10" and 1.1 are one
    budget); --max_steps is applied; a checkpoint saved without flags checks what its files tell."""
    from hilore_actor.train.config import flatten_ns, parse_config
    from hilore_actor.train.resume import ResumeError, check, replan_flags, saved_config

    def flags(*argv):
        cfg = parse_config(["--preset", "tiny", *argv])
        cfg.hilore.plan_tokens = 128
        return cfg

    ck = CheckpointDir(tmp_path / "ck")
    stage = ck.staging(2)
    (stage / "rng_rank0.pt").write_bytes(b"")
    (stage / "rng_rank1.pt").write_bytes(b"")
    (stage / "hilore_rank0.json").write_text(json.dumps({"info": {"budget_spec": "1.10", "plan_tokens": 128}}))
    step = ck.commit(stage, 2, {"config": saved_config(flags())})
    said = []
    assert check(step, flatten_ns(flags("--max_steps", "9", "--hilore.budget", "1.1")), said.append) == [] and not said
    assert check(step, flatten_ns(flags("--hilore.budget", "1.3")), said.append) == ["hilore.budget"]
    assert said == [
        "[train] --resume with --hilore.budget '1.3' (the checkpoint's '1.10'): every rank plans anew "
        "(budget and plan) instead of restoring the checkpoint's"
    ]
    for argv, want in (
        (["--pretrain", "tiny:llama"], "(--pretrain) 'tiny:llama' (the checkpoint's 'tiny:qwen2')"),
        (["--ds.lora.rank", "4"], "--ds.lora.rank 4 (the checkpoint's 8)"),
        (["--actor.num_gpus_per_node", "1"], "the world size"),
        (["--actor.adam.lr", "0.01"], "optimizer state would silently restore"),
        (["--data.max_samples", "9"], "--data.max_samples 9 (the checkpoint's 1024)"),
    ):
        with pytest.raises(ResumeError) as e:
            check(step, flatten_ns(flags(*argv)), said.append)
        assert want in str(e.value) and "\n" not in str(e.value), str(e.value)
    meta = json.loads((step / "meta.json").read_text())
    (step / "meta.json").write_text(json.dumps(dict(meta, config=None)))  # saved before flags were kept
    assert replan_flags(step, flatten_ns(flags("--pretrain", "tiny:llama"))) == []
    assert replan_flags(step, flatten_ns(flags("--hilore.budget", "2GiB"))) == ["hilore.budget"]
    with pytest.raises(ResumeError, match="the world size"):
        check(step, flatten_ns(flags("--actor.num_gpus_per_node", "1")), said.append)
