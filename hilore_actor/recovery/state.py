"""Per-step state of the recovery engine: what each unit kept, and how to rebuild it.

The engine's mechanism (``engine.py``) fills these records during forward and drains them
during backward; this module only holds data and accounting.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

import torch

from .codecs import PAYLOADS
from .units import LayerSpec, UnitSpec

# The one table of actions and representations. An action (H: store exactly, L: keep a
# low-precision copy, P: keep only the outputs of the unit's expensive ops and recompute the
# rest from them, R: recompute) is chosen after forward; the representation a unit keeps
# during forward (its plan) bounds it: an exact bundle can still become H, L or R, a
# compressed one L or R, a partial one P or R, a checkpointed one only R.
H, L, P, R = "H", "L", "P", "R"
EXACT, COMPRESSED, PARTIAL, CHECKPOINT = "exact", "compressed", "partial", "checkpoint"
PLANS = (EXACT, COMPRESSED, PARTIAL, CHECKPOINT)
ACTIONS = (H, L, P, R)
ALLOWED = {EXACT: (H, L, R), COMPRESSED: (L, R), PARTIAL: (P, R), CHECKPOINT: (R,)}
DEFAULT_ACTION = {EXACT: H, COMPRESSED: L, PARTIAL: P, CHECKPOINT: R}  # plan -> the action it was made for
PLAN_FOR_ACTION = {H: EXACT, L: COMPRESSED, P: PARTIAL, R: CHECKPOINT}
RECOMPUTED = (P, R)  # actions whose saved tensors backward rebuilds by replaying the unit
# L may name its codec: the action "L:bf16" and the plan "compressed:bf16" keep a unit's copy
# in bf16 whatever the engine's default codec is ("L" / "compressed": the default). Several L
# levels per unit are then just more labels (allocation's knapsack picks among them).
SEP = ":"
# P may name its level the same way: "P:core" / "partial:core" keep only the attention kernel's
# outputs ("P": its matmuls' too; ``rules.PARTIAL_LEVELS``).
# Token-granular L (token-wise units only, ``UnitSpec.token_wise``): ``"L@0.25"`` /
# ``"compressed@0.25"`` keep the 25% of the unit's token rows with the largest exposure exact
# and compress the others; the rows are chosen in forward, as the unit runs (``Step.keep_rows``).
ROWS = "@"


_ACTIVE: list = [None]  # the engine step whose block is open, of whichever engine


def active_step():
    """The open engine step (``step.Step``), which a compiled layer region asks what to run."""
    return _ACTIVE[0]


def set_active_step(step):
    """Open ``step`` (None: close); returns the step that was open before."""
    before, _ACTIVE[0] = _ACTIVE[0], step
    return before


def region_kind(plans) -> Optional[str]:
    """H or R when a layer's unit plans let it run as one compiled region (all ``exact``, all
    ``checkpoint``: ``compiled.py``, layer regions), else None."""
    plans = set(plans)
    return H if plans == {EXACT} else R if plans == {CHECKPOINT} else None


def split_label(label: str) -> Tuple[str, Optional[str]]:
    """``"L:bf16"`` -> ``("L", "bf16")``; ``"compressed"`` -> ``("compressed", None)``;
    a row share is not part of either: ``"L:bf16@0.25"`` -> ``("L", "bf16")``."""
    base, _, codec = label.partition(ROWS)[0].partition(SEP)
    return base, (codec or None)


def row_share(label: str) -> Optional[float]:
    """The share of token rows kept exact: ``"L@0.25"`` -> 0.25; None for whole-unit labels."""
    _, sep, share = label.partition(ROWS)
    return float(share) if sep else None


def partial_level(label: str) -> Optional[str]:
    """The P level a P or partial label names: ``"partial:core"`` -> ``"core"``; None otherwise."""
    base, level = split_label(label)
    return level if base in (P, PARTIAL) else None


def _suffix(label: str) -> str:
    """What follows the base name: ``":bf16@0.25"``."""
    body, sep, share = label.partition(ROWS)
    _, csep, codec = body.partition(SEP)
    return (SEP + codec if csep and codec else "") + (ROWS + share if sep else "")


def plan_for_label(label: str) -> str:
    """The plan that admits an action label: ``"L:bf16@0.25"`` -> ``"compressed:bf16@0.25"``."""
    return PLAN_FOR_ACTION[split_label(label)[0]] + _suffix(label)


def action_for_plan(plan: str) -> str:
    """The action a plan label was made for: ``"compressed:bf16"`` -> ``"L:bf16"``."""
    return DEFAULT_ACTION[split_label(plan)[0]] + _suffix(plan)


def codec_levels(spec: str) -> Tuple[str, Tuple[str, ...]]:
    """A comma list of codecs (``--hilore.codec int8-g64,bf16``) -> the engine's codec
    ``int8-g64`` and the L levels ``("L", "L:bf16")`` a unit may choose among."""
    names = [c.strip() for c in str(spec).split(",") if c.strip()]
    if not names:
        raise ValueError("no codec given")
    return names[0], ("L",) + tuple(L + SEP + c for c in names[1:])


def allows(plan: str, action: str) -> bool:
    """Whether a unit planned ``plan`` can take ``action``: a compressed copy keeps its codec
    and its exact rows; rows are chosen in forward, so an exact bundle cannot become token L."""
    p, pc = split_label(plan)
    a, ac = split_label(action)
    if a not in ALLOWED[p]:
        return False
    if a == L and p == COMPRESSED:
        return pc == ac and row_share(plan) == row_share(action)
    if a == P:  # the kept op outputs were chosen in forward, by the plan's P level
        return pc == ac
    return not (a == L and row_share(action) is not None)


class Link:
    """An argument that was produced by an earlier module call of the same unit."""

    __slots__ = ("call", "index")

    def __init__(self, call: int, index: Optional[int]):
        self.call, self.index = call, index


@dataclass
class Call:
    module: torch.nn.Module
    args: Any  # structure of tensors (checkpoint inputs), Links and plain values
    kwargs: Any


@dataclass
class Replay:
    """How to re-run a forward exactly: module calls plus RNG and autocast state."""

    calls: List[Call] = field(default_factory=list)
    rng: Any = None
    autocast: Any = None


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


@dataclass(eq=False)
class UnitState:
    spec: UnitSpec
    plan: str = EXACT
    action: Optional[str] = None
    label: Optional[str] = None  # the action as chosen, with L's codec when one was named ("L:bf16")
    entries: Dict[int, Any] = field(default_factory=dict)  # idx -> Tensor | Payload | RowSplit | None
    external: Set[int] = field(default_factory=set)  # idx of checkpoint-input tensors (kept exact)
    ext_keys: Set[int] = field(default_factory=set)  # storages of the unit's checkpoint inputs
    kept: Set[int] = field(default_factory=set)  # idx that L keeps exact by rule (rules.py: attention core)
    signed: Set[int] = field(default_factory=set)  # idx saved inside a sign-reading activation (L keeps signs)
    strides: Dict[int, tuple] = field(default_factory=dict)  # idx -> strides a decoded copy must have (compiled units)
    n_saved: int = 0
    replay: Replay = field(default_factory=Replay)
    recomputed: Dict[int, torch.Tensor] = field(default_factory=dict)
    replayed: bool = False
    capture_count: int = 0
    err_sq: float = 0.0  # L reconstruction: sum of squared errors and of squared values
    norm_sq: float = 0.0
    token_norms: Optional[torch.Tensor] = None  # [B, T] input norms, for exposure weights
    replay_seconds: float = 0.0  # profiling: time spent re-running this unit in backward
    codec_seconds: float = 0.0  # profiling: L encode + decode time
    codec: Any = None  # the Codec of this unit's L copy (None: the engine's default)
    row_share: Optional[float] = None  # token L: the share of rows kept exact (plan "compressed@f")
    row_index: Any = None  # token L: (kept rows, other rows) as index tensors, chosen in forward
    sac: Any = None  # partial: (caching, cached) op-output modes of its forward and its replay
    partial_level: Optional[str] = None  # partial: which op outputs it keeps (plan "partial:core": "core")
    timer: Optional[float] = None
    outputs: Dict[int, tuple] = field(default_factory=dict)  # id(tensor) -> (call, index), while recording

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass(eq=False)
class LayerState:
    spec: LayerSpec
    units: List[UnitState]
    replay: Replay = field(default_factory=Replay)
    joint: bool = False  # every unit is R or P: one layer replay serves them all (shared recompute)


def unit_bytes(layers: List[LayerState], shared: bool = True) -> Dict[str, Dict[str, int]]:
    """Bytes each unit holds now, by representation. With ``shared`` a storage is counted
    once, for the first unit that holds it (the totals are real bytes); without, each unit is
    counted as if it were the only one held (what keeping just that unit would cost).
    Parameters are never in ``entries``. A layer's own checkpoint input (kept for a joint
    replay) is counted with its first unit."""
    seen: Set[int] = set()
    out = {}

    def add(b, kind, key, n):
        if key not in seen:
            seen.add(key)
            b[kind] += n

    for layer in layers:
        for j, u in enumerate(layer.units):
            if not shared:
                seen = set()
            b = {"exact": 0, "compressed": 0, "partial": 0, "checkpoint": 0}
            for idx, v in u.entries.items():
                if isinstance(v, PAYLOADS):
                    add(b, "compressed", id(v), v.nbytes)
                elif isinstance(v, torch.Tensor):
                    add(b, "checkpoint" if idx in u.external else "exact", storage_key(v), storage_bytes(v))
            for t in iter_tensors(partial_outputs(u)):
                add(b, "partial", storage_key(t), storage_bytes(t))
            calls = u.replay.calls + (layer.replay.calls if j == 0 else [])
            for t in iter_tensors([(c.args, c.kwargs) for c in calls]):
                add(b, "checkpoint", storage_key(t), storage_bytes(t))
            out[u.name] = b
    return out


def partial_outputs(u: UnitState) -> List[torch.Tensor]:
    """The op outputs a partial unit keeps (torch's selective-checkpoint storage)."""
    if u.sac is None:
        return []
    out = []
    for entries in u.sac[0].storage.values():
        for v in entries.values():  # one _VersionWrapper per output (torch.utils.checkpoint), a tuple of
            for w in v if isinstance(v, (tuple, list)) else (v,):  # them for a multi-output op (sdpa)
                out += list(iter_tensors(getattr(w, "val", None)))
    return out


def iter_tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from iter_tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from iter_tensors(o)


def map_structure(obj, fn):
    if isinstance(obj, (torch.Tensor, Link)):
        return fn(obj)
    if isinstance(obj, tuple):
        return tuple(map_structure(o, fn) for o in obj)
    if isinstance(obj, list):
        return [map_structure(o, fn) for o in obj]
    if isinstance(obj, dict):
        return {k: map_structure(v, fn) for k, v in obj.items()}
    return obj
