"""The training job's flags (``train/config.py``): no flag given is silently without effect, a
preset's task settings never reach a user's data, and OpenRLHF's spellings are accepted."""

from types import SimpleNamespace

import pytest

from hilore_actor.train.config import BACKENDS, FLAGS, ConfigError, ignored_notes, parse_config

TINY = ["--preset", "tiny"]

# A value other than the default for every --eval.*, --replay.* and --hilore.* flag (a new flag
# fails test_every_flag_of_the_table_has_a_value until it is added here and classified below).
VALUES = {
    "eval.dataset": None,  # the switch of the eval.* flags (the file is read in run, not here)
    "eval.steps": "2",
    "eval.max_samples": "7",
    "eval.input_key": "q",
    "eval.label_key": "a",
    "replay.enable": None,  # the switch of the replay.* flags
    "replay.max_age": "2",
    "replay.ratio": "2",
    "replay.capacity": "64",
    "replay.priority": "uniform",
    "replay.alpha": "0.5",
    "hilore.budget": "1.2",
    "hilore.budget_scope": "activations",
    "hilore.fill": "0.9",
    "hilore.mode": "hilore-static",
    "hilore.delta": "0.02",
    "hilore.tolerance": "0.02",
    "hilore.refresh_every": "2",
    "hilore.calibration_batches": "3",
    "hilore.calibration": "cal.json",
    "hilore.codec": "int8",
    "hilore.partial": "true",
    "hilore.token_rows": "0.25",
    "hilore.compile": "true",
    "hilore.compile_activation_budget": "0.5",
    "hilore.compile_layer_regions": "true",
    "hilore.chunked_head": "false",
    "hilore.plan_tokens": "512",
    "hilore.profile_repeats": "3",
    "hilore.loo": "false",
    "hilore.skip_zero_advantage": "off",
}
# What every backend reads (B, its scope, the planning microbatch, the skip); the rest of
# --hilore.* shapes HiLoRe's plan only.
EVERY_BACKEND = {"hilore.budget", "hilore.budget_scope", "hilore.plan_tokens", "hilore.skip_zero_advantage"}
NEEDS_COMPILE = {"hilore.compile_activation_budget", "hilore.compile_layer_regions"}
SWITCHES = {"eval.": ["--eval.dataset", "held_out.jsonl"], "replay.": ["--replay.enable"]}


def _table():
    return [f[0] for f in FLAGS if f[0].split(".")[0] in ("eval", "replay", "hilore")]


def test_every_flag_of_the_table_has_a_value():
    assert set(_table()) == set(VALUES)


def _outcome(argv, tmp_path):
    """("error", message) or ("notes", the notes printed) for the tiny preset with ``argv``."""
    try:
        cfg = parse_config([*TINY, "--save_path", str(tmp_path / "run"), *argv])
    except ConfigError as e:
        return "error", str(e)
    return "notes", ignored_notes(cfg)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("flag", [f for f in VALUES if VALUES[f] is not None])
def test_a_flag_without_effect_is_refused_or_said(flag, backend, tmp_path):
    """Each flag, alone and beside its switch, under each backend: where it acts, accepted
    without a note; where it cannot act, refused (a dependent flag without its switch, a
    compile setting without compiling) or, harmless (a plan setting under gc or none, where a
    comparison keeps the command), one line naming it."""
    prefix = flag.split(".")[0] + "."
    argv = ["--actor_backend", backend, f"--{flag}", VALUES[flag]]
    kind, said = _outcome(argv, tmp_path)
    if prefix in SWITCHES:
        assert kind == "error" and f"--{flag} given without {SWITCHES[prefix][0]}" in said, said
        kind, said = _outcome(argv + SWITCHES[prefix], tmp_path)
        assert (kind, said) == ("notes", []), said
    elif flag in NEEDS_COMPILE and backend == "hilore":
        assert kind == "error" and f"--{flag} given without --hilore.compile true" in said, said
        assert _outcome(argv + ["--hilore.compile", "true"], tmp_path) == ("notes", [])
    elif backend == "hilore" or flag in EVERY_BACKEND:
        assert (kind, said) == ("notes", []), said
    else:
        assert kind == "notes" and len(said) == 1, said
        assert f"--actor_backend {backend}: --{flag} has no effect" in said[0], said


def test_plan_settings_under_gc_are_one_line_for_all(tmp_path):
    kind, said = _outcome(["--actor_backend", "gc", "--hilore.mode", "hilore-hr", "--hilore.codec", "int8"], tmp_path)
    assert kind == "notes" and said == [
        "[train] --actor_backend gc: --hilore.codec, --hilore.mode have no effect (HiLoRe's plan only; gc recomputes "
        "every layer)"
    ]


