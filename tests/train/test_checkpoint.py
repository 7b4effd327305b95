"""Checkpoint folders: ``latest`` only ever names a complete checkpoint; ``--resume`` checks the saved
flags; files of an older layout are read in the current one (``migrate``)."""

import hashlib
import json

import pytest

from hilore_actor.train.checkpoint import FORMAT_VERSION, CheckpointDir, migrate, read_state


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


def test_a_version_1_checkpoint_without_checksums_is_taken_as_it_is(tmp_path):
    ck = CheckpointDir(tmp_path / "ck")
    stage = ck.staging(1)
    (stage / "x.pt").write_bytes(b"x")
    ck.commit(stage, 1, {})
    meta = json.loads((ck.latest() / "meta.json").read_text())
    assert meta["format_version"] == FORMAT_VERSION
    del meta["files"], meta["format_version"]
    (ck.latest() / "meta.json").write_text(json.dumps(meta))
    assert ck.resumable(log=lambda m: None)[0] == ck.latest()
    assert CheckpointDir.meta(ck.latest())["files"] == {}


def test_resume_compares_the_saved_flags_refuses_replans_or_applies(tmp_path):
    """``train/resume.py`` on a committed checkpoint: the model, the optimizer's settings and the data
    are refused in one line naming flag and values; budget settings re-plan ("1.10" and 1.1 are one
    budget); --max_steps is applied; a checkpoint saved without flags checks what its files tell."""
    from hilore_actor.train.config import flatten_ns, parse_config
    from hilore_actor.train.resume import ResumeError, check, replan_flags, saved_config

    def flags(*argv):  # B as the plan files below were made with
        cfg = parse_config(["--preset", "tiny", "--hilore.budget", "1.10", *argv])
        cfg.hilore.plan_tokens = 128
        return cfg

    ck = CheckpointDir(tmp_path / "ck")
    stage = ck.staging(2)
    (stage / "rng_rank0.pt").write_bytes(b"")
    (stage / "rng_rank1.pt").write_bytes(b"")
    for rank in (0, 1):
        (stage / f"hilore_rank{rank}.json").write_text(
            json.dumps({"budget": 1000, "info": {"budget_spec": "1.10", "plan_tokens": 128}})
        )
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
    del meta["config"], meta["format_version"]  # a version 1 checkpoint that kept no flags
    (step / "meta.json").write_text(json.dumps(meta))
    assert replan_flags(step, flatten_ns(flags("--pretrain", "tiny:llama"))) == []
    assert replan_flags(step, flatten_ns(flags("--hilore.budget", "2GiB"))) == ["hilore.budget"]
    with pytest.raises(ResumeError, match="the world size"):
        check(step, flatten_ns(flags("--actor.num_gpus_per_node", "1")), said.append)
    said.clear()
    assert check(step, flatten_ns(flags()), said.append) == [] and said == [
        f"[train] {step} keeps no flags of its run: only the world size and the budget settings are checked; "
        "the model, LoRA, dtype, optimizer and data flags must be the run's"
    ]


def test_migrate_brings_version_1_files_to_the_current_layout():
    """The layouts version 1 wrote: the newest (flags, checksums, every plan field) and the
    oldest (neither flags nor checksums; a plan with one calibration, no scope, fill or planning
    peak). ``migrate`` leaves its input alone and is a no-op on the current layout."""
    cal = {"groups": {"a": 0}, "samples": [{"batch": 0}]}
    info = {
        "plan_tokens": 128,
        "gc_peak_bytes": 900,
        "budget_bytes": 1000,
        "budget_spec": "1.10",
        "budget_scope": "device",
        "resident_bytes": 50,
        "fill": 0.9,
        "plan_peak_over_budget": 0.97,
        "plan_peak_phase": "gc",
        "calibration": "job",
    }
    rank = {"budget": 1000, "info": info, "plan": {"shape": "s"}, "calibration": cal, "calibrations": {"L": cal}}
    newest = {
        "meta": {"step": 2, "metrics": {}, "config": {"hilore.budget": "1.10", "world_size": 2}, "files": {}},
        "ranks": [rank, rank],
    }
    before = json.dumps(newest)
    got = migrate(newest)
    assert json.dumps(newest) == before  # the input is left as it is
    want_rank = {
        "budget": 1000,
        "info": info,
        "plan": {"shape": "s"},
        "calibrations": {"L": cal},
        "warmed_up": True,
        "online": None,
        "format_version": 3,
    }
    want_meta = dict(newest["meta"], skipped_in_a_row=0, format_version=3)
    assert got == {"meta": want_meta, "ranks": [want_rank, want_rank]}
    assert migrate(got) == got

    oldest_info = {"plan_tokens": 128, "gc_peak_bytes": 900, "budget_bytes": 1000}
    oldest = {
        "meta": {"step": 2, "metrics": {}},
        "ranks": [{"budget": 1000, "info": oldest_info, "plan": {"shape": "s"}, "calibration": cal}] * 2,
    }
    got = migrate(oldest)
    assert got["meta"] == {
        "step": 2,
        "metrics": {},
        "config": {"world_size": 2, "hilore.plan_tokens": 128},  # what the plan files tell
        "partial_config": True,
        "files": {},
        "skipped_in_a_row": 0,
        "format_version": 3,
    }
    assert got["ranks"][0] == {
        "budget": 1000,
        "info": dict(
            oldest_info,
            budget_spec="1000",
            budget_scope="activations",
            resident_bytes=0,
            fill=0.95,
            plan_peak_over_budget=None,
            plan_peak_phase=None,
        ),
        "plan": {"shape": "s"},
        "calibrations": {"L": cal},
        "warmed_up": True,
        "online": None,
        "format_version": 3,
    }
    gc_rank = migrate({"meta": {}, "ranks": [{"budget": 1000, "info": dict(info)}]})["ranks"][0]
    assert "calibrations" not in gc_rank and gc_rank["format_version"] == 3  # gc and none keep no plan


