"""The records of one engine step: what each unit kept, how to rebuild it, and the bytes it holds.

The hooks (``hooks.py``) fill these records during forward and drain them during backward;
``Step`` (``step.py``) owns them for one microbatch. This module only holds data and counts
bytes. Labels (plans, actions) are ``labels.py``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set

import torch
from torch.utils._pytree import tree_leaves

from .codecs import PAYLOADS
from .labels import EXACT
from .units import LayerSpec, UnitSpec


def tensors(tree) -> List[torch.Tensor]:
    """The tensors among the leaves of a structure of lists, tuples and dicts (``torch.utils._pytree``)."""
    return [x for x in tree_leaves(tree) if isinstance(x, torch.Tensor)]


def storage_key(t: torch.Tensor) -> int:
    """Identifies the storage behind ``t``: views of one tensor share it. A meta tensor has no
    data pointer (every one reads 0): its storage object's own address tells them apart, so the
    engine counts a model's saved bytes on the meta device as on a real one (``hilore_actor.estimate``)."""
    s = t.untyped_storage()
    return s._cdata if s.device.type == "meta" else s.data_ptr()


def storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


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


@dataclass
class Choice:
    """What the unit may keep and keeps: its plan, fixed before forward, bounds the action chosen after it."""

    plan: str = EXACT  # the plan's base (labels.PLANS)
    action: Optional[str] = None  # the action's base (labels.ACTIONS), once set
    label: Optional[str] = None  # the action as chosen, with L's codec when one was named ("L:bf16")
    codec: Any = None  # the Codec of this unit's L copy (None: the engine's default)
    row_share: Optional[float] = None  # token L: the share of rows kept exact (plan "compressed@f")
    partial_level: Optional[str] = None  # P: which op outputs it keeps (plan "partial:core": "core")


@dataclass
class Saved:
    """What forward saved, by index in the unit's bundle: the handles autograd holds point here.
    ``hooks.pack`` fills it, ``Step.set_actions`` shrinks it (L compresses, R drops), ``hooks.unpack`` drains it."""

    count: int = 0  # tensors saved in forward (a replay must save as many)
    entries: Dict[int, Any] = field(default_factory=dict)  # idx -> Tensor | Payload | RowSplit | None
    external: Set[int] = field(default_factory=set)  # idx of checkpoint-input tensors (kept exact)
    ext_keys: Set[int] = field(default_factory=set)  # storages of the unit's checkpoint inputs
    kept: Set[int] = field(default_factory=set)  # idx that L keeps exact by rule (rules.py: attention core)
    signed: Set[int] = field(default_factory=set)  # idx saved inside a sign-reading activation (L keeps signs)
    strides: Dict[int, tuple] = field(default_factory=dict)  # idx -> strides a decoded copy must have (compiled units)
    row_index: Any = None  # token L: (kept rows, other rows) as index tensors, chosen in forward
    sac: Any = None  # P: (caching, cached) op-output modes of its forward and its replay; the first holds the outputs


@dataclass
class Rebuild:
    """How backward rebuilds an R or P unit: its recorded calls, re-run under a capture hook that
    collects the re-saved tensors in forward's order."""

    replay: Replay = field(default_factory=Replay)
    outputs: Dict[int, tuple] = field(default_factory=dict)  # id(tensor) -> (call, index), while recording
    recomputed: Dict[int, torch.Tensor] = field(default_factory=dict)  # idx -> tensor, until unpack takes it
    replayed: bool = False  # one replay per step: a second means a saved tensor went missing
    captured: int = 0  # tensors the running replay has re-saved so far


@dataclass
class Stats:
    """What the step measures for the planner: L's error (e_u), token norms (Eq. 7), seconds (Eq. 9)."""

    err_sq: float = 0.0  # L reconstruction: sum of squared errors and of squared values
    norm_sq: float = 0.0
    token_norms: Optional[torch.Tensor] = None  # [B, T] input norms, for exposure weights
    replay_seconds: float = 0.0  # profiling: time spent re-running this unit in backward
    codec_seconds: float = 0.0  # profiling: L encode + decode time
    timer: Optional[float] = None  # profiling: when the unit's replay started


@dataclass(eq=False)
class UnitState:
    """One unit in one step, in four groups: what it may keep (``choice``), what forward saved
    (``saved``), how backward rebuilds it (``rebuild``), what was measured (``stats``)."""

    spec: UnitSpec
    choice: Choice = field(default_factory=Choice)
    saved: Saved = field(default_factory=Saved)
    rebuild: Rebuild = field(default_factory=Rebuild)
    stats: Stats = field(default_factory=Stats)

    @property
    def name(self) -> str:
        return self.spec.name

    def release(self) -> None:
        """Drop whatever backward did not consume (the step ends)."""
        self.saved.entries.clear()
        self.saved.row_index = None
        self.saved.sac = None
        self.rebuild.recomputed.clear()
        self.rebuild.replay = Replay()


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
            for idx, v in u.saved.entries.items():
                if isinstance(v, PAYLOADS):
                    add(b, "compressed", id(v), v.nbytes)
                elif isinstance(v, torch.Tensor):
                    add(b, "checkpoint" if idx in u.saved.external else "exact", storage_key(v), storage_bytes(v))
            for t in partial_outputs(u):
                add(b, "partial", storage_key(t), storage_bytes(t))
            calls = u.rebuild.replay.calls + (layer.replay.calls if j == 0 else [])
            for t in tensors([(c.args, c.kwargs) for c in calls]):
                add(b, "checkpoint", storage_key(t), storage_bytes(t))
            out[u.name] = b
    return out


def partial_outputs(u: UnitState) -> List[torch.Tensor]:
    """The op outputs a partial unit keeps (torch's selective-checkpoint storage)."""
    if u.saved.sac is None:
        return []
    out = []
    for entries in u.saved.sac[0].storage.values():
        for v in entries.values():  # one _VersionWrapper per output (torch.utils.checkpoint), a tuple of
            for w in v if isinstance(v, (tuple, list)) else (v,):  # them for a multi-output op (sdpa)
                out += tensors(getattr(w, "val", None))
    return out
