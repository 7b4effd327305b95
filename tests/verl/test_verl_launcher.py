"""HiLoRe's verl launcher (``hilore_actor/verl/main_ppo.py``): verl's own config composed with
HiLoRe's overrides, accepted or refused with one message. No engine runs here."""

import subprocess
import sys

import pytest

pytest.importorskip("verl")
pytest.importorskip("hydra")

GRPO = [
    "algorithm.adv_estimator=grpo",
    "data.train_files=/tmp/train.parquet",
    "data.val_files=/tmp/val.parquet",
    "data.max_prompt_length=512",
    "data.max_response_length=1024",
    "data.train_batch_size=64",
    "actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-Instruct",
    "actor_rollout_ref.actor.ppo_mini_batch_size=16",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "actor_rollout_ref.rollout.n=8",
    "actor_rollout_ref.rollout.name=vllm",
    "trainer.n_gpus_per_node=8",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
]


def _example_overrides():
    """The overrides of examples/verl_grpo_hilore.sh, its variables filled in."""
    import re
    import shlex
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "examples" / "verl_grpo_hilore.sh").read_text()
    cmd = text[text.index("python3 -m hilore_actor.verl.main_ppo") :].split("\n#")[0].replace("\\\n", " ")
    values = {"MODEL": "/models/qwen", "TRAIN": "/d/t.parquet", "TEST": "/d/v.parquet", "GPUS": "8"}
    cmd = re.sub(r'"\$(MODEL|TRAIN|TEST|GPUS)"', lambda m: values[m.group(1)], cmd)
    return shlex.split(cmd)[3:]


def test_the_example_recipe_composes_and_validates(monkeypatch):
    """examples/verl_grpo_hilore.sh's overrides, through the launcher: verl's config with the
    hilore backend passes verl's own validation (whose LoRA-with-vLLM check asks vllm for its
    largest LoRA rank: that one helper stands in for vllm, which has no CPU build)."""
    import sys
    import types

    from verl.utils.config import validate_config

    fake = types.ModuleType("verl.workers.rollout.vllm_rollout.utils")
    fake.get_vllm_max_lora_rank = lambda rank: rank
    monkeypatch.setitem(sys.modules, "verl.workers.rollout.vllm_rollout.utils", fake)

    from hilore_actor.verl.main_ppo import compose, launch_args

    overrides, env = launch_args(_example_overrides())
    cfg = compose(overrides)
    validate_config(cfg, use_reference_policy=True, use_critic=False)
    assert cfg.actor_rollout_ref.actor.strategy == "hilore" and cfg.actor_rollout_ref.model.lora_rank == 16


def test_launcher_composes_a_real_grpo_config(monkeypatch, capsys):
    """verl's own config, composed with HiLoRe's overrides, passes verl's validation; the actor
    config names the hilore backend and the workers get the settings and job facts. verl's
    default gradient checkpointing is turned off with one line: HiLoRe's plan replaces it."""
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    from hilore_actor.verl.main_ppo import REGISTER, compose, launch_args
    from hilore_actor.verl.settings import CONFIG_ENV, from_env

    overrides, env = launch_args(
        GRPO
        + [
            "+actor_rollout_ref.actor.hilore.enable=true",
            "+actor_rollout_ref.actor.hilore.budget=1.25",
            "actor_rollout_ref.actor.hilore.mode=hilore-hr",
        ]
    )
    assert capsys.readouterr().out.splitlines() == [
        "[hilore] actor_rollout_ref.model.enable_gradient_checkpointing=true is turned off: HiLoRe's plan recomputes "
        "per unit instead"
    ]
    cfg = compose(overrides)
    assert cfg.actor_rollout_ref.model.enable_gradient_checkpointing is False
    validate_config(cfg, use_reference_policy=True, use_critic=False)
    assert omega_conf_to_dataclass(cfg.actor_rollout_ref.actor).strategy == "hilore"
    assert cfg.ray_kwargs.ray_init.runtime_env.env_vars == env and env["VERL_USE_EXTERNAL_MODULES"] == REGISTER
    monkeypatch.setenv(CONFIG_ENV, env[CONFIG_ENV])
    hcfg, job = from_env()
    assert (hcfg.budget, hcfg.mode) == ("1.25", "hilore-hr")
    assert job["plan_tokens"] == 4 * (512 + 1024) and job["group_size"] == 8 and job["loss_options"]["kl_coef"] == 0.001
    assert launch_args(GRPO) == (GRPO, {})  # without enable=true verl runs unchanged


@pytest.mark.parametrize(
    "given,fsdp",
    [
        (["actor_rollout_ref.actor.strategy=fsdp"], "fsdp"),
        (["actor_rollout_ref.actor.strategy=fsdp2"], "fsdp2"),
        (["actor_rollout_ref.actor.strategy=fsdp", "+actor_rollout_ref.actor.hilore.fsdp=fsdp"], "fsdp"),
        (["+actor_rollout_ref.actor.hilore.fsdp=fsdp"], "fsdp"),
        ([], "fsdp2"),
    ],
)
def test_a_recipes_fsdp_strategy_is_the_version_hilore_wraps_with(monkeypatch, given, fsdp):
    """A recipe that already says ``strategy=fsdp|fsdp2`` runs with HiLoRe on as it stands: the
    launcher swaps the strategy for ``hilore`` (once, so verl validates the config) and hands
    the version to the workers; the ``hilore.fsdp`` override says the same, fsdp2 by default."""
    from verl.utils.config import validate_config

    from hilore_actor.verl.main_ppo import compose, launch_args
    from hilore_actor.verl.settings import CONFIG_ENV, from_env

    overrides, env = launch_args(GRPO + ["+actor_rollout_ref.actor.hilore.enable=true"] + given)
    assert [a for a in overrides if "actor.strategy" in a] == ["actor_rollout_ref.actor.strategy=hilore"]
    cfg = compose(overrides)
    validate_config(cfg, use_reference_policy=True, use_critic=False)
    assert cfg.actor_rollout_ref.actor.strategy == "hilore"
    monkeypatch.setenv(CONFIG_ENV, env[CONFIG_ENV])
    assert from_env()[1]["fsdp"] == fsdp


