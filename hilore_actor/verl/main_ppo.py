"""``python -m hilore_actor.verl.main_ppo <verl hydra overrides> +actor_rollout_ref.actor.hilore.enable=true
[+actor_rollout_ref.actor.hilore.budget=1.10 ...]``: verl's own ``main_ppo`` with HiLoRe's engine.

The launcher takes HiLoRe's overrides out of the command line (verl's actor config refuses
unknown keys; ``settings.py``), checks them, composes verl's config once to read what the
engine cannot see (the planning microbatch's tokens, the group size, the clip and KL options),
and runs ``verl.trainer.main_ppo.main`` with:

- ``actor_rollout_ref.actor.strategy=hilore`` (the registry key of ``fsdp_engine.py``; the reference
  model inherits it and runs verl's forward unchanged);
- HiLoRe's settings and the job facts as one base64 JSON variable, in this process and, through
  ``+ray_kwargs.ray_init.runtime_env.env_vars``, in every Ray worker, beside
  ``VERL_USE_EXTERNAL_MODULES=hilore_actor.verl.register``.

A recipe's own ``actor_rollout_ref.actor.strategy=fsdp|fsdp2`` is kept as the FSDP version
HiLoRe's engine wraps with (``fsdp_version``). Without ``enable=true`` verl runs unchanged. The
actor's own memory savers that HiLoRe's plan replaces (``REPLACED``: verl's activation offload,
HF gradient checkpointing) are turned off, one line each. A bad override, a missing verl, or an
actor strategy other than FSDP (``strategy=megatron``, ``--config-name ppo_megatron_trainer``)
stops here with one line and exit code 2, as does a LoRA recipe that rolls out with vLLM where vLLM is
not installed (``stops.check_lora_rollout``); these checks compose verl's config from its YAML files
without importing verl, so none of verl's import-time warnings follows that line. Then verl's trainer
runs until the machine lacks what it needs: no GPU in the Ray cluster, no CUDA in a worker (verl's
NCCL process group, or HiLoRe's engine, ``fsdp_engine.py``), no rollout engine; the launcher ends
there with one line and exit code 2 too (``stops.guard``). ``--help`` lists HiLoRe's overrides (``usage``).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import textwrap
from typing import Dict, List, Optional, Tuple

from ..grpo.skip import skip_active
from .settings import CONFIG_ENV, NO_EFFECT, PREFIX, VERL_KEYS, parse, split_overrides, to_env
from .stops import Stopped, check_lora_rollout, guard

REGISTER = "hilore_actor.verl.register"
STRATEGY = "actor_rollout_ref.actor.strategy"
KL_ESTIMATORS = {"low_var_kl": "k3", "k3": "k3", "kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2"}


def hydra_options(argv: List[str]) -> Tuple[List[str], Dict[str, str]]:
    """(the overrides, Hydra's ``--config-name``/``--config-path`` values) of a command line."""
    overrides, options, i = [], {}, 0
    while i < len(argv):
        arg = argv[i]
        key = arg.split("=", 1)[0]
        if key in ("--config-name", "-cn", "--config-path", "-cp"):
            name = "config_name" if key in ("--config-name", "-cn") else "config_path"
            if "=" in arg:
                options[name] = arg.split("=", 1)[1]
            elif i + 1 < len(argv):
                options[name], i = argv[i + 1], i + 1
        else:
            overrides.append(arg)
        i += 1
    return overrides, options


def compose(argv: List[str]):
    """verl's trainer config (``ppo_trainer`` unless ``--config-name`` says otherwise) with the
    overrides of ``argv``, as its ``main`` would see it; ``ValueError`` (one line) where Hydra
    refuses them. verl's YAML files are read where its package lies, verl not imported: its
    import warns and logs on a machine without an accelerator, which would bury that error."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    overrides, options = hydra_options(argv)
    config_dir = os.path.abspath(options.get("config_path", verl_config_dir()))
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            return hydra_compose(config_name=options.get("config_name", "ppo_trainer"), overrides=overrides)
    except (HydraException, OmegaConfBaseException) as e:
        raise ValueError("verl's config: " + " ".join(str(e).split())) from None


def verl_config_dir() -> str:
    """``verl/trainer/config`` of the installed verl, found without importing verl."""
    spec = importlib.util.find_spec("verl")
    return os.path.join(list(spec.submodule_search_locations)[0], "trainer", "config")


def job_facts(cfg) -> Dict:
    """What the worker's engine cannot read from its own config."""
    actor, data = cfg.actor_rollout_ref.actor, cfg.data
    seq = int(data.max_prompt_length) + int(data.max_response_length)
    micro = actor.ppo_micro_batch_size_per_gpu or 1
    tokens = int(actor.ppo_max_token_len_per_gpu) if actor.use_dynamic_bsz else int(micro) * seq
    return {
        "plan_tokens": tokens,
        "seqs_per_microbatch": int(micro) if not actor.use_dynamic_bsz else max(1, tokens // seq),
        "group_size": int(cfg.actor_rollout_ref.rollout.n),
        "loss_options": {
            "clip_eps_low": float(actor.clip_ratio_low),
            "clip_eps_high": float(actor.clip_ratio_high),
            "kl_coef": float(actor.kl_loss_coef) if actor.use_kl_loss else 0.0,
            "kl_estimator": KL_ESTIMATORS.get(str(actor.kl_loss_type), "k3"),
        },
    }


def fsdp_version(rest: List[str], chosen: Optional[str]) -> Tuple[List[str], str]:
    """(``rest`` without its actor strategy, the FSDP version HiLoRe wraps with). A recipe's
    ``actor_rollout_ref.actor.strategy=fsdp|fsdp2`` names that version (the launcher itself sets
    the strategy to ``hilore``), as ``+...hilore.fsdp`` does; unset, fsdp2. ``ValueError`` when the
    two disagree or the strategy is not FSDP."""
    keep, strategy = [], None
    for arg in rest:
        key, _, value = arg.lstrip("+").partition("=")
        if key == STRATEGY:
            strategy = value
        else:
            keep.append(arg)
    if strategy is not None and strategy not in ("fsdp", "fsdp2"):
        raise ValueError(
            f"HiLoRe runs as verl's FSDP actor engine; {STRATEGY}={strategy} is not supported "
            f"(Megatron is not supported yet): set {STRATEGY}=fsdp2 or fsdp, or drop +{PREFIX}enable=true"
        )
    if strategy is not None and chosen is not None and strategy != chosen:
        raise ValueError(f"{STRATEGY}={strategy} and +{PREFIX}fsdp={chosen} disagree; give one FSDP version")
    return keep, strategy or chosen or "fsdp2"


# The actor's memory savers HiLoRe's plan replaces: (config key, why it goes). Left on, verl's
# activation offload would push its own saved-tensor hooks around every decoder layer
# (verl/utils/activation_offload.py), taking the saved tensors from HiLoRe's, and HF gradient
# checkpointing (on in verl's defaults) would recompute every layer whatever the plan keeps.
REPLACED = (
    (
        "actor_rollout_ref.model.enable_activation_offload",
        "HiLoRe's plan decides per unit what is kept, compressed or recomputed",
    ),
    ("actor_rollout_ref.model.enable_gradient_checkpointing", "HiLoRe's plan recomputes per unit instead"),
)


def replaced(cfg, rest: List[str]) -> Tuple[List[str], List[str]]:
    """(``rest`` with each ``REPLACED`` option the composed config turns on set to false, one
    line per such option saying so). The reference model shares the model options; it only runs
    forward, where neither saver does anything."""
    from omegaconf import OmegaConf

    notes = []
    for key, why in REPLACED:
        if bool(OmegaConf.select(cfg, key, default=False)):
            rest = [a for a in rest if a.lstrip("+").partition("=")[0] != key] + [f"{key}=false"]
            notes.append(f"[hilore] {key}=true is turned off: {why}")
    return rest, notes


def skip_setting(cfg, setting: str) -> bool:
    """The zero-advantage skip under the composed ``cfg`` (``skip.py``): whether ``auto`` or
    ``on`` is exact there; ``ValueError`` with one line for ``on`` where it is not."""
    from omegaconf import OmegaConf

    from .skip import blockers

    distillation = bool(OmegaConf.select(cfg, "distillation.enabled", default=False))
    try:
        return skip_active(setting, blockers(cfg.actor_rollout_ref.actor, distillation))
    except ValueError as e:
        raise ValueError(
            str(e).replace("--hilore.skip_zero_advantage on", f"+{PREFIX}skip_zero_advantage=on")
        ) from None


def launch_args(argv: List[str]) -> Tuple[List[str], Dict[str, str]]:
    """(verl's overrides, environment to set) for ``argv``; ``ValueError`` on a bad override."""
    rest, ours = split_overrides(argv)
    enabled, settings, verl_only = parse(ours)
    if not enabled:
        given = sorted(k for k in ours if k != "enable")
        if given:  # verl would run unchanged: the overrides would do nothing
            them = "them" if len(given) > 1 else "it"
            raise ValueError(
                f"{', '.join('+' + PREFIX + k for k in given)} given without +{PREFIX}enable=true (verl runs "
                f"unchanged without it): add it, or drop {them}"
            )
        return rest, {}
    rest, verl_only["fsdp"] = fsdp_version(rest, verl_only["fsdp"])
    cfg = compose(rest)
    strategy = str(cfg.actor_rollout_ref.actor.strategy)
    if strategy not in ("fsdp", "fsdp2"):
        raise ValueError(
            f"HiLoRe runs as verl's FSDP actor engine; this config's actor strategy is {strategy} "
            f"(Megatron is not supported yet): use an FSDP config (ppo_trainer) or drop +{PREFIX}enable=true"
        )
    skip_setting(cfg, settings.get("skip_zero_advantage", "auto"))
    facts = job_facts(cfg)
    rest, notes = replaced(cfg, rest)
    for note in notes:
        print(note, flush=True)
    value = to_env(settings, {**facts, **verl_only})
    env = {CONFIG_ENV: value, "VERL_USE_EXTERNAL_MODULES": REGISTER}
    extra = [f"{STRATEGY}=hilore"] + [f"+ray_kwargs.ray_init.runtime_env.env_vars.{k}={v}" for k, v in env.items()]
    return rest + extra, env


def shown(value) -> str:
    """A default as an override writes it."""
    if value is None or value == "":
        return "unset"
    return str(value).lower() if isinstance(value, bool) else str(value)


def usage() -> str:
    """The launcher's ``--help``: HiLoRe's overrides with their defaults, from the one flag table
    (``learner/settings.py``) and ``settings.VERL_KEYS``, so the help cannot drift from the checks.
    verl's own help is its whole config, printed by verl's ``main_ppo --help``."""
    from ..learner.settings import HILORE_FLAGS

    rows = [(k, d, h) for k, (d, h) in VERL_KEYS.items()]
    for name, _, default, help_ in HILORE_FLAGS:
        key = name[len("hilore.") :]
        if key not in NO_EFFECT:  # refused under verl (settings.NO_EFFECT)
            rows.append((key, shown(default), help_.replace("--hilore.", "+" + PREFIX)))
    lines = [
        f"usage: python -m hilore_actor.verl.main_ppo [--config-name NAME] [--config-path DIR] <verl overrides> "
        f"+{PREFIX}enable=true [+{PREFIX}KEY=VALUE ...]",
        "",
        "verl's own main_ppo with HiLoRe's actor engine (actor_rollout_ref.actor.strategy=hilore). verl's",
        "overrides and config: python -m verl.trainer.main_ppo --help.",
        "",
        f"HiLoRe's overrides (+{PREFIX}KEY=VALUE):",
    ]
    for key, default, help_ in rows:
        lines.append(f"  +{PREFIX}{key}=VALUE")
        lines += textwrap.wrap(
            f"{help_} (default: {default})", width=100, initial_indent=" " * 6, subsequent_indent=" " * 6
        )
    refused = "; ".join(f"+{PREFIX}{key} ({why})" for key, why in NO_EFFECT.items())
    lines += ["", *textwrap.wrap(f"Not taken under verl (refused): {refused}.", width=100)]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        print(usage())
        return 0
    missing = [m for m in ("hydra", "verl") if importlib.util.find_spec(m) is None]
    if missing:
        print(
            f"error: verl is not installed (no module named {missing[0]!r}); install it as the README's install "
            'table says (pip install -e ".[verl]" && pip install --no-deps verl==0.9.1)',
            file=sys.stderr,
        )
        return 2
    try:
        overrides, env = launch_args(argv)
        if env:  # what this machine lacks for the launch itself, not for the config
            check_lora_rollout(compose(overrides))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    os.environ.update(env)
    if env:
        importlib.import_module(REGISTER)  # this process; the workers import it from env
    import verl.trainer.main_ppo as verl_ppo

    if env:
        guard(verl_ppo)
    sys.argv = [sys.argv[0]] + overrides
    try:
        verl_ppo.main()
    except Stopped as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