def test_migrate_gives_a_version_2_checkpoint_the_state_kept_across_steps():
    """Version 2 kept no state across steps: a rank is warmed up (every checkpoint follows an
    update) with a fresh online chooser, and the driver's non-finite streak starts at 0; what
    version 3 wrote stays as it is."""
    rank = {"budget": 1000, "info": {"budget_scope": "device"}, "format_version": 2}
    got = migrate({"meta": {"step": 4, "files": {}, "config": {}, "format_version": 2}, "ranks": [rank]})
    assert got["meta"]["skipped_in_a_row"] == 0 and got["meta"]["format_version"] == FORMAT_VERSION == 3
    assert got["ranks"] == [dict(rank, warmed_up=True, online=None, format_version=3)]
    kept = dict(rank, warmed_up=False, online={"calls": 5, "last": {"u": "H"}}, format_version=3)
    meta = {"step": 4, "files": {}, "config": {}, "skipped_in_a_row": 2, "format_version": 3}
    assert migrate({"meta": meta, "ranks": [kept]}) == {"meta": meta, "ranks": [kept]}


def test_a_version_1_checkpoint_resumes_its_plan(tmp_path):
    """A rank's plan file as version 1 wrote it (no ``format_version``; its L calibration kept
    twice, or once as ``calibration`` alone in its oldest files), read back through
    ``read_state``, restores the rank's planner: the same B, plan and calibration; saved again,
    it is a current file that restores the same."""
    from dataclasses import asdict

    from hilore_actor.allocation import ShapePlan
    from hilore_actor.allocation.calibration import Calibration
    from hilore_actor.allocation.profiling import UnitCosts
    from hilore_actor.grpo.microbatch import microbatch_loss
    from hilore_actor.learner.plan import restore_rank_planner
    from hilore_actor.learner.settings import hilore_settings
    from hilore_actor.models import LoraSpec, build_model, tiny_config

    model = build_model(tiny_config("qwen2", hidden_size=32, num_layers=2, vocab_size=64), lora=LoraSpec(4, 8), seed=0)
    hcfg = hilore_settings(mode="hilore")
    units = ["model.layers.0", "model.layers.1"]
    cal = Calibration(
        "int8",
        {"layer:early": 0.5},
        {u: 0.01 for u in units},
        {u: 1.0 for u in units},
        {u: "layer:early" for u in units},
    )
    sp = ShapePlan("s", UnitCosts("s", 1.0, 1000, tokens=64), {units[0]: "L", units[1]: "R"}, 100.0, 0.015, 0.015)
    info = {
        "plan_tokens": 64,
        "gc_peak_bytes": 900,
        "budget_bytes": 1000,
        "budget_spec": "1.10",
        "budget_scope": "device",
        "resident_bytes": 100,
        "fill": 0.95,
        "plan_peak_over_budget": 0.9,
        "plan_peak_phase": "gc",
    }
    newest = {
        "budget": 1000,
        "info": info,
        "plan": sp.to_dict(),
        "calibration": asdict(cal),
        "calibrations": {"L": asdict(cal)},
    }
    oldest = {k: v for k, v in newest.items() if k != "calibrations"}
    ck = CheckpointDir(tmp_path / "ck")
    for step, rank in enumerate((newest, oldest), 1):
        stage = ck.staging(step)
        (stage / "hilore_rank0.json").write_text(json.dumps(rank))
        folder = ck.commit(stage, step, {"config": {"world_size": 1}})
        (saved,) = read_state(folder)["ranks"]
        again = restore_rank_planner(model, saved, hcfg, microbatch_loss, "hilore", log=lambda *_: None)
        assert again.budget == 1000 and again.resident_bytes == 100 and again.info["fill"] == 0.95
        assert again.sp == sp and again.planner.calibrations == {"L": cal}
        resaved = json.loads(json.dumps(dict(again.state(), format_version=FORMAT_VERSION)))
        assert migrate({"meta": {}, "ranks": [resaved]})["ranks"] == [resaved] and "calibration" not in resaved
        assert resaved["calibrations"] == {"L": asdict(cal)} and resaved["plan"] == sp.to_dict()
