"""HiLoRe's settings in verl: the ``+actor_rollout_ref.actor.hilore.*`` overrides.

verl builds its actor config as a frozen dataclass (``FSDPActorConfig``) that refuses unknown
keys, on the driver and again in every worker, so the launcher takes HiLoRe's overrides out
of the Hydra command line before verl sees them (``split_overrides``), checks them with the
learner room's one definition (``learner/settings.py``), and hands them to the workers as one
JSON environment variable (``CONFIG_ENV``), beside the job facts the engine cannot see (the
planning microbatch's tokens, the group size).

Imports the package's learner room only.
"""

from __future__ import annotations

import base64
import json
import os
from types import SimpleNamespace
from typing import Dict, List, Tuple

CONFIG_ENV = "HILORE_VERL_CONFIG"
PREFIX = "actor_rollout_ref.actor.hilore."
# verl-only keys beside the shared --hilore.* settings: key -> (default, help)
VERL_KEYS = {
    "enable": ("false", "turn HiLoRe on (true) or run verl unchanged (false)"),
    "fsdp": (
        "fsdp2",
        "FSDP version under HiLoRe's engine: fsdp2 or fsdp; actor_rollout_ref.actor.strategy=fsdp|fsdp2 says the same",
    ),
}

# shared --hilore.* settings verl's engine cannot honour: refused with one line, never silently ignored
NO_EFFECT = {"chunked_head": "verl's engine computes the log-probs with its own head"}


def split_overrides(argv: List[str]) -> Tuple[List[str], Dict[str, str]]:
    """(verl's own overrides, HiLoRe's ``KEY -> raw value``) from Hydra overrides; HiLoRe's may
    carry Hydra's ``+`` (or ``++``) or not."""
    rest, ours = [], {}
    for arg in argv:
        bare = arg.lstrip("+")
        if bare.startswith(PREFIX) and "=" in bare:
            key, value = bare[len(PREFIX) :].split("=", 1)
            ours[key] = value
        else:
            rest.append(arg)
    return rest, ours


def parse(raw: Dict[str, str]) -> Tuple[bool, Dict, Dict]:
    """(enabled, typed HiLoRe settings, verl-only values); ``ValueError`` with one message
    naming every bad override."""
    from ..learner.settings import boolean, parse_hilore

    raw = dict(raw)
    verl = {k: raw.pop(k) for k in list(raw) if k in VERL_KEYS}
    try:
        enabled = boolean(verl.pop("enable", "false"))
    except ValueError as e:
        raise ValueError(f"+{PREFIX}enable: {e}") from None
    fsdp = verl.get("fsdp")  # None: the recipe's strategy, else fsdp2 (main_ppo.fsdp_version)
    if fsdp not in (None, "fsdp", "fsdp2"):
        raise ValueError(f"+{PREFIX}fsdp={fsdp}: choose fsdp2 or fsdp")
    try:
        settings = parse_hilore(raw)
    except ValueError as e:
        msg = str(e).replace("--hilore.", "+" + PREFIX).replace("flag", "override")
        raise ValueError(f"{msg} (verl-only: {', '.join(PREFIX + k for k in VERL_KEYS)})") from None
    for key, why in NO_EFFECT.items():
        if key in settings:
            raise ValueError(f"+{PREFIX}{key}={raw[key]} has no effect under verl ({why}): drop it")
    return enabled, settings, {"fsdp": fsdp}


def to_env(settings: Dict, job: Dict) -> str:
    """Unpadded base64 JSON: a Hydra override value may hold no braces, commas or '='."""
    return base64.urlsafe_b64encode(json.dumps({"settings": settings, "job": job}).encode()).decode().rstrip("=")


def from_env() -> Tuple[SimpleNamespace, Dict]:
    """(the ``--hilore.*`` settings with defaults, the job facts) a worker was given."""
    from ..learner.settings import hilore_settings

    raw = os.environ.get(CONFIG_ENV, "")
    cfg = json.loads(base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)).decode()) if raw else {}
    return hilore_settings(**cfg.get("settings", {})), dict(cfg.get("job", {}))
