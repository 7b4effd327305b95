"""The label vocabulary of the recovery engine and its grammar: the one module that parses and formats them.

A unit's *plan* is the representation it keeps while forward runs, fixed before forward; its
*action* is chosen after forward, among those its plan allows (``ALLOWED``). Both are strings,
so plans and actions travel as they are through flags, JSON, the planner and the engine::

    action := base [":" name] ["@" share]      base in H | L | P | R
    plan   := base [":" name] ["@" share]      base in exact | compressed | partial | checkpoint

Args:
    base: ``H`` stores the unit's saved tensors exactly, ``L`` keeps a low-precision copy, ``P``
        keeps only the outputs of the unit's expensive ops and recomputes the rest from them, ``R``
        recomputes everything. The plan made for each is ``exact`` (H, L or R later),
        ``compressed`` (L or R), ``partial`` (P or R) and ``checkpoint`` (R only).
    name: after ``L`` / ``compressed`` a codec (``codecs.CODECS``; none: the engine's codec), so
        several L levels per unit are just more labels; after ``P`` / ``partial`` a P level
        (``rules.PARTIAL_LEVELS``: ``core`` keeps the attention kernel's outputs alone). A
        compressed copy keeps its codec and a partial unit its level: the action names the same.
    share: ``L`` / ``compressed`` on token-wise units only (``UnitSpec.token_wise``): the share of
        the unit's token rows kept exact, the others compressed. Rows are chosen in forward, as the
        unit runs (``Step.keep_rows``), so an ``exact`` plan cannot become token L.

Example::

    split_label("L:bf16@0.25")     # ("L", "bf16")
    row_share("L:bf16@0.25")       # 0.25
    plan_for_label("L:bf16@0.25")  # "compressed:bf16@0.25"
    action_for_plan("partial:core")  # "P:core"
    allows("exact", "L:bf16")      # True; allows("exact", "L@0.25") is False
"""

from __future__ import annotations

from typing import Iterable, Optional, Tuple

from .codecs import CODECS
from .rules import PARTIAL_LEVELS

H, L, P, R = "H", "L", "P", "R"
EXACT, COMPRESSED, PARTIAL, CHECKPOINT = "exact", "compressed", "partial", "checkpoint"
PLANS = (EXACT, COMPRESSED, PARTIAL, CHECKPOINT)
ACTIONS = (H, L, P, R)
ALLOWED = {EXACT: (H, L, R), COMPRESSED: (L, R), PARTIAL: (P, R), CHECKPOINT: (R,)}
DEFAULT_ACTION = {EXACT: H, COMPRESSED: L, PARTIAL: P, CHECKPOINT: R}  # plan -> the action it was made for
PLAN_FOR_ACTION = {H: EXACT, L: COMPRESSED, P: PARTIAL, R: CHECKPOINT}
RECOMPUTED = (P, R)  # actions whose saved tensors backward rebuilds by replaying the unit
SEP = ":"  # before a codec or a P level
ROWS = "@"  # before a share of token rows
P_LABELS = tuple(P if k is None else P + SEP + k for k in PARTIAL_LEVELS)  # every P level as an action label


def split_label(label: str) -> Tuple[str, Optional[str]]:
    """``"L:bf16"`` -> ``("L", "bf16")``; ``"compressed"`` -> ``("compressed", None)``;
    a row share is not part of either: ``"L:bf16@0.25"`` -> ``("L", "bf16")``."""
    base, _, codec = label.partition(ROWS)[0].partition(SEP)
    return base, (codec or None)


def row_share(label: str) -> Optional[float]:
    """The share of token rows kept exact: ``"L@0.25"`` -> 0.25; None for whole-unit labels."""
    _, sep, share = label.partition(ROWS)
    return float(share) if sep else None


def with_share(label: str, share: float) -> str:
    """``"L:bf16"``, 0.25 -> ``"L:bf16@0.25"``."""
    return f"{label}{ROWS}{share}"


def without_share(label: str) -> str:
    """``"L:bf16@0.25"`` -> ``"L:bf16"``: the whole-unit label."""
    return label.partition(ROWS)[0]


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
    return names[0], (L,) + tuple(L + SEP + c for c in names[1:])


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


def region_kind(plans: Iterable[str]) -> Optional[str]:
    """H or R when a layer's unit plans let it run as one compiled region (all ``exact``, all
    ``checkpoint``: ``compiled.py``, layer regions), else None."""
    plans = set(plans)
    return H if plans == {EXACT} else R if plans == {CHECKPOINT} else None


def check_labels(labels: Iterable[str]) -> None:
    """Raise ``ValueError`` for a label whose name or share the grammar does not allow: a share
    outside [0, 1] or on a base other than L / compressed, an unknown codec or P level, a name
    after H, R, exact or checkpoint. The base itself is checked by the caller (plan or action)."""
    labels = list(labels)
    for label in labels:
        try:
            share = row_share(label)
        except ValueError:
            raise ValueError(f"{label!r}: a row share after '@' is a number in [0, 1]") from None
        if share is not None and (split_label(label)[0] not in (L, COMPRESSED) or not 0.0 <= share <= 1.0):
            raise ValueError(f"{label!r}: only L and compressed keep a share in [0, 1] of token rows exact")
    named = [(b, c) for b, c in map(split_label, labels) if c is not None]
    levels = sorted({f"{b}:{c}" for b, c in named if b in (P, PARTIAL) and c not in PARTIAL_LEVELS})
    if levels:
        raise ValueError(
            f"unknown P level in {levels}; P and partial may name {sorted(k for k in PARTIAL_LEVELS if k)}"
        )
    named = [(b, c) for b, c in named if b not in (P, PARTIAL)]
    misplaced = sorted({f"{b}:{c}" for b, c in named if b not in (L, COMPRESSED)})
    if misplaced:
        raise ValueError(f"only L and compressed name a codec (and P and partial a level), got {misplaced}")
    bad = sorted({c for _, c in named if c not in CODECS})
    if bad:
        raise ValueError(f"unknown codec(s) {bad} in a plan or actions; available: {sorted(CODECS)}")
