"""``--resume`` with flags that differ from the checkpoint's: refused, re-planned, or applied.

A checkpoint's ``meta.json`` keeps the run's flags (``config``, ``saved_config``). Before Ray starts,
the driver compares them with this run's (``check``), so a resumed run is the run it says it is:

- refused, one line, exit 2: what the checkpoint's state was made for. The model, LoRA, dtype, ZeRO
  stage and world size (its weights, optimizer state and ZeRO partitions); AdamW's lr, betas and
  weight decay (the optimizer state would silently restore the checkpoint's); and what decides the
  rollouts a step trains on (``--data.*``, ``--reward.*``, the seed, the rollout and update batch sizes).
- re-planned, one line: the memory settings (``--hilore.*``, the backend, the micro batch size, and
  whatever changes the planning microbatch, e.g. ``--rollout.max_new_tokens``). The saved budget and
  plan were made for the old values, so every rank plans anew on the bare model, as a fresh run does
  (the learners call ``replan_flags`` too): lowering the budget after running out of memory works.
- anything else is applied as given: ``--max_steps``, logging, checkpoint cadence, loss and sampling
  settings, rollout workers.

A checkpoint whose files kept no flags (``partial_config``, ``checkpoint.migrate``) is checked on
what its files tell: the world size and the budget settings kept with the plan; the driver says so.
"""

from __future__ import annotations

import json
from typing import Callable, Dict, List, Tuple

from .checkpoint import WORLD, read_state

MODEL = (
    "actor.model_name_or_path",
    "ds.lora.rank",
    "ds.lora.alpha",
    "ds.lora.dropout",
    "ds.lora.target_modules",
    "ds.param_dtype",
    "ds.zero_stage",
)
OPTIMIZER = ("actor.adam.lr", "actor.adam.betas", "actor.adam.weight_decay")
DATA = ("train.seed", "rollout.batch_size", "rollout.n_samples_per_prompt", "train.batch_size")
DATA_PREFIXES = ("data.", "reward.")
REPLAN = ("actor.backend", "train.micro_batch_size")
REPLAN_PREFIXES = ("hilore.",)

REASONS = {  # why each class is refused
    "model": "the checkpoint's weights and optimizer state are for its model setup",
    "world": "the checkpoint's ZeRO partitions are for its number of ranks",
    "optimizer": "the checkpoint's optimizer state would silently restore its own value",
    "data": "a step would train on other rollouts than the run it continues",
}


class ResumeError(ValueError):
    """``--resume`` with a flag the checkpoint cannot honour; the message names it (``main``: exit 2)."""


def saved_config(cfg) -> Dict:
    """The run's flags, JSON-ready, for ``meta.json`` (``config``)."""
    from .config import flatten_ns, world_size

    return dict(json.loads(json.dumps(flatten_ns(cfg), default=str)), **{WORLD: world_size(cfg)})


def _settings(flat: Dict) -> Dict:
    """This run's flags as ``saved_config`` writes them (``flat``: ``config.flatten_ns``)."""
    out = json.loads(json.dumps({k: v for k, v in flat.items() if k != "user_set"}, default=str))
    out[WORLD] = int(flat["actor.num_nodes"]) * int(flat["actor.num_gpus_per_node"])
    return out


def checkpoint_settings(folder) -> Tuple[Dict, bool]:
    """(the checkpoint's flags, whether they are complete: False where its files kept none)."""
    meta = read_state(folder)["meta"]
    return meta["config"], not meta.get("partial_config", False)


def _same(key: str, a, b) -> bool:
    """Equal as settings, not as text."""
    if key == "hilore.budget":  # "1.10" and 1.1 are one budget
        from ..allocation.budget import BudgetError, parse_budget

        try:
            return parse_budget(str(a)) == parse_budget(str(b))
        except BudgetError:
            return str(a).strip().lower() == str(b).strip().lower()
    return a == b


def differences(saved: Dict, flat: Dict) -> Dict[str, Tuple]:
    """``flag -> (checkpoint's value, this run's)`` for every flag both know and that differs."""
    mine = _settings(flat)
    return {k: (saved[k], mine[k]) for k in sorted(saved) if k in mine and not _same(k, saved[k], mine[k])}


def _kind(key: str) -> str:
    """refused classes (``REASONS``), ``replan``, or ``applied``."""
    if key in MODEL:
        return "model"
    if key == WORLD:
        return "world"
    if key in OPTIMIZER:
        return "optimizer"
    if key in DATA or key.startswith(DATA_PREFIXES):
        return "data"
    if key in REPLAN or key.startswith(REPLAN_PREFIXES):
        return "replan"
    return "applied"


def replan_flags(folder, flat: Dict) -> List[str]:
    """The changed flags that make every rank plan anew instead of restoring the saved plan (empty:
    restore it). The driver and each learner rank call this on the same checkpoint and flags."""
    saved, _ = checkpoint_settings(folder)
    return [k for k in differences(saved, flat) if _kind(k) == "replan"]


def _flag(key: str) -> str:
    from .config import ALIASES

    if key == WORLD:
        return "the world size (--actor.num_nodes x --actor.num_gpus_per_node)"
    alias = next((a for a, t in ALIASES.items() if t == key), None)
    return f"--{key}" + (f" (--{alias})" if alias else "")


def _values(diff: Dict[str, Tuple], keys: List[str]) -> str:
    return ", ".join(f"{_flag(k)} {diff[k][1]!r} (the checkpoint's {diff[k][0]!r})" for k in keys)


def _say(msg: str) -> None:
    print(msg, flush=True)


def check(folder, flat: Dict, log: Callable[[str], None] = _say) -> List[str]:
    """Before Ray: ``ResumeError`` (one line) for refused changes; else say what is re-planned and
    return those flags (empty: the checkpoint's plan is restored)."""
    saved, complete = checkpoint_settings(folder)
    diff = differences(saved, flat)
    refused: Dict[str, List[str]] = {}
    for k in diff:
        if _kind(k) in REASONS:
            refused.setdefault(_kind(k), []).append(k)
    if refused:
        why = "; ".join(f"{_values(diff, keys)}: {REASONS[kind]}" for kind, keys in refused.items())
        raise ResumeError(
            f"--resume from {folder}: {why}; resume with the checkpoint's values, or start a new run "
            f"in another --save_path"
        )
    if not complete:
        log(
            f"[train] {folder} keeps no flags of its run: only the world size and the budget "
            f"settings are checked; the model, LoRA, dtype, optimizer and data flags must be the run's"
        )
    replan = [k for k in diff if _kind(k) == "replan"]
    if replan:
        log(
            f"[train] --resume with {_values(diff, replan)}: every rank plans anew (budget and plan) instead of "
            f"restoring the checkpoint's"
        )
    return replan
