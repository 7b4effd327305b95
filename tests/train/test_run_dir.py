"""The run folder (``train/run_dir.py``): a named folder holding a run is refused for a fresh
run and left byte-identical; unnamed, every run gets its own folder; --resume finds the newest;
a folder another process's run holds is refused, untouched."""

import hashlib
import os
from pathlib import Path

import pytest
from folder_holder import held_by_another_process

from hilore_actor.train.config import parse_config
from hilore_actor.train.run_dir import LOCK_FILE, RunDirError, release_all, resolve


@pytest.fixture(autouse=True)
def _release():
    yield
    release_all()  # what the job's end does


def digests(folder):
    """The user's and the run's files (not the job's lock)."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != LOCK_FILE
    }


def fake_run(folder):
    (folder / "checkpoints" / "step_1").mkdir(parents=True)
    (folder / "checkpoints" / "latest").write_text("step_1")
    (folder / "metrics.jsonl").write_text('{"step": 1}\n')
    (folder / "tensorboard").mkdir()
    (folder / "tensorboard" / "events.out").write_bytes(b"\x00\x01")


def cfg(*args):
    return parse_config(["--preset", "tiny", *args])


def test_a_named_folder_holding_a_run_is_refused_and_untouched(tmp_path):
    fake_run(tmp_path)
    before = digests(tmp_path)
    with pytest.raises(RunDirError, match="already holds a run .*--resume.*--overwrite_output_dir"):
        resolve(cfg("--save_path", str(tmp_path)), log=print)
    assert digests(tmp_path) == before
    c = cfg("--save_path", str(tmp_path), "--resume")
    resolve(c, log=print)
    assert c.save_path == str(tmp_path) and digests(tmp_path) == before
    (tmp_path / "notes.txt").write_text("mine")
    resolve(cfg("--save_path", str(tmp_path), "--overwrite_output_dir"), log=print)
    assert sorted(os.listdir(tmp_path)) == [LOCK_FILE, "notes.txt"]  # the run's outputs only


def test_unnamed_folders_get_one_folder_per_run_and_resume_takes_the_newest(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    seen = []
    for _ in range(2):
        c = cfg()  # the tiny preset's save_path: runs/tiny
        resolve(c, log=seen.append)
        fake_run(tmp_path / c.save_path)
    first, second = (tmp_path / s.split(": ")[1] for s in seen)
    assert first != second and first.parent == second.parent == tmp_path / "runs" / "tiny"
    os.utime(first / "checkpoints" / "latest", (1, 1))
    c = cfg("--resume")
    resolve(c, log=print)
    assert Path(c.save_path).resolve() == second.resolve()


def test_a_folder_that_cannot_be_written_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(RunDirError, match="a file, not a folder"):
        resolve(cfg("--save_path", str(tmp_path / "file")), log=print)
    with pytest.raises(RunDirError, match="cannot write there"):  # a folder under a file cannot be made
        resolve(cfg("--save_path", str(tmp_path / "file" / "run")), log=print)


def test_a_folder_another_run_holds_is_refused_and_untouched(tmp_path):
    """Another process's job holds the folder (as ``train_grpo`` does while it runs): neither
    --resume nor --overwrite_output_dir may touch it, and the error names the holder; once that
    process ends, --resume takes the folder."""
    fake_run(tmp_path)
    before = digests(tmp_path)
    with held_by_another_process(tmp_path) as pid:
        for flag in ("--resume", "--overwrite_output_dir"):
            with pytest.raises(RunDirError, match=f"in use by another run \\(pid {pid} on .*--resume"):
                resolve(cfg("--save_path", str(tmp_path), flag), log=print)
            assert digests(tmp_path) == before, flag
    c = cfg("--save_path", str(tmp_path), "--resume")
    resolve(c, log=print)
    assert c.save_path == str(tmp_path) and digests(tmp_path) == before
