"""Flags, YAML config and presets of the GRPO training job (``python -m hilore_actor.train_grpo``).

Flag names follow OpenRLHF 0.11's dotted style where the concept exists there, so recipes port
(``--actor.model_name_or_path`` or ``--pretrain``, ``--rollout.n_samples_per_prompt``,
``--algo.advantage.estimator``, ``--ds.zero_stage`` ...). The learner backend is
``--actor_backend hilore|gc|none`` (also ``--actor.backend``); HiLoRe's own knobs live under
``--hilore.*``. Precedence: defaults < ``--preset`` < ``--config`` YAML < command line.
The parsed config is a nested namespace (``cfg.rollout.n_samples_per_prompt``), as OpenRLHF's
``hierarchize`` builds.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Sequence

from ..grpo.skip import SETTINGS as SKIP_SETTINGS
from ..grpo.skip import skip_active
from ..learner.settings import HILORE_FLAGS, boolean, hilore_errors
from .errors import ConfigError

BACKENDS = ("hilore", "gc", "none")


# (flag, type, default, help); type "flag" is a store_true switch.
FLAGS = [
    # model and data
    (
        "actor.model_name_or_path",
        str,
        None,
        "policy model: a local HF directory, a config.json, a .gguf file, "
        "'smollm2' (the bundled SmolLM2-135M-Instruct) or 'tiny:<qwen2|llama|phi3>' (a tiny random model)",
    ),
    (
        "data.prompt_dataset",
        str,
        "rg:basic_arithmetic",
        "task: rg:<reasoning-gym name>, toy:vowels, or a dataset file: .jsonl or .json (OpenRLHF's), .parquet "
        "(verl's: chat-list prompt, reward_model.ground_truth, data_source, extra_info)",
    ),
    ("data.input_key", str, "prompt", "dataset field holding the prompt (a dotted path reads a nested field)"),
    (
        "data.label_key",
        str,
        "answer",
        "dataset field holding the reference answer (a dotted path reads a nested field: verl's "
        "reward_model.ground_truth)",
    ),
    ("data.max_samples", int, 1024, "prompts drawn from the task (procedural tasks generate this many)"),
    ("data.prompt_max_len", int, 256, "prompts longer than this (in tokens) are an error"),
    (
        "data.instruction",
        str,
        None,
        "text appended to every prompt (default: a reasoning-gym task's answer-format line; nothing on a "
        "dataset file, whose prompts stay as written)",
    ),
    ("data.task_options", str, None, "reasoning-gym dataset options as JSON, e.g. '{\"max_digits\": 1}'"),
    (
        "data.apply_chat_template",
        boolean,
        True,
        "render prompts with the tokenizer's chat template (a JSONL prompt "
        "field holding chat messages needs it); false: the prompt text as it is",
    ),
    (
        "reward.path",
        str,
        None,
        "your reward function: a .py file or an importable module, with verl's "
        "compute_score(data_source, solution_str, ground_truth, extra_info) per response or OpenRLHF's "
        "reward_func(queries, prompts, labels) batched (default: the task's own verifier)",
    ),
    ("reward.name", str, None, "the function's name in --reward.path (default: compute_score, else reward_func)"),
    (
        "reward.remote_url",
        str,
        None,
        "a reward server, as OpenRLHF's: each batch of responses is POSTed as JSON {query, prompts, labels} "
        "and the reply's 'rewards' (else 'scores') are the rewards; several URLs, comma-separated, share the batch",
    ),
    # rollout
    ("rollout.batch_size", int, 4, "prompts per training step"),
    ("rollout.n_samples_per_prompt", int, 4, "responses sampled per prompt (the GRPO group size G)"),
    ("rollout.max_new_tokens", int, 64, "response length limit"),
    ("rollout.temperature", float, 1.0, "sampling temperature"),
    ("rollout.top_p", float, 1.0, "nucleus sampling"),
    ("rollout.num_workers", int, 1, "HF generate rollout workers (CPU, or GPU without vLLM)"),
    ("rollout.num_gpus", float, 1.0, "GPUs per HF rollout worker on CUDA (a fraction shares a GPU)"),
    ("rollout.max_restarts", int, 2, "times Ray restarts a dead rollout worker (the step's rollouts are then redone)"),
    ("ref.num_gpus", float, 1.0, "GPUs of the reference worker on CUDA (a fraction shares a GPU)"),
    ("vllm.num_engines", int, 0, "vLLM engines (GPU; 0 = HF generate workers)"),
    ("vllm.tensor_parallel_size", int, 1, "GPUs per vLLM engine"),
    ("vllm.gpu_memory_utilization", float, 0.5, "vLLM's share of its GPU"),
    # algorithm
    ("algo.advantage.estimator", str, "group_norm", "group_norm (GRPO), dr_grpo or rloo"),
    ("algo.kl.estimator", str, "k3", "KL estimator: k1, k2 or k3"),
    ("algo.kl.use_loss", boolean, False, "add the KL to the reference model as a loss term (GRPO)"),
    ("algo.kl.init_coef", float, 0.001, "KL loss coefficient"),
    ("actor.eps_clip", float, 0.2, "PPO clip range"),
    ("actor.eps_clip_low_high", float, None, "asymmetric clip: LOW HIGH", 2),
    ("actor.dual_clip", float, None, "dual-clip constant c > 1 (off by default)"),
    ("actor.loss_agg_mode", str, "token-mean", "token-mean, seq-mean-token-sum or seq-mean-token-mean"),
    ("actor.adam.lr", float, 1e-6, "learning rate"),
    ("actor.adam.betas", float, (0.9, 0.95), "AdamW betas", 2),
    ("actor.adam.weight_decay", float, 0.0, "AdamW weight decay"),
    (
        "actor.lr_scheduler",
        str,
        "constant_with_warmup",
        "transformers scheduler name (constant_with_warmup, cosine, ...)",
    ),
    ("actor.lr_warmup_ratio", float, 0.0, "warmup share of the steps"),
    ("actor.max_norm", float, 1.0, "gradient clipping norm"),
    (
        "actor.gradient_checkpointing_enable",
        "flag",
        False,
        "OpenRLHF's gradient checkpointing switch, accepted so recipes port: --actor_backend gc is that; under "
        "hilore the plan's per-unit recompute replaces it (one line says so)",
    ),
    ("actor.num_nodes", int, 1, "learner nodes"),
    ("actor.num_gpus_per_node", int, 1, "learner ranks per node (processes on CPU, GPUs on CUDA)"),
    (
        "actor.backend",
        str,
        "hilore",
        "learner backend: hilore (store/compress/recompute per unit under --hilore.budget), "
        "gc (gradient checkpointing on every layer) or none (store everything); also --actor_backend",
    ),
    # training
    ("train.batch_size", int, 16, "sequences per optimizer update, over all ranks"),
    ("train.micro_batch_size", int, 4, "sequences per packed learner microbatch, per rank"),
    ("train.seed", int, 42, "seed of prompt order, sampling, LoRA dropout and initialisation"),
    (
        "train.max_skipped_updates",
        int,
        3,
        "stop after this many updates in a row skipped for a non-finite gradient (0: never)",
    ),
    ("max_steps", int, 1, "training steps (one rollout batch each, then its updates)"),
    ("ds.zero_stage", int, 2, "DeepSpeed ZeRO stage (2 or 3; 0 = plain data parallel)"),
    ("ds.param_dtype", str, "fp32", "fp32 or bf16"),
    ("ds.lora.rank", int, 16, "LoRA rank (0 = train all weights)"),
    ("ds.lora.alpha", float, 32.0, "LoRA alpha"),
    ("ds.lora.dropout", float, 0.0, "LoRA dropout"),
    ("ds.lora.target_modules", str, "all-linear", "LoRA targets: all-linear or comma-separated module names"),
    ("threads", int, None, "torch threads per worker on CPU (default: the cores divided among learner ranks)"),
    # replay (rollout/replay.py)
    (
        "replay.enable",
        "flag",
        False,
        "rollout-level replay: store single rollouts (advantage != 0) and append replayed "
        "ones to every step's fresh rollouts, each with the old and reference log-probs it had when fresh",
    ),
    ("replay.max_age", int, 4, "replayed rollouts are at most this many training steps old (older ones are evicted)"),
    (
        "replay.ratio",
        float,
        1.0,
        "replayed rollouts per fresh rollout, rounded down to whole --train.batch_size updates",
    ),
    ("replay.capacity", int, 4096, "rollouts the buffer holds (the oldest go first)"),
    (
        "replay.priority",
        str,
        "abs_advantage",
        "draw rollouts with probability ~ |advantage|^alpha (abs_advantage) or uniform",
    ),
    ("replay.alpha", float, 1.0, "priority exponent of abs_advantage"),
    # output
    (
        "save_path",
        str,
        "runs/grpo",
        "output folder: metrics.jsonl, TensorBoard events, checkpoints, final weights "
        "(alias --ckpt.output_dir); a folder you name must not hold a run (use --resume or --overwrite_output_dir); "
        "left unnamed, each run gets a new folder under it",
    ),
    (
        "overwrite_output_dir",
        "flag",
        False,
        "start a fresh run in a --save_path that holds one: its metrics, "
        "TensorBoard events, samples, checkpoints and final weights are deleted first",
    ),
    ("ckpt.path", str, None, "checkpoint folder (default <save_path>/checkpoints)"),
    ("ckpt.save_steps", int, 1, "checkpoint every N steps (-1: only at the end)"),
    ("ckpt.max_num", int, 2, "complete checkpoints kept"),
    ("ckpt.load_enable", "flag", False, "resume from the last checkpoint (alias --resume)"),
    ("logger.tensorboard_dir", str, None, "TensorBoard folder (default <save_path>/tensorboard)"),
    (
        "compare_gc",
        boolean,
        False,
        "after every update, time gc and the backend on the same microbatches, "
        "interleaved (no optimizer step), and report the ratio",
    ),
    (
        "compare_skip",
        int,
        0,
        "with the zero-advantage skip: after every step, time its first update's forward and backward with every "
        "response, with the skip's rows, and with every response again (the A/A floor), N times interleaved (no "
        "optimizer step), and log the paired times (compare_skip_times)",
    ),
    (
        "measure_grad_error",
        "flag",
        False,
        "before every update, compute its gradient under HiLoRe's plan and the exact "
        "one (every layer recomputed) on the same microbatches, outside the optimizer's path, and log their relative "
        "error and cosine (grad_rel_error, grad_cosine_min; extra passes each step, not in update_seconds)",
    ),
    ("log_workers", "flag", False, "show the workers' own output (planning messages, warnings) on the driver"),
    # logging (train/metrics.py) and held-out evaluation (train/evaluation.py)
    (
        "logger.wandb.enable",
        "flag",
        False,
        "also log to Weights & Biases: the TensorBoard scalars under the same "
        "names, sample generations, the flags (pip install 'hilore-actor[wandb]'; WANDB_MODE=offline writes the run "
        "under <save_path>/wandb without network; alias --use_wandb)",
    ),
    ("logger.wandb.key", str, None, "W&B API key; turns W&B on, as OpenRLHF's (default: WANDB_API_KEY or wandb login)"),
    ("logger.wandb.org", str, None, "W&B entity (alias --wandb_org)"),
    ("logger.wandb.group", str, None, "W&B run group (alias --wandb_group)"),
    ("logger.wandb.project", str, "hilore_train_grpo", "W&B project (alias --wandb_project)"),
    (
        "logger.wandb.run_name",
        str,
        None,
        "W&B run name (default: the --save_path folder's name; alias --wandb_run_name)",
    ),
    (
        "logger.samples_per_step",
        int,
        2,
        "sample generations (prompt, response, reward) per step, each of another "
        "prompt, into <save_path>/samples.jsonl, TensorBoard text and a W&B table (0: none)",
    ),
    (
        "eval.dataset",
        str,
        None,
        "held-out prompts: a dataset file read as --data.prompt_dataset is (same instruction, chat template "
        "and reward; its fields --eval.input_key and --eval.label_key); greedy responses through the rollout "
        "workers, scored every --eval.steps steps and after the last (eval/accuracy: share of reward 1, "
        "eval/reward_mean)",
    ),
    ("eval.steps", int, 0, "evaluate every N steps (0 or -1: only after the last step)"),
    ("eval.max_samples", int, 256, "held-out prompts evaluated: the first N of --eval.dataset"),
    ("eval.input_key", str, None, "--eval.dataset's prompt field (default: --data.input_key)"),
    ("eval.label_key", str, None, "--eval.dataset's answer field (default: --data.label_key)"),
]
FLAGS += HILORE_FLAGS  # the --hilore.* flags, shared with the OpenRLHF drop-in (learner/settings.py)
ALIASES = {
    "pretrain": "actor.model_name_or_path",
    "actor_backend": "actor.backend",
    "resume": "ckpt.load_enable",
    "ckpt.output_dir": "save_path",
    "prompt_data": "data.prompt_dataset",
}
ALIASES.update(
    {
        "use_wandb": "logger.wandb.enable",
        "wandb_org": "logger.wandb.org",  # older OpenRLHF's names
        "wandb_group": "logger.wandb.group",
        "wandb_project": "logger.wandb.project",
        "wandb_run_name": "logger.wandb.run_name",
    }
)

PRESETS: Dict[str, Dict[str, Any]] = {
    # The README's main command: a real model on a small arithmetic task, in minutes on 2 cores.
    "cpu-demo": {
        "actor.model_name_or_path": "smollm2",
        "data.prompt_dataset": "rg:basic_arithmetic",
        "data.task_options": (
            '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+", "-"]}'
        ),
        "data.instruction": " Answer with the number only.",
        "rollout.batch_size": 4,
        "rollout.n_samples_per_prompt": 4,
        "rollout.max_new_tokens": 32,
        "train.batch_size": 16,
        "train.micro_batch_size": 8,
        "actor.adam.lr": 2e-4,
        "algo.kl.use_loss": True,
        "max_steps": 5,
        "hilore.mode": "hilore-hr",
        "hilore.profile_repeats": 1,
        "compare_gc": True,
        "save_path": "runs/cpu-demo",
        "ckpt.save_steps": -1,
    },
    # Tests: a tiny random model, a reward a random model already varies on, seconds per step.
    "tiny": {
        "actor.model_name_or_path": "tiny:qwen2",
        "data.prompt_dataset": "toy:vowels",
        "rollout.batch_size": 2,
        "rollout.n_samples_per_prompt": 4,
        "rollout.max_new_tokens": 16,
        "train.batch_size": 8,
        "train.micro_batch_size": 2,
        "actor.adam.lr": 1e-3,
        "data.prompt_max_len": 48,
        "ds.lora.rank": 8,
        "algo.kl.use_loss": True,
        "actor.num_gpus_per_node": 2,
        "max_steps": 2,
        "hilore.calibration_batches": 2,
        "hilore.profile_repeats": 1,
        "hilore.loo": False,  # a tiny unit's saving is milliseconds: leave-one-out would time noise
        # gc's peak is its full float32 logits (49,152 words), which the chunked head does not make: B at 1.10 x
        # gc would hold every unit. 0.58 x gc is just above HiLoRe's own all-R peak (0.56 x here), so the plan
        # stores some units and recomputes the rest, as a real model's does at 1.10
        "hilore.budget": "0.58",
        "save_path": "runs/tiny",
    },
}


# A preset's settings of its own task: they follow the preset's task and never reach a user's
# --data.prompt_dataset, whose prompts stay as written.
PRESET_TASK_KEYS = ("data.instruction", "data.task_options")
# A preset's B sized for HiLoRe's plan (below gc's own peak, where gc cannot run): under --actor_backend gc or
# none, B is the default ratio of gc's peak.
PRESET_PLAN_KEYS = ("hilore.budget",)

ZERO3_COMPILE = (
    "--hilore.compile does not run under --ds.zero_stage 3: ZeRO-3 gathers each submodule's weights in "
    "hooks that torch.compile would trace into the compiled units; use ZeRO-2 or leave --hilore.compile off"
)


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (a close flag name suggested) instead of the usage block."""

    def error(self, message):
        import difflib

        words = [w for w in message.replace(",", " ").split() if w.startswith("--")]
        known = [o for a in self._actions for o in a.option_strings]
        close = [m for w in words for m in difflib.get_close_matches(w.split("=")[0], known, n=1)]
        hint = f"; did you mean {', '.join(close)}?" if close else "; --help lists the flags"
        self.exit(2, f"error: {message}{hint}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m hilore_actor.train_grpo",
        description="GRPO training on Ray with a HiLoRe learner: rollout workers -> rewards and group advantages -> "
        "reference log-probs -> N DeepSpeed learner ranks whose activations are stored, compressed or recomputed "
        "per unit under a memory budget that a coordinator enforces.",
        epilog="Flags follow OpenRLHF 0.11's dotted names. Aliases: "
        + ", ".join(f"--{a} = --{t}" for a, t in ALIASES.items()),
        argument_default=argparse.SUPPRESS,  # unset flags stay absent, so presets and YAML can fill them
    )
    p.add_argument(
        "--config", help="YAML file of flags (dotted keys or nested mappings); the command line overrides it"
    )
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="a named set of defaults: "
        + "; ".join(f"{k}: {', '.join(f'{a}={b}' for a, b in list(v.items())[:3])}, ..." for k, v in PRESETS.items()),
    )
    rev = {}
    for a, t in ALIASES.items():
        rev.setdefault(t, []).append(a)
    for spec in FLAGS:
        name, typ, default, help_ = spec[:4]
        names = ["--" + name] + ["--" + a for a in rev.get(name, [])]
        shown = f"{help_} (default: {default})"
        if typ == "flag":
            p.add_argument(*names, dest=name, action="store_true", help=help_)
        elif typ is boolean:  # `--flag` alone is true, as OpenRLHF's store_true switches; `--flag false` turns it off
            p.add_argument(*names, dest=name, type=typ, nargs="?", const=True, metavar="true|false", help=shown)
        else:
            nargs = spec[4] if len(spec) > 4 else None
            p.add_argument(*names, dest=name, type=typ, nargs=nargs, metavar=name.split(".")[-1].upper(), help=shown)
    return p