def test_the_reference_workers_gpus_without_the_kl_loss_are_said(tmp_path):
    """No KL loss (or its coefficient 0): the job starts no reference worker, so its GPU share is one line."""
    note = "[train] --ref.num_gpus has no effect: without the KL loss the job starts no reference worker"
    assert _outcome(["--ref.num_gpus", "0.5"], tmp_path) == ("notes", [])  # the tiny preset's KL loss reads it
    for off in (["--algo.kl.use_loss", "false"], ["--algo.kl.init_coef", "0"]):
        assert _outcome(["--ref.num_gpus", "0.5", *off], tmp_path) == ("notes", [note])


def test_l_settings_under_hilore_hr_are_said(tmp_path):
    kind, said = _outcome(["--hilore.mode", "hilore-hr", "--hilore.codec", "int8", "--hilore.delta", "0.1"], tmp_path)
    assert kind == "notes" and said == [
        "[train] --hilore.mode hilore-hr: --hilore.codec, --hilore.delta have no effect (L's settings; hilore-hr "
        "stores or recomputes only)"
    ]


def test_a_presets_instruction_and_options_stay_with_its_own_task(tmp_path):
    demo = parse_config(["--preset", "cpu-demo", "--save_path", str(tmp_path / "a")])
    assert demo.data.instruction == " Answer with the number only." and demo.data.task_options
    mine = parse_config(["--preset", "cpu-demo", "--data.prompt_dataset", "mine.jsonl", "--save_path", str(tmp_path)])
    assert mine.data.instruction is None and mine.data.task_options is None
    own = parse_config(
        ["--preset", "cpu-demo", "--data.prompt_dataset", "mine.jsonl", "--data.instruction", " Be brief."]
        + ["--save_path", str(tmp_path / "b")]
    )
    assert own.data.instruction == " Be brief."  # the user's own instruction is theirs


@pytest.mark.parametrize("spelling, value", [("true", "on"), ("false", "off"), ("yes", "on"), ("0", "off")])
def test_boolean_spellings_of_an_on_off_auto_setting(spelling, value, tmp_path):
    argv = [*TINY, "--algo.kl.use_loss", "false", "--hilore.skip_zero_advantage", spelling]
    assert parse_config(argv + ["--save_path", str(tmp_path)]).hilore.skip_zero_advantage == value
    from hilore_actor.learner.settings import parse_hilore

    assert parse_hilore({"skip_zero_advantage": spelling}) == {"skip_zero_advantage": value}  # OpenRLHF, verl
    with pytest.raises(ConfigError, match="--hilore.skip_zero_advantage 'maybe': choose auto, on, off"):
        parse_config([*TINY, "--hilore.skip_zero_advantage", "maybe", "--save_path", str(tmp_path)])


def test_openrlhfs_gradient_checkpointing_switch_is_the_drop_ins_line(tmp_path):
    """The line the OpenRLHF drop-in prints (``openrlhf/policy_actor.py``) under hilore; gc is
    that switch; none is refused (the bad-input table)."""
    from pathlib import Path

    import hilore_actor

    drop_in = (Path(hilore_actor.__file__).parent / "openrlhf" / "policy_actor.py").read_text()  # imports vLLM
    kind, said = _outcome(["--actor.gradient_checkpointing_enable"], tmp_path)
    assert kind == "notes" and len(said) == 1 and f'"{said[0]}"' in drop_in, said
    assert _outcome(["--actor.gradient_checkpointing_enable", "--actor_backend", "gc"], tmp_path) == ("notes", [])


def test_held_out_keys_default_to_the_training_ones(tmp_path):
    from hilore_actor.train.evaluation import load_eval_task

    (tmp_path / "h.jsonl").write_text('{"question": "1+1", "solution": "2", "q": "3+3", "a": "6"}\n')
    argv = [*TINY, "--save_path", str(tmp_path / "r"), "--eval.dataset", str(tmp_path / "h.jsonl")]
    argv += ["--data.prompt_dataset", str(tmp_path / "h.jsonl")]
    seen = []

    def load(cfg, dataset, keys):
        seen.append(keys)
        return SimpleNamespace(examples=[])

    load_eval_task(parse_config(argv + ["--data.input_key", "question", "--data.label_key", "solution"]), load)
    load_eval_task(parse_config(argv + ["--eval.input_key", "q", "--eval.label_key", "a"]), load)
    assert seen == [("question", "solution"), ("q", "a")]
