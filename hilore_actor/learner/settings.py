"""HiLoRe's ``--hilore.*`` settings: one definition for every learner integration.

The training job adds these flags to its own (``train/config.py``), the OpenRLHF launcher
parses them beside OpenRLHF's flags (``openrlhf/train_ppo_ray.py``) and its policy actor reads
them back from the environment, and verl's launcher takes them as overrides
(``verl/settings.py``). Their names, types, defaults and help come from two dataclasses:
``Settings`` (the learner's own: B, its scope, calibration, codecs, compilation, the head)
and ``allocation.Planner.Config`` (the planner's, which ``Settings`` takes by name:
``planner_field``), so the integrations cannot drift apart and each default has one source.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, List, Optional, Tuple, get_type_hints

from ..allocation.planner import Planner
from ..recovery.codecs import DEFAULT_CODECS


def boolean(value) -> bool:
    """``true``/``false`` (also 1/0, yes/no, on/off) for flags that are on by default."""
    v = str(value).strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {value!r}")


boolean.__name__ = "true|false"


def auto_on_off(value) -> str:
    """``auto``, ``on`` or ``off``, with a boolean's spellings read as on/off (``true``, ``false``,
    1/0, yes/no), so ``--flag true`` means ``on``; anything else is left for the check that
    names the choices."""
    v = str(value).strip().lower()
    try:
        return v if v == "auto" else "on" if boolean(v) else "off"
    except ValueError:
        return v


auto_on_off.__name__ = "auto|on|off"

PLANNER = "planner"  # metadata key: a field taken from ``Planner.Config``


def planner_field(name: str):
    """A ``Settings`` field that is the planner's ``Planner.Config.<name>``: its default and help
    come from there (a tuple default as its comma list, the flag's form)."""
    f = {f.name: f for f in fields(Planner.Config)}[name]
    default = ",".join(map(str, f.default)) if isinstance(f.default, tuple) else f.default
    return field(default=default, metadata={"help": f.metadata["help"], PLANNER: True})


def _help(text: str) -> Dict[str, str]:
    return {"help": text}


@dataclass
class Settings:
    """The ``--hilore.*`` flags, in the order ``--help`` and the docs list them."""

    budget: str = field(
        default="1.10",
        metadata=_help(
            "memory budget B per rank: a ratio of gc's peak (1.10), a size (6GiB), or auto "
            "(CUDA: the memory free at start-up plus what the learner holds, less 8 percent of the device; "
            "CPU: 1.25 x gc); at least the all-R peak (every unit recomputed), which may be below gc's peak"
        ),
    )
    budget_scope: str = field(
        default="device",
        metadata=_help(
            "what B counts: device (the rank's whole peak: weights, gradients, "
            "optimizer state and the microbatch, as a GPU's capacity bounds it; the paper's B_GC) or activations "
            "(only what a microbatch allocates above what it starts with: stricter)"
        ),
    )
    fill: float = field(
        default=0.95,
        metadata=_help(
            "share of B a microbatch's plan aims at once the rank has measured its peaks: each "
            "plan is sized so that its predicted peak times the largest measured-to-predicted ratio of the last 4 "
            "microbatches is fill x B (planned unit bytes miss real rollouts by a few percent; 0: keep the "
            "planning-time correction; over B the coordinator tightens)"
        ),
    )
    mode: str = planner_field("mode")
    delta: float = planner_field("delta")
    tolerance: float = planner_field("tolerance")
    refresh_every: int = planner_field("refresh_every")
    calibration_batches: int = field(
        default=16,
        metadata=_help(
            "microbatches for L's risk calibration (C; modes with L): the first step's real "
            "rollout microbatches, shared among the ranks (synthetic ones before DeepSpeed under ZeRO-3)"
        ),
    )
    calibration: Optional[str] = field(
        default=None, metadata=_help("calibration JSON to reuse (written there after calibrating)")
    )
    codec: str = field(
        default=DEFAULT_CODECS,
        metadata=_help(
            "low-precision codec(s) for L, a comma list (hilore_actor.recovery.CODECS: int8, "
            "int8-g64, int8-g128, int8-outlier, bf16, fp8-e4m3, fp8-e4m3-b32, fp8-e5m2; int2, ternary, only for "
            "positive controls): the first is the "
            "engine's, each one more is one more L level per unit for the knapsack, with its own bytes, time and "
            "calibrated risk"
        ),
    )
    partial: bool = planner_field("partial")
    token_rows: str = planner_field("token_rows")
    compile: bool = field(
        default=False,
        metadata=_help(
            "compile each recovery unit's forward in place (regional torch.compile: "
            "inductor's fused kernels for norms, attention and MLP) and plan on the compiled units; H, R and P stay "
            "exact, L compresses MLP units only (docs/compile.md); the first microbatches pay the compile time"
        ),
    )
    compile_activation_budget: float = field(
        default=1.0,
        metadata=_help(
            "with --hilore.compile: torch's activation_memory_budget for each "
            "compiled unit's graph, in [0, 1] (1: inductor's fastest cut; lower: its partitioner recomputes cheap "
            "fused ops in the unit's backward, so H keeps fewer bytes per unit, exactly)"
        ),
    )
    compile_layer_regions: bool = field(
        default=False,
        metadata=_help(
            "with --hilore.compile: also compile each decoder layer as one "
            "region, which a planned microbatch runs where the layer's units are all planned exact (kept H) or all "
            "R, for fusion across its units; other layers run their units' regions (docs/compile.md)"
        ),
    )
    chunked_head: bool = field(
        default=True,
        metadata=_help(
            "compute the action log-probs (and entropy) from the last hidden state a "
            "few rows of the head at a time, never the full float32 logits (false: the model's own head, as "
            "OpenRLHF runs it)"
        ),
    )
    plan_tokens: Optional[int] = field(
        default=None,
        metadata=_help(
            "tokens of the planning microbatch (default: micro batch x (longest prompt + "
            "max new tokens), the largest microbatch the job can make); smaller ones use the same plan and hold less"
        ),
    )
    profile_repeats: int = planner_field("profile_repeats")
    loo: bool = planner_field("loo")
    skip_zero_advantage: str = field(
        default="auto",
        metadata={
            "help": "leave every response whose advantage is exactly 0 (a group of equal rewards) out of the forward "
            "and backward, keeping the update's denominators: auto (exactly when no KL or entropy term reaches such "
            "a response, so the update is unchanged), on (refused where it is not exact; also true), off (also false)",
            "type": auto_on_off,
        },
    )


def _flag_type(hint):
    """A field's type as its flag parses it: bool as ``boolean``, ``Optional[X]`` as X."""
    args = [a for a in getattr(hint, "__args__", ()) if a is not type(None)]
    hint = args[0] if args and getattr(hint, "__origin__", None) is not None else hint
    return boolean if hint is bool else hint


def flag_table(cls=Settings, prefix: str = "hilore.") -> List[Tuple]:
    """``(flag, type, default, help)`` per field of ``cls``, in its order (the job's flag table's form)."""
    hints = get_type_hints(cls)
    return [
        (
            prefix + f.name,
            f.metadata.get("type") or _flag_type(hints[f.name]),
            None if f.default is MISSING else f.default,
            f.metadata["help"],
        )
        for f in fields(cls)
    ]


HILORE_FLAGS = flag_table()
DEFAULTS = {spec[0][len("hilore.") :]: spec[2] for spec in HILORE_FLAGS}
TYPES = {spec[0][len("hilore.") :]: spec[1] for spec in HILORE_FLAGS}
PLANNER_SETTINGS = tuple(f.name for f in fields(Settings) if f.metadata.get(PLANNER))


def planner_config(hcfg, **overrides) -> Planner.Config:
    """The planner's ``Config`` from the ``--hilore.*`` settings (``token_rows`` parsed), with
    ``overrides`` (e.g. ``mode`` while L's calibration is pending); its other fields keep
    their defaults."""
    values = {name: getattr(hcfg, name) for name in PLANNER_SETTINGS}
    values["token_rows"] = token_rows(hcfg)
    return Planner.Config(**dict(values, **overrides))


def hilore_settings(**values) -> SimpleNamespace:
    """The ``--hilore.*`` defaults as ``ns.budget``, ``ns.mode`` ..., updated with ``values``."""
    unknown = sorted(set(values) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"unknown HiLoRe settings {unknown}; known: {', '.join(DEFAULTS)}")
    return SimpleNamespace(**dict(DEFAULTS, **values))


def hilore_errors(hcfg) -> List[str]:
    """What is wrong with the budget, its scope, the mode and the codec (empty when nothing)."""
    from ..allocation.budget import BudgetError, parse_budget
    from ..allocation.planner import MODES
    from ..grpo.skip import SETTINGS as SKIP_SETTINGS
    from ..recovery.codecs import CODECS
    from .scope import SCOPES

    errors = []
    if hcfg.skip_zero_advantage not in SKIP_SETTINGS:
        errors.append(f"--hilore.skip_zero_advantage {hcfg.skip_zero_advantage!r}: choose {', '.join(SKIP_SETTINGS)}")
    if hcfg.mode not in MODES:
        errors.append(f"--hilore.mode {hcfg.mode!r}: choose {', '.join(MODES)}")
    names = [c.strip() for c in str(hcfg.codec).split(",")]
    bad = [c for c in names if c not in CODECS]
    if bad or len(set(names)) != len(names):
        errors.append(
            f"--hilore.codec {hcfg.codec!r}: a comma list of distinct codecs from {', '.join(sorted(CODECS))}"
        )
    try:
        token_rows(hcfg)
    except ValueError as e:
        errors.append(str(e))
    if not 0.0 <= float(hcfg.fill) <= 1.0:
        errors.append(f"--hilore.fill {hcfg.fill}: a share of B within [0, 1] (0: no sizing by measured peaks)")
    if not 0.0 <= float(hcfg.compile_activation_budget) <= 1.0:
        errors.append(f"--hilore.compile_activation_budget {hcfg.compile_activation_budget}: a value within [0, 1]")
    if hcfg.budget_scope not in SCOPES:
        errors.append(f"--hilore.budget_scope {hcfg.budget_scope!r}: choose {' or '.join(SCOPES)}")
    if str(hcfg.budget).strip().lower() != "auto":
        try:
            kind, value = parse_budget(hcfg.budget)
        except BudgetError as e:
            errors.append(f"--hilore.budget: {e}")
        else:
            if value <= 0:  # the floor itself, the all-R peak, is measured at start-up (resolve_budget)
                errors.append(
                    f"--hilore.budget {hcfg.budget}: give a ratio of gc's peak above 0 (e.g. 1.10; below 1 where "
                    "HiLoRe's all-R peak allows) or a size (e.g. 12GiB)"
                )
    for name, low, what in (
        ("delta", 0.0, ">= 0"),
        ("tolerance", 0.0, ">= 0"),
        ("refresh_every", 1, ">= 1"),
        ("calibration_batches", 1, ">= 1"),
        ("profile_repeats", 1, ">= 1"),
        ("plan_tokens", 1, ">= 1"),
    ):
        v = getattr(hcfg, name)
        if v is not None and not (float(v) >= low and math.isfinite(float(v))):
            errors.append(f"--hilore.{name} {v}: must be {what}")
    if hcfg.calibration and Path(hcfg.calibration).exists():
        errors += _calibration_errors(hcfg)
    return errors


def _calibration_errors(hcfg) -> List[str]:
    """A calibration file to reuse must be one, for these codecs: found before any worker starts."""
    from ..allocation.calibration import check_levels, load_levels

    path = Path(hcfg.calibration)
    if not path.is_file():
        return [f"--hilore.calibration {path}: not a file"]
    try:
        check_levels(load_levels(path), hcfg.codec, f"--hilore.calibration {path}")
    except ValueError as e:
        return [str(e)]
    except Exception as e:  # a JSON of another shape
        return [f"--hilore.calibration {path}: not a hilore calibration file ({type(e).__name__}: {e})"]
    return []


def token_rows(hcfg) -> Tuple[float, ...]:
    """``--hilore.token_rows`` as shares in (0, 1); ``ValueError`` names the bad value."""
    raw = str(hcfg.token_rows or "").strip()
    try:
        shares = tuple(float(x) for x in raw.split(",") if x.strip())
    except ValueError:
        shares = (-1.0,)
    if any(not 0.0 < f < 1.0 for f in shares):
        raise ValueError(f"--hilore.token_rows {raw!r}: a comma list of shares strictly between 0 and 1, e.g. 0.1,0.25")
    return shares


def parse_hilore(raw: Dict[str, str]) -> Dict:
    """Typed values of ``--hilore.KEY VALUE`` strings; ``ValueError`` names the bad flag."""
    out = {}
    for k, v in raw.items():
        if k not in TYPES:
            raise ValueError(f"unknown flag --hilore.{k}; known: {', '.join('--hilore.' + t for t in TYPES)}")
        try:
            out[k] = TYPES[k](v) if v is not None else None
        except ValueError:
            raise ValueError(f"--hilore.{k} {v!r}: expected {TYPES[k].__name__}") from None
    errors = hilore_errors(hilore_settings(**out))
    if errors:
        raise ValueError("; ".join(errors))
    return out


def add_flags(parser) -> None:
    """The ``--hilore.*`` flags on another CLI's argparse parser (OpenRLHF's, once patched):
    raw strings, default None (unset), typed and checked by ``parse_hilore``, so the patched
    CLI and the launcher accept and refuse the same values."""
    for name, _, default, help_ in HILORE_FLAGS:
        parser.add_argument("--" + name, type=str, default=None, help=f"{help_} (default: {default})")