DEFAULTS = {spec[0]: spec[2] for spec in FLAGS}


def _flatten(d: Dict, prefix: str = "") -> Dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def load_yaml(path: str) -> Dict[str, Any]:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config {path}: file not found")
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not valid YAML ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flags, got {type(raw).__name__}")
    flat = _flatten(raw)
    out = {}
    for k, v in flat.items():
        k = ALIASES.get(k, k)
        if k not in DEFAULTS:
            raise ConfigError(f"--config {path}: unknown key {k!r} (see --help for the flags)")
        out[k] = _typed(k, v, path)
    return out


TYPES = {spec[0]: spec[1] for spec in FLAGS}


def _typed(key: str, value, path: str):
    """A YAML value as its flag's type (what argparse does for the command line)."""
    typ = TYPES[key]
    if value is None:
        return None
    if typ is str and not isinstance(value, (list, dict)):
        return str(value)
    try:
        if typ == "flag":
            return boolean(value)
        if isinstance(value, (list, tuple)):
            return [typ(x) for x in value]
        if typ is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
        return typ(value)
    except (TypeError, ValueError):
        name = "true|false" if typ == "flag" else getattr(typ, "__name__", str(typ))
        raise ConfigError(f"--config {path}: {key}: {value!r} is not a {name}") from None


