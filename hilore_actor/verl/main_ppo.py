"""``python -m hilore_actor.verl.main_ppo <verl hydra overrides> +actor_rollout_ref.actor.hilore.enable=true
[+actor_rollout_ref.actor.hilore.budget=1.10 ...]``: verl's own ``main_ppo`` with HiLoRe's engine.

The launcher takes HiLoRe's overrides out of the command line (verl's actor config refuses
unknown keys; ``settings.py``), checks them, composes verl's config once to read what the
engine cannot see (the planning microbatch's tokens, the group size, the clip and KL options),
and runs ``verl.trainer.main_ppo.main`` with:

- ``actor_rollout_ref.actor.strategy=hilore`` (the registry key of ``engine.py``; the reference
  model inherits it and runs verl's forward unchanged);
- HiLoRe's settings and the job facts as one base64 JSON variable, in this process and, through
  ``+ray_kwargs.ray_init.runtime_env.env_vars``, in every Ray worker, beside
  ``VERL_USE_EXTERNAL_MODULES=hilore_actor.verl.register``.

A recipe's own ``actor_rollout_ref.actor.strategy=fsdp|fsdp2`` is kept as the FSDP version
HiLoRe's engine wraps with (``fsdp_version``). Without ``enable=true`` verl runs unchanged. A
bad override, a missing verl, an actor strategy other than FSDP (``strategy=megatron``,
``--config-name ppo_megatron_trainer``), or an actor option the engine cannot run with
(``UNSUPPORTED``: activation offload) stops here with one message; a worker
without CUDA stops in the worker (``engine.py``).
"""
from __future__ import annotations

import importlib
import os
import sys
from typing import Dict, List, Optional, Tuple

from .settings import CONFIG_ENV, PREFIX, parse, split_overrides, to_env

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
    overrides of ``argv``, as its ``main`` would see it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import verl.trainer.main_ppo as main_ppo

    overrides, options = hydra_options(argv)
    config_dir = os.path.abspath(options.get("config_path", os.path.join(os.path.dirname(main_ppo.__file__), "config")))
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return hydra_compose(config_name=options.get("config_name", "ppo_trainer"), overrides=overrides)


def job_facts(cfg) -> Dict:
    """What the worker's engine cannot read from its own config."""
    actor, data = cfg.actor_rollout_ref.actor, cfg.data
    seq = int(data.max_prompt_length) + int(data.max_response_length)
    micro = actor.ppo_micro_batch_size_per_gpu or 1
    tokens = int(actor.ppo_max_token_len_per_gpu) if actor.use_dynamic_bsz else int(micro) * seq
    return {"plan_tokens": tokens, "seqs_per_microbatch": int(micro) if not actor.use_dynamic_bsz else max(1, tokens // seq),
            "group_size": int(cfg.actor_rollout_ref.rollout.n),
            "loss_options": {"clip_eps_low": float(actor.clip_ratio_low), "clip_eps_high": float(actor.clip_ratio_high),
                             "kl_coef": float(actor.kl_loss_coef) if actor.use_kl_loss else 0.0,
                             "kl_estimator": KL_ESTIMATORS.get(str(actor.kl_loss_type), "k3")}}


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
        raise ValueError(f"HiLoRe runs as verl's FSDP actor engine; {STRATEGY}={strategy} is not supported "
                         f"(Megatron is not supported yet): set {STRATEGY}=fsdp2 or fsdp, or drop +{PREFIX}enable=true")
    if strategy is not None and chosen is not None and strategy != chosen:
        raise ValueError(f"{STRATEGY}={strategy} and +{PREFIX}fsdp={chosen} disagree; give one FSDP version")
    return keep, strategy or chosen or "fsdp2"


# Actor options HiLoRe's engine cannot run with: (config keys, why), checked on the composed config.
UNSUPPORTED = (
    (("actor_rollout_ref.model.enable_activation_offload",),
     "verl's activation offload pushes its own saved-tensor hooks around every decoder layer "
     "(verl/utils/activation_offload.py), which take the saved tensors from HiLoRe's, and under gradient "
     "checkpointing wraps each layer in torch's reentrant checkpoint; HiLoRe's plan decides what each unit keeps"),
)


def unsupported(cfg) -> List[str]:
    """``KEY=true (why)`` for each ``UNSUPPORTED`` option the composed config turns on."""
    from omegaconf import OmegaConf

    out = []
    for keys, why in UNSUPPORTED:
        on = [k for k in keys if bool(OmegaConf.select(cfg, k, default=False))]
        if on:
            out.append(f"{on[0]}=true ({why})")
    return out


def launch_args(argv: List[str]) -> Tuple[List[str], Dict[str, str]]:
    """(verl's overrides, environment to set) for ``argv``; ``ValueError`` on a bad override."""
    rest, ours = split_overrides(argv)
    enabled, settings, verl_only = parse(ours)
    if not enabled:
        return rest, {}
    rest, verl_only["fsdp"] = fsdp_version(rest, verl_only["fsdp"])
    cfg = compose(rest)
    strategy = str(cfg.actor_rollout_ref.actor.strategy)
    if strategy not in ("fsdp", "fsdp2"):
        raise ValueError(f"HiLoRe runs as verl's FSDP actor engine; this config's actor strategy is {strategy} "
                         f"(Megatron is not supported yet): use an FSDP config (ppo_trainer) or drop +{PREFIX}enable=true")
    problems = unsupported(cfg)
    if problems:
        raise ValueError("HiLoRe's verl engine does not support " + "; ".join(problems)
                         + f" yet: turn them off or drop +{PREFIX}enable=true")
    facts = job_facts(cfg)
    value = to_env(settings, {**facts, **verl_only})
    env = {CONFIG_ENV: value, "VERL_USE_EXTERNAL_MODULES": REGISTER}
    extra = [f"{STRATEGY}=hilore"] + [
        f"+ray_kwargs.ray_init.runtime_env.env_vars.{k}={v}" for k, v in env.items()]
    return rest + extra, env


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        import hydra  # noqa: F401
        import verl  # noqa: F401
    except ImportError as e:
        print(f"error: verl is not installed ({e}); install it as the README's install table says "
              "(pip install -e \".[verl]\" && pip install --no-deps verl==0.9.1)", file=sys.stderr)
        return 2
    try:
        overrides, env = launch_args(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    os.environ.update(env)
    if env:
        importlib.import_module(REGISTER)  # this process; the workers import it from env
    from verl.trainer.main_ppo import main as verl_main

    sys.argv = [sys.argv[0]] + overrides
    verl_main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