@pytest.mark.parametrize(
    "bad,word",
    [
        ("+actor_rollout_ref.actor.hilore.budget=lots", "budget"),
        ("+actor_rollout_ref.actor.hilore.speed=2", "speed"),
        ("+actor_rollout_ref.actor.hilore.enable=perhaps", "enable"),
        ("+actor_rollout_ref.actor.hilore.fsdp=fsdp3", "fsdp"),
        ("actor_rollout_ref.actor.strategy=fsdp2 +actor_rollout_ref.actor.hilore.fsdp=fsdp", "disagree"),
        ("actor_rollout_ref.actor.strategy=megatron", "Megatron is not supported"),
        ("+actor_rollout_ref.actor.hilore.chunked_head=false", "chunked_head=false has no effect under verl"),
    ],
)
def test_bad_overrides_stop_the_launcher_with_one_message(capsys, bad, word):
    from hilore_actor.verl.main_ppo import main

    args = GRPO + ["+actor_rollout_ref.actor.hilore.enable=true"] + bad.split()
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and word in err and len(err.splitlines()) == 1


def test_megatron_and_a_missing_verl_stop_the_launcher_with_one_message(capsys, monkeypatch):
    import sys

    from hilore_actor.verl.main_ppo import main

    args = GRPO + ["+actor_rollout_ref.actor.hilore.enable=true"]
    assert main(["--config-name", "ppo_megatron_trainer"] + args) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith("error: ")
        and "megatron" in err
        and "Megatron is not supported" in err
        and len(err.splitlines()) == 1
    )
    monkeypatch.setitem(sys.modules, "verl", None)  # import verl raises ImportError
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: verl is not installed") and "verl==0.9.1" in err and len(err.splitlines()) == 1


def _launcher(*args):
    """The launcher as a user runs it: (exit code, stdout, stderr)."""
    done = subprocess.run(
        [sys.executable, "-m", "hilore_actor.verl.main_ppo", *args], capture_output=True, text=True, timeout=300
    )
    return done.returncode, done.stdout, done.stderr


def test_help_lists_every_hilore_override_with_its_default():
    """``--help`` exits 0 on a CPU machine and names each override from the one flag table
    (``learner/settings.py``) and the verl-only keys, each with its default; a shared setting verl
    cannot honour (refused) is not offered, and one line says so."""
    from hilore_actor.learner.settings import HILORE_FLAGS
    from hilore_actor.verl.main_ppo import shown
    from hilore_actor.verl.settings import NO_EFFECT, PREFIX, VERL_KEYS

    code, out, err = _launcher("--help")
    assert code == 0 and "Traceback" not in out + err, err
    entries, key = {}, None
    for line in out.splitlines():
        if line.startswith(f"  +{PREFIX}"):
            key = line.strip()[len("+" + PREFIX) : -len("=VALUE")]
            entries[key] = ""
        elif key is not None and line.startswith(" " * 6):
            entries[key] += " " + line.strip()
    keys = [(k, d) for k, (d, _) in VERL_KEYS.items()] + [
        (n[len("hilore.") :], shown(d)) for n, _, d, _ in HILORE_FLAGS if n[len("hilore.") :] not in NO_EFFECT
    ]
    assert list(entries) == [k for k, _ in keys] and "chunked_head" in NO_EFFECT
    for key, default in keys:
        assert entries[key].endswith(f"(default: {default})"), (key, entries[key])
    assert "verl.trainer.main_ppo --help" in out
    assert f"Not taken under verl (refused): +{PREFIX}chunked_head" in out


@pytest.mark.parametrize(
    "bad,word",
    [
        ("+actor_rollout_ref.actor.hilore.budget=lots", "budget"),
        ("actor_rollout_ref.actor.strategy=megatron", "Megatron is not supported"),
        ("--config-name=ppo_megatron_trainer", "Megatron is not supported"),
        ("actor_rollout_ref.actor.no_such_option=1", "no_such_option"),
        ("+actor_rollout_ref.actor.hilore.skip_zero_advantage=on", "use_kl_loss=true adds a KL term"),
    ],
)
def test_the_launchers_error_is_its_last_line(bad, word):
    """A refused command line ends the launcher's output with its one-line error, exit code 2,
    no traceback: verl's import-time warnings (no accelerator, engines not installed) do not
    follow it, since the checks read verl's config without importing verl."""
    code, out, err = _launcher(*GRPO, "+actor_rollout_ref.actor.hilore.enable=true", bad)
    assert code == 2 and "Traceback" not in out + err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and word in last, err
    assert not out.strip(), out


def test_hilore_overrides_without_enable_are_refused_not_dropped(capsys):
    """Without ``enable=true`` verl runs unchanged, so a HiLoRe override would do nothing: one line."""
    from hilore_actor.verl.main_ppo import main

    assert (
        main(GRPO + ["+actor_rollout_ref.actor.hilore.budget=1.25", "+actor_rollout_ref.actor.hilore.mode=hilore"]) == 2
    )
    err = capsys.readouterr().err.strip()
    assert err == (
        "error: +actor_rollout_ref.actor.hilore.budget, +actor_rollout_ref.actor.hilore.mode given without "
        "+actor_rollout_ref.actor.hilore.enable=true (verl runs unchanged without it): add it, or drop them"
    )