def hierarchize(flat: Dict[str, Any]) -> SimpleNamespace:
    """``{"a.b": 1}`` -> ``ns.a.b == 1`` (what OpenRLHF's ``hierarchize`` does)."""
    root: Dict[str, Any] = {}
    for k, v in flat.items():
        node = root
        *parents, leaf = k.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = v

    def build(x):
        return SimpleNamespace(**{k: build(v) for k, v in x.items()}) if isinstance(x, dict) else x

    return build(root)


def flatten_ns(ns: SimpleNamespace, prefix: str = "") -> Dict[str, Any]:
    """The namespace back to dotted flags (``user_set``, which flags the user gave, is left out)."""
    out = {}
    for k, v in vars(ns).items():
        if not prefix and k == "user_set":
            continue
        if isinstance(v, SimpleNamespace):
            out.update(flatten_ns(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def parse_config(argv: Optional[Sequence[str]] = None) -> SimpleNamespace:
    """Parse flags (defaults < preset < YAML < command line), validate, return a namespace."""
    args = vars(build_parser().parse_args(list(sys.argv[1:] if argv is None else argv)))
    flat = dict(DEFAULTS)
    preset = PRESETS.get(args.get("preset"), {})
    flat.update(preset)
    given = {k: v for k, v in args.items() if k not in ("config", "preset")}
    yaml_flags = load_yaml(args["config"]) if "config" in args else {}
    flat.update(yaml_flags)
    flat.update(given)
    if flat["data.prompt_dataset"] != preset.get("data.prompt_dataset", flat["data.prompt_dataset"]):
        for k in PRESET_TASK_KEYS:  # the user's own data: none of the preset's task settings
            if k in preset and k not in yaml_flags and k not in given:
                flat[k] = DEFAULTS[k]
    if flat["actor.backend"] != "hilore":
        for k in PRESET_PLAN_KEYS:  # gc or none: the preset's B was sized for HiLoRe's plan
            if k in preset and k not in yaml_flags and k not in given:
                flat[k] = DEFAULTS[k]
    flat["preset"] = args.get("preset")
    for k in ("actor.adam.betas", "actor.eps_clip_low_high"):
        if flat[k] is not None:
            try:
                flat[k] = tuple(float(x) for x in flat[k])
            except (TypeError, ValueError):
                raise ConfigError(f"--{k} {flat[k]!r}: expected two numbers") from None
    cfg = hierarchize(flat)
    cfg.user_set = sorted(set(yaml_flags) | set(given))  # the flags the user gave (YAML or command line)
    validate(cfg)
    return cfg


def world_size(cfg) -> int:
    return cfg.actor.num_nodes * cfg.actor.num_gpus_per_node


# ---- settings derived from the flags, shared by the learner and the workers ----
def plan_tokens(cfg, longest_prompt: int) -> int:
    """``--hilore.plan_tokens``, or the largest microbatch the job can make: micro batch x
    (longest prompt + max new tokens), rounded up to 64."""
    if cfg.hilore.plan_tokens:
        return cfg.hilore.plan_tokens
    return -(-cfg.train.micro_batch_size * (longest_prompt + cfg.rollout.max_new_tokens) // 64) * 64


def replay_sequences(cfg) -> int:
    """Replayed rollouts a step appends at most: ``--replay.ratio`` x the fresh ones, rounded
    down to whole updates (an update holds ``--train.batch_size`` sequences); 0 without replay."""
    if not cfg.replay.enable:
        return 0
    fresh = cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt
    return int(cfg.replay.ratio * fresh) // cfg.train.batch_size * cfg.train.batch_size


def param_dtype(cfg):
    import torch

    return torch.bfloat16 if cfg.ds.param_dtype == "bf16" else torch.float32


def lora_spec(cfg, dropout: bool = True):
    """``--ds.lora.*`` as a ``LoraSpec`` (None for full fine-tuning); rollout copies take no dropout."""
    from ..models.factory import LoraSpec

    if cfg.ds.lora.rank <= 0:
        return None
    t = cfg.ds.lora.target_modules
    return LoraSpec(
        cfg.ds.lora.rank,
        cfg.ds.lora.alpha,
        cfg.ds.lora.dropout if dropout else 0.0,
        t if t == "all-linear" else [x.strip() for x in t.split(",")],
    )


def worker_device():
    """Where a Ray worker computes: its GPU (Ray sets CUDA_VISIBLE_DEVICES), else the CPU."""
    import torch

    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def validate(cfg) -> None:
    """Inconsistent flags fail here, before Ray starts, with the numbers that disagree."""
    errors: List[str] = []
    if cfg.actor.model_name_or_path is None:
        errors.append("no model: pass --pretrain PATH (or --actor.model_name_or_path), or --preset cpu-demo|tiny")
    if cfg.actor.backend not in BACKENDS:
        errors.append(f"--actor_backend {cfg.actor.backend!r}: choose one of {', '.join(BACKENDS)}")
    G, world = cfg.rollout.n_samples_per_prompt, world_size(cfg)
    seqs = cfg.rollout.batch_size * G
    for name, v in (
        ("rollout.batch_size", cfg.rollout.batch_size),
        ("rollout.n_samples_per_prompt", G),
        ("train.batch_size", cfg.train.batch_size),
        ("train.micro_batch_size", cfg.train.micro_batch_size),
        ("rollout.max_new_tokens", cfg.rollout.max_new_tokens),
        ("rollout.num_workers", cfg.rollout.num_workers),
        ("actor.num_gpus_per_node", cfg.actor.num_gpus_per_node),
        ("max_steps", cfg.max_steps),
    ):
        if v is None or v < 1:
            errors.append(f"--{name} must be >= 1, got {v}")
    if not errors:
        if cfg.train.batch_size % G:
            errors.append(
                f"the group size --rollout.n_samples_per_prompt {G} does not divide --train.batch_size "
                f"{cfg.train.batch_size}: an update must hold whole groups"
            )
        elif seqs % cfg.train.batch_size:  # one mistake, one line: the first of these that fails
            errors.append(
                f"--train.batch_size {cfg.train.batch_size} does not divide the {seqs} sequences of a rollout "
                f"batch (--rollout.batch_size {cfg.rollout.batch_size} x --rollout.n_samples_per_prompt {G})"
            )
        elif cfg.train.batch_size % (world * cfg.train.micro_batch_size):
            errors.append(
                f"--train.batch_size {cfg.train.batch_size} is not a multiple of ranks x micro batch = "
                f"{world} x {cfg.train.micro_batch_size}"
            )
    if cfg.algo.advantage.estimator in ("group_norm", "rloo") and G < 2:
        errors.append(
            f"--algo.advantage.estimator {cfg.algo.advantage.estimator} needs --rollout.n_samples_per_prompt > 1"
        )
    if cfg.vllm.tensor_parallel_size != 1:
        errors.append("--vllm.tensor_parallel_size > 1 is not supported yet")
    if cfg.ds.zero_stage not in (0, 1, 2, 3):
        errors.append(f"--ds.zero_stage must be 0, 1, 2 or 3, got {cfg.ds.zero_stage}")
    if cfg.ds.param_dtype not in ("fp32", "bf16"):
        errors.append(f"--ds.param_dtype must be fp32 or bf16, got {cfg.ds.param_dtype!r}")
    if getattr(cfg.hilore, "compile", False) and cfg.ds.zero_stage == 3:
        errors.append(ZERO3_COMPILE)
    if cfg.compare_skip and (cfg.compare_skip < 0 or cfg.ds.zero_stage == 3):
        errors.append(f"--compare_skip {cfg.compare_skip}: a number of repeats >= 0, timed under ZeRO stage 2 or less")
    if cfg.compare_gc and cfg.ds.zero_stage == 3:
        errors.append(
            "--compare_gc times passes outside DeepSpeed's gradient path, which ZeRO-3 does not allow; use stage 2"
        )
    if cfg.measure_grad_error and (cfg.actor.backend != "hilore" or cfg.ds.zero_stage == 3):
        errors.append(
            "--measure_grad_error compares HiLoRe's gradient with the exact one outside DeepSpeed's gradient "
            f"path: it needs --actor_backend hilore (gc and none are exact) and ZeRO stage < 3, got "
            f"{cfg.actor.backend} and stage {cfg.ds.zero_stage}"
        )
    if cfg.replay.enable:
        from ..rollout.replay import PRIORITIES

        r = cfg.replay
        if r.max_age < 1 or r.capacity < 1 or r.ratio < 0 or r.alpha < 0:
            errors.append(
                f"--replay.max_age and --replay.capacity must be >= 1 and --replay.ratio, --replay.alpha >= 0; "
                f"got {r.max_age}, {r.capacity}, {r.ratio}, {r.alpha}"
            )
        if r.priority not in PRIORITIES:
            errors.append(f"--replay.priority {r.priority!r}: choose one of {', '.join(PRIORITIES)}")
        if not errors and replay_sequences(cfg) == 0:
            errors.append(
                f"--replay.ratio {r.ratio} x {cfg.rollout.batch_size * G} fresh rollouts is less than one update "
                f"of --train.batch_size {cfg.train.batch_size}: nothing would be replayed"
            )
    errors += logging_errors(cfg) + eval_errors(cfg) + ignored_errors(cfg)
    errors += value_errors(cfg)
    errors += hilore_errors(cfg.hilore)
    if cfg.hilore.skip_zero_advantage in SKIP_SETTINGS:  # (a bad choice is hilore_errors')
        try:
            skipping = skips_zero_advantage(cfg)
        except ValueError as e:
            errors.append(str(e))
        else:
            if cfg.compare_skip > 0 and not skipping:
                errors.append(
                    "--compare_skip needs the zero-advantage skip: --hilore.skip_zero_advantage auto or on, and no KL "
                    "loss (--algo.kl.use_loss false)"
                )
    if len(errors) == 1:
        raise ConfigError(errors[0])
    if errors:
        raise ConfigError(f"{len(errors)} problems:\n  - " + "\n  - ".join(errors))


def uses_reference(cfg) -> bool:
    """Whether the loss reads the reference policy's log-probs: the KL loss on with a coefficient
    other than 0. Else the job starts no reference worker (OpenRLHF 0.11.2 creates none when
    ``init_kl_coef`` is 0) and logs no ``kl``."""
    return bool(cfg.algo.kl.use_loss) and cfg.algo.kl.init_coef != 0


def skip_blockers(cfg) -> List[str]:
    """The job's loss terms that give a response with advantage 0 a gradient (``grpo/skip.py``)."""
    out = []
    if uses_reference(cfg):
        out.append(f"--algo.kl.use_loss adds a KL term (--algo.kl.init_coef {cfg.algo.kl.init_coef})")
    if cfg.actor.loss_agg_mode == "seq-mean-token-mean":
        out.append("--actor.loss_agg_mode seq-mean-token-mean divides each packed row by its own token count")
    return out


def skips_zero_advantage(cfg) -> bool:
    """``--hilore.skip_zero_advantage`` resolved for the job (``ValueError``: ``on`` where it is not exact)."""
    return skip_active(cfg.hilore.skip_zero_advantage, skip_blockers(cfg))


# (flag, test, what it must be): ranges the job's parts would otherwise refuse late, or not at all
RANGES = [
    ("rollout.temperature", lambda v: v > 0, "> 0"),
    ("rollout.top_p", lambda v: 0 < v <= 1, "within (0, 1]"),
    ("actor.adam.lr", lambda v: v >= 0, ">= 0"),
    ("actor.adam.weight_decay", lambda v: v >= 0, ">= 0"),
    ("actor.adam.betas", lambda v: all(0 <= b < 1 for b in v), "two values within [0, 1)"),
    ("actor.eps_clip", lambda v: v > 0, "> 0"),
    ("actor.max_norm", lambda v: v > 0, "> 0"),
    ("actor.eps_clip_low_high", lambda v: v is None or all(b > 0 for b in v), "two values > 0"),
    ("actor.dual_clip", lambda v: v is None or v > 1, "> 1"),
    ("actor.lr_warmup_ratio", lambda v: 0 <= v <= 1, "within [0, 1]"),
    ("algo.kl.init_coef", lambda v: v >= 0, ">= 0"),
    ("actor.num_nodes", lambda v: v >= 1, ">= 1"),
    ("data.max_samples", lambda v: v >= 1, ">= 1"),
    ("data.prompt_max_len", lambda v: v >= 1, ">= 1"),
    ("ds.lora.rank", lambda v: v >= 0, ">= 0 (0: all weights)"),
    ("ds.lora.alpha", lambda v: v > 0, "> 0"),
    ("ds.lora.dropout", lambda v: 0 <= v < 1, "within [0, 1)"),
    ("vllm.num_engines", lambda v: v >= 0, ">= 0"),
    ("vllm.gpu_memory_utilization", lambda v: 0 < v <= 1, "within (0, 1]"),
    ("rollout.num_gpus", lambda v: v >= 0, ">= 0"),
    ("ref.num_gpus", lambda v: v >= 0, ">= 0"),
    ("rollout.max_restarts", lambda v: v >= 0, ">= 0"),
    ("train.max_skipped_updates", lambda v: v >= 0, ">= 0"),
    ("ckpt.save_steps", lambda v: v >= 1 or v == -1, ">= 1, or -1 (only at the end)"),
    ("ckpt.max_num", lambda v: v >= 1, ">= 1"),
    ("threads", lambda v: v is None or v >= 1, ">= 1"),
]


def _finite(v) -> bool:
    import math

    return all(math.isfinite(x) for x in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(x, float))


def value_errors(cfg) -> List[str]:
    """Values out of range, unknown choices, and settings that would be silently ignored."""
    import json

    from ..grpo import ESTIMATORS, KL_ESTIMATORS, LOSS_AGG_MODES

    flat, errors = flatten_ns(cfg), []
    for name, ok, want in RANGES:
        v = flat[name]
        if not _finite(v):
            errors.append(f"--{name} {v}: must be a finite number, {want}")
        elif not ok(v):
            errors.append(f"--{name} {v}: must be {want}")
    for name, choices in (
        ("algo.advantage.estimator", ESTIMATORS),
        ("algo.kl.estimator", KL_ESTIMATORS),
        ("actor.loss_agg_mode", LOSS_AGG_MODES),
    ):
        if flat[name] not in choices:
            errors.append(f"--{name} {flat[name]!r}: choose one of {', '.join(choices)}")
    if cfg.actor.lr_scheduler != DEFAULTS["actor.lr_scheduler"]:  # transformers' list imports peft: seconds
        try:
            from transformers import SchedulerType

            names = [t.value for t in SchedulerType]
            if cfg.actor.lr_scheduler not in names:
                errors.append(f"--actor.lr_scheduler {cfg.actor.lr_scheduler!r}: choose one of {', '.join(names)}")
        except ImportError:  # transformers absent: the learner reports it
            pass
    if cfg.data.task_options:
        try:
            opts = json.loads(cfg.data.task_options)
        except ValueError as e:
            opts = e
        if not isinstance(opts, dict):
            errors.append(f"--data.task_options {cfg.data.task_options!r}: expected a JSON object ({opts})")
    if cfg.reward.name and not cfg.reward.path:
        errors.append("--reward.name names a function of --reward.path: pass the file or module too")
    if cfg.reward.remote_url:
        if cfg.reward.path:
            errors.append("--reward.remote_url and --reward.path are two rewards: choose one")
        bad = [u for u in cfg.reward.remote_url.split(",") if not u.strip().startswith(("http://", "https://"))]
        if bad:
            errors.append(f"--reward.remote_url {bad[0]!r}: an http:// or https:// URL (several: comma-separated)")
    if cfg.vllm.num_engines > 0:
        import importlib.util

        import torch

        if not torch.cuda.is_available():
            errors.append("--vllm.num_engines > 0 needs CUDA; on CPU use HF generate workers (--vllm.num_engines 0)")
        elif importlib.util.find_spec("vllm") is None:
            errors.append("--vllm.num_engines > 0 needs vllm: pip install 'hilore-actor[gpu]'")
    return errors


def eval_errors(cfg) -> List[str]:
    """``validate``'s part for ``--eval.*`` (the file itself is read in ``run``, before Ray)."""
    e, errors = cfg.eval, []
    if e.max_samples < 1:
        errors.append(f"--eval.max_samples must be >= 1, got {e.max_samples}")
    if e.dataset and e.dataset.split(":")[0] in ("rg", "toy"):
        errors.append(
            f"--eval.dataset {e.dataset}: a held-out set is a dataset file (a generated task would draw "
            "its problems with the training task's seed)"
        )
    return errors


# The --hilore.* settings every backend reads: B, what it counts, the planning microbatch (gc's
# peak is measured on it) and the zero-advantage skip. The others shape HiLoRe's plan, which
# gc and none do not make.
ANY_BACKEND = ("hilore.budget", "hilore.budget_scope", "hilore.plan_tokens", "hilore.skip_zero_advantage")
# Flags that act only beside another: (the dependent flags' prefix, the flags that turn the
# feature on, the one to name, whether it is on).
REQUIRES = (
    ("replay.", ("replay.enable",), "--replay.enable", lambda cfg: cfg.replay.enable),
    ("eval.", ("eval.dataset",), "--eval.dataset", lambda cfg: bool(cfg.eval.dataset)),
    (
        "logger.wandb.",
        ("logger.wandb.enable", "logger.wandb.key"),
        "--use_wandb",
        lambda cfg: cfg.logger.wandb.enable or bool(cfg.logger.wandb.key),
    ),
)
FILE_KEYS = ("data.input_key", "data.label_key")  # fields of a dataset file
COMPILE_ONLY = ("hilore.compile_activation_budget", "hilore.compile_layer_regions")  # with --hilore.compile
L_ONLY = ("hilore.codec", "hilore.calibration", "hilore.calibration_batches", "hilore.delta", "hilore.token_rows")


def _is_file_task(spec: str) -> bool:
    return not spec.startswith(("rg:", "toy:"))


def ignored_errors(cfg) -> List[str]:
    """Flags the user gave that would have no effect in this combination: refused, so nothing
    is silently ignored (``ignored_notes``: the harmless ones, said in one line each)."""
    user, errors = set(getattr(cfg, "user_set", ())), []
    for prefix, switches, needed, present in REQUIRES:
        given = sorted(k for k in user if k.startswith(prefix) and k not in switches)
        if given and not present(cfg):
            them = "them" if len(given) > 1 else "it"
            errors.append(f"{', '.join('--' + k for k in given)} given without {needed}: add it, or drop {them}")
    spec = cfg.data.prompt_dataset
    if "data.task_options" in user and not spec.startswith("rg:"):
        errors.append(
            f"--data.task_options sets a reasoning-gym task's options; --data.prompt_dataset {spec} is not one"
        )
    keys = sorted(k for k in user if k in FILE_KEYS)
    if keys and not _is_file_task(spec):
        name = "name fields" if len(keys) > 1 else "names a field"
        errors.append(f"{', '.join('--' + k for k in keys)} {name} of a dataset file; {spec} has none")
    compiled = sorted(k for k in user if k in COMPILE_ONLY)
    if compiled and cfg.actor.backend == "hilore" and not cfg.hilore.compile:
        them = "them" if len(compiled) > 1 else "it"
        errors.append(
            f"{', '.join('--' + k for k in compiled)} given without --hilore.compile true: add it, or drop {them}"
        )
    if cfg.actor.gradient_checkpointing_enable and cfg.actor.backend == "none":
        errors.append(
            "--actor.gradient_checkpointing_enable asks for gradient checkpointing and --actor_backend none stores "
            "every activation: choose one (--actor_backend gc checkpoints every layer)"
        )
    return errors


def ignored_notes(cfg) -> List[str]:
    """One line per flag the chosen combination leaves without effect where that is harmless
    (a command kept the same across backends, as in a comparison)."""
    user, notes = set(getattr(cfg, "user_set", ())), []
    if cfg.actor.backend != "hilore":
        plan_only = sorted(k for k in user if k.startswith("hilore.") and k not in ANY_BACKEND)
        if plan_only:
            notes.append(
                f"[train] --actor_backend {cfg.actor.backend}: {', '.join('--' + k for k in plan_only)} "
                f"ha{'ve' if len(plan_only) > 1 else 's'} no effect (HiLoRe's plan only; "
                f"{'gc recomputes every layer' if cfg.actor.backend == 'gc' else 'none stores every activation'})"
            )
    low = sorted(k for k in user if k in L_ONLY)
    if low and cfg.actor.backend == "hilore" and cfg.hilore.mode == "hilore-hr":
        notes.append(
            f"[train] --hilore.mode hilore-hr: {', '.join('--' + k for k in low)} ha{'ve' if len(low) > 1 else 's'} "
            "no effect (L's settings; hilore-hr stores or recomputes only)"
        )
    if cfg.actor.gradient_checkpointing_enable and cfg.actor.backend == "hilore":
        notes.append("[hilore] --actor.gradient_checkpointing_enable is replaced by HiLoRe's per-unit recompute")
    if "ref.num_gpus" in user and not uses_reference(cfg):
        notes.append("[train] --ref.num_gpus has no effect: without the KL loss the job starts no reference worker")
    if "data.instruction" in user and cfg.data.prompt_dataset == "toy:vowels":
        notes.append("[train] --data.instruction has no effect on toy:vowels, whose prompts are fixed")
    return notes


WANDB_ONLINE = ("online", "run", "shared")


def logging_errors(cfg) -> List[str]:
    """``validate``'s part for ``--logger.*``: W&B installed and, online, logged in (checked
    without network, before Ray starts)."""
    errors = []
    if cfg.logger.samples_per_step < 0:
        errors.append(f"--logger.samples_per_step must be >= 0, got {cfg.logger.samples_per_step}")
    w = cfg.logger.wandb
    if not (w.enable or w.key):
        return errors
    import importlib.util

    if importlib.util.find_spec("wandb") is None:
        return errors + ["--use_wandb needs the wandb package: pip install 'hilore-actor[wandb]' (or wandb)"]
    import wandb

    try:
        mode = wandb.setup().settings.mode
    except Exception as e:  # noqa: BLE001  e.g. WANDB_MODE=nonsense (a pydantic ValidationError)
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()] or [type(e).__name__]
        why = next((ln for ln in lines if "should be" in ln), lines[0])  # pydantic's line naming the choices
        env = os.environ.get("WANDB_MODE")
        return errors + [f"--use_wandb: W&B's settings do not load (WANDB_MODE={env!r}): {why}"]
    if mode in WANDB_ONLINE and not w.key:
        try:
            ok = wandb.login(prompt=False)  # no network: it reads WANDB_API_KEY / ~/.netrc
        except Exception as e:  # noqa: BLE001  a malformed WANDB_API_KEY
            ok, why = False, str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        else:
            why = "no API key"
        if not ok:
            errors.append(
                f"--use_wandb: W&B is online and has {why}: run `wandb login`, set WANDB_API_KEY or "
                "--logger.wandb.key, or log offline with WANDB_MODE=offline"
            )
    return errors
