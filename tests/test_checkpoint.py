"""Checkpoint folders: ``latest`` only ever names a complete checkpoint."""
import json

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
        assert CheckpointDir.meta(ck.latest()) == {"metrics": {"loss": step}, "step": step}
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
