"""Recovery utility and memory per unit, Eq. 9, measured and cached per shape class.

``dtau_u(a) = [T(all-R) - T(all-R but u -> a)]_+`` and ``dm_u(a)`` = the peak bytes u adds.
Measuring 2U+1 complete updates per shape is too slow for long microbatches, so the
difference is measured *in place*, paired within one run: under all-R the engine times each
unit's forward replay in backward (exactly the time H removes), and under all-L it times
each unit's encode + decode (what L adds back). Runs are warmed up and repeated; medians are
kept. Memory: the bytes each unit's bundle holds after forward, exact (H) or compressed (L),
from the engine's allocator-level accounting, counted as if the unit were the only one kept
(a storage shared by several units, such as an attention mask, is charged to each), plus,
for an attention unit kept H or L, the MLP input that must then be kept for the MLP's own
replay (a P unit joins its layer's replay, which rebuilds that input).
The planner's validation (``planner.py``) measures the joint effect: real peak, and
leave-one-out utility.

Within the room (``room``: B less the resident bytes, docs/DESIGN.md's glossary): all-H holds
every unit's bundle, several times B, so bytes and codec times are measured on prefixes of
the microbatch that fit and scaled to its tokens (``scaled``). A unit's saved tensors grow
linearly with tokens when attention keeps no tokens x tokens matrix (SDPA, flash-attention),
except a packed microbatch's attention mask; ``bytes_linear_error`` says how far from a line
the probes are.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..grpo.microbatch import Microbatch
from .budget import RoomBelowAllR
from ..recovery.labels import P_LABELS, plan_for_label, row_share, without_share


def shape_class(mb: Microbatch, bucket: int = 256) -> str:
    """Microbatches whose row count and token count round to the same bucket share costs."""
    rows, tokens = mb.input_ids.shape
    return f"{rows}x{-(-tokens // bucket) * bucket}"


@dataclass
class UnitCosts:
    shape: str
    base_seconds: float  # all-R update time
    base_peak: int  # all-R measured peak bytes (M_base)
    dtau: Dict[str, Dict[str, float]] = field(default_factory=dict)  # unit -> {"H": s, "L": s}
    dm: Dict[str, Dict[str, int]] = field(default_factory=dict)  # unit -> {"H": bytes, "L": bytes}
    tokens: int = 0  # tokens of the microbatch these costs describe
    probe_tokens: List[int] = field(default_factory=list)  # where bytes and codec times were measured
    bytes_linear_error: float = 0.0  # worst relative residual of a straight line through the probes' bytes
    points: List[Dict] = field(default_factory=list)  # measured (tokens, all-R peak, dm) for costs_at
    options: List[str] = field(
        default_factory=list
    )  # the non-R options profiled (a unit may lack one that keeps nothing of it)
    partial_share: Dict[str, Dict[str, float]] = field(
        default_factory=dict
    )  # P label -> unit kind -> share of its replay it saves, on the whole microbatch


def profile_units(
    runner,
    mb: Microbatch,
    repeats: int,
    room: Optional[int] = None,
    levels: Sequence[str] = ("L",),
    partial: bool = False,
) -> UnitCosts:
    """Eq. 9's costs of every unit on ``mb``, for H and each L level in ``levels`` (action
    labels: ``"L"`` is the engine's codec, ``"L:bf16"`` another one). ``repeats``: timing
    repeats (``Planner.Config.profile_repeats``). ``room``: no profiling pass may peak above
    it: the all-R passes run on ``mb`` (they are the plan's floor), the all-H and all-L passes,
    which hold far more, on prefixes of ``mb`` that fit, and their bytes and codec times are
    scaled to ``mb``'s tokens (``probe_bytes``).
    ``partial``: also each P level (``P_LABELS``), whose utility is the unit's R replay time
    less its replay time with the kept op outputs (on the probes, scaled like codec times,
    then measured on ``mb`` itself: ``_partial_shares``). A P level that keeps nothing of a
    unit (``P:core`` of an MLP) is no option for it."""
    names = runner.engine.unit_names
    runner.run(mb, "all-r")  # warm-up
    rec: Dict[str, List[float]] = {n: [] for n in names}
    base: List[float] = []
    for _ in range(repeats):
        r = runner.run(mb, "all-r", profile=True)
        base.append(r.seconds)
        for n in names:
            rec[n].append(r.unit_seconds[n]["recompute"])
    peak = runner.run(mb, "all-r", measure_peak=True).peak_bytes
    if room is not None and peak > room:
        raise RoomBelowAllR(room, peak, shape_class(mb))
    probes = probe_bytes(runner, mb, repeats, room, levels, partial=partial)
    costs = UnitCosts(
        shape_class(mb),
        statistics.median(base),
        int(peak),
        tokens=mb.num_tokens,
        probe_tokens=sorted(probes),
        options=["H", *_kinds(levels, partial)],
    )
    est, costs.bytes_linear_error = scaled(probes, mb.num_tokens)
    for n in names:
        t = statistics.median(rec[n])
        costs.dtau[n] = dict({"H": t}, **{a: max(0.0, t - est[CODEC + a][n]) for a in levels})
        costs.dm[n] = option_bytes(est, n, _kinds(levels, partial))
        for a in (
            P_LABELS if partial else ()
        ):  # the probes' R and P replay times, both scaled: their difference is what P saves
            if est[a][n] <= 0:  # this level keeps nothing of the unit: no option
                del costs.dm[n][a]
                continue
            costs.dtau[n][a] = max(0.0, est[REPLAY + "R"][n] - est[REPLAY + a][n]) * (
                t / max(est[REPLAY + "R"][n], 1e-12)
            )
    if partial and mb.num_tokens not in probes:
        spare = (room - peak) / 2 if room is not None else float("inf")
        kinds = {n: u.kind for n, u in runner.engine.unit_specs.items()}
        for a in P_LABELS:
            share = _partial_shares(
                runner, mb, repeats, kinds, a, {n: costs.dm[n][a] for n in names if a in costs.dm[n]}, spare
            )
            costs.partial_share[a] = share
            for n in names:
                if kinds[n] in share and a in costs.dtau[n]:
                    costs.dtau[n][a] = share[kinds[n]] * statistics.median(rec[n])
    costs.points = [
        {
            "tokens": x,
            "base_peak": int(v["peak"]["all-r"]),
            "dm": {n: option_bytes(v, n, _kinds(levels, partial)) for n in names},
        }
        for x, v in sorted(probes.items())
    ]
    return costs


CODEC = "codec|"  # key prefix of an L level's encode + decode seconds in a probe
REPLAY = "replay|"  # key prefix of a unit's replay seconds under R or P in a probe


def _kinds(levels: Sequence[str], partial: bool) -> Sequence[str]:
    return (*levels, *P_LABELS) if partial else tuple(levels)


def option_bytes(values: Dict, unit: str, levels: Sequence[str]) -> Dict[str, int]:
    """Bytes per option; an attention unit kept H or L also keeps its MLP's input (``mixed``),
    a P unit does not: its layer still replays as a whole (``recovery/engine.py``, 4-5)."""
    extra = values["mixed"].get(unit, 0.0)
    return {a: int(values[a][unit] + (0.0 if a in P_LABELS else extra)) for a in ("H", *levels)}


def option_cost(costs: UnitCosts, unit: str, label: str) -> Tuple[float, float]:
    """(seconds saved, bytes) of ``unit`` taking ``label``. Token L (``"L@f"``) is not profiled
    apart: its kept rows cost what H's rows do and its other rows what that L level's do, so
    ``f x H + (1 - f) x L`` bytes (a unit's saved tensors are token rows); like L it avoids
    the unit's replay (its codec time shrinks with the compressed rows: ignored, a few percent)."""
    share = row_share(label)
    if share is None:
        return costs.dtau[unit][label], costs.dm[unit][label]
    level = without_share(label)
    return costs.dtau[unit][level], share * costs.dm[unit]["H"] + (1 - share) * costs.dm[unit][level]


def costs_at(costs: UnitCosts, tokens: int) -> UnitCosts:
    """``costs`` for a microbatch of ``tokens`` tokens (same rows, fewer columns), for plans
    sized to each microbatch: bytes from a polynomial through the measured points (as
    ``scaled``), the all-R base peak from a line through them and the whole microbatch's
    (kept as measured when that is the only point: a constant part makes scaling it down
    optimistic), recompute and codec times in proportion to tokens."""
    if tokens == costs.tokens:
        return costs
    pts = [p for p in costs.points if p["tokens"] != costs.tokens] + [
        {"tokens": costs.tokens, "base_peak": costs.base_peak, "dm": costs.dm}
    ]
    xs = [p["tokens"] for p in pts]
    f = tokens / costs.tokens
    out = UnitCosts(
        shape=f"{costs.shape}@{tokens}",
        base_seconds=costs.base_seconds * f,
        base_peak=int(_poly_at(xs, [p["base_peak"] for p in pts], 1, tokens)) if len(pts) > 1 else costs.base_peak,
        tokens=tokens,
        probe_tokens=list(costs.probe_tokens),
        bytes_linear_error=costs.bytes_linear_error,
        options=list(costs.options),
    )
    for n in costs.dm:
        out.dtau[n] = {a: v * f for a, v in costs.dtau[n].items()}
        out.dm[n] = {a: int(max(0.0, _poly_at(xs, [p["dm"][n][a] for p in pts], 2, tokens))) for a in costs.dm[n]}
    return out


def _bytes_at(
    runner, mb: Microbatch, repeats: int, levels: Sequence[str], partial: bool = False
) -> Dict[str, Dict[str, float]]:
    """Per unit on ``mb``: H and each L level's bytes as if held alone, each level's encode +
    decode seconds, and for an attention unit the MLP input that must then be kept; plus the
    all-R peak and the highest all-H / all-L peak. ``partial``: also P's bytes and the
    unit's replay seconds under R and under P (paired on the same prefix)."""
    names = runner.engine.unit_names
    r = runner.run(mb, "all-r", measure_peak=True)
    h = runner.run(mb, "all-h", measure_peak=True)
    out = {
        "H": {n: float(h.bytes_alone[n]["exact"]) for n in names},
        "mixed": {},
        "peak": {"all-h": float(h.peak_bytes), "all-r": float(r.peak_bytes)},
        "structure": dict(h.saved_counts),
    }
    for a in levels:
        plan = {n: plan_for_label(a) for n in names}
        l_run = runner.run(mb, plan, measure_peak=True)  # also the codec passes' warm-up
        codec: Dict[str, List[float]] = {n: [] for n in names}
        for _ in range(repeats):
            res = runner.run(mb, plan, profile=True)
            for n in names:
                codec[n].append(res.unit_seconds[n]["codec"])
        out[a] = {n: float(l_run.bytes_alone[n]["compressed"] + l_run.bytes_alone[n]["exact"]) for n in names}
        out[CODEC + a] = {n: statistics.median(codec[n]) for n in names}
        out["peak"]["all-h"] = max(out["peak"]["all-h"], float(l_run.peak_bytes))
    if partial:
        _partial_at(runner, mb, repeats, out)
    # keeping a layer's attention H or L while its MLP is R breaks the shared layer replay: the
    # MLP then needs its own input kept (one hidden-state tensor)
    mixed = {
        layer.units[0].name: layer.units[1].name
        for layer in runner.engine.layer_specs
        if len(layer.units) == 2 and layer.units[0].kind in ("attn", "mixer")
    }  # the MLP or expert block after it
    if mixed:
        held = runner.run(mb, {n: ("exact" if n in mixed else "checkpoint") for n in names}).bytes_by_unit
        out["mixed"] = {a: float(held[m]["checkpoint"]) for a, m in mixed.items()}
    return out


def _partial_at(runner, mb: Microbatch, repeats: int, out: Dict) -> None:
    """Each P level on ``mb``: each unit's kept op outputs (bytes as if held alone) and its
    replay seconds with them, interleaved with plain R replays of the same prefix."""
    names = runner.engine.unit_names
    plans = {"R": "all-r", **{a: {n: plan_for_label(a) for n in names} for a in P_LABELS}}
    for a in P_LABELS:
        p_run = runner.run(mb, plans[a], measure_peak=True)
        out[a] = {n: float(p_run.bytes_alone[n]["partial"]) for n in names}
        out["peak"]["all-h"] = max(out["peak"]["all-h"], float(p_run.peak_bytes))
    rec = {k: {n: [] for n in names} for k in plans}
    for _ in range(repeats):
        for k, plan in plans.items():  # R: per unit within the layer replay, as dtau["H"]
            res = runner.run(mb, plan, profile=True)
            for n in names:
                rec[k][n].append(res.unit_seconds[n]["recompute"])
    for k in plans:
        out[REPLAY + k] = {n: statistics.median(rec[k][n]) for n in names}


def probe_bytes(
    runner,
    mb: Microbatch,
    repeats: int,
    room: Optional[int],
    levels: Sequence[str] = ("L",),
    margin: float = 1.15,
    partial: bool = False,
):
    """``{tokens: _bytes_at(prefix)}``: ``mb`` itself when ``room`` is None, else up to three
    prefixes (a sixteenth of ``mb``, then halfway to, then at the longest prefix whose all-H
    peak, extrapolated from the probes so far by a polynomial of degree up to 2 (a packed
    microbatch's mask grows with tokens squared) times ``margin``, fits ``room``), ending at
    ``mb`` itself when it fits."""
    T = mb.input_ids.shape[1]
    rows = mb.input_ids.shape[0]
    if room is None:
        return {mb.num_tokens: _bytes_at(runner, mb, repeats, levels, partial)}
    t = min(T, max(64, T // 16))
    probes = {}
    for _ in range(6):
        part = mb.prefix(t) if t < T else mb
        probes[part.num_tokens] = last = _bytes_at(runner, part, repeats, levels, partial)
        if t == T:
            return {part.num_tokens: last}
        # only probes whose bundles have the same structure as the longest one describe it (a short
        # prefix may hold a single sequence, and then attention saves no mask at all)
        valid = {x: v for x, v in probes.items() if v["structure"] == last["structure"]}
        xs = sorted(valid)
        ys = [valid[x]["peak"]["all-h"] for x in xs]
        fits = [c for c in list(range(t + 64, T, 64)) + [T] if _poly_at(xs, ys, 2, c * rows) * margin <= room]
        nxt = max(fits, default=t)
        if nxt <= t or len(valid) == 3:
            return valid  # fewer than three: a line, or proportional to tokens
        t = nxt if len(valid) == 2 or nxt == T else max((c for c in fits if c <= max(t + 64, nxt // 2)), default=nxt)
    return valid


def scaled(probes: Dict[int, Dict], tokens: int):
    """The probes' per-unit values at ``tokens``: measured there, else extrapolated.
    Bytes: a polynomial in tokens through the probes, of degree 2 with three probes (a
    packed microbatch's attention mask, tokens x tokens, is saved with the attention unit
    beside its token-linear tensors; bytes are exact counts, so three probes fix it), 1
    with two, proportional with one. Codec seconds: linear (they are noisy; the codec's work
    is per element). Also the worst relative residual of a straight line through the bytes
    at three probes: how far from linear in tokens the units really are."""
    if tokens in probes:
        return probes[tokens], 0.0
    xs = sorted(probes)
    out: Dict[str, Dict[str, float]] = {}
    worst = 0.0
    for key in (k for k in probes[xs[-1]] if k not in ("peak", "structure")):
        timing = key.startswith((CODEC, REPLAY))
        out[key] = {}
        for n in probes[xs[-1]][key]:
            ys = [probes[x][key][n] for x in xs]
            out[key][n] = max(0.0, _poly_at(xs, ys, 1 if timing else 2, tokens))
            if not timing and len(xs) > 2:
                line = np.polyfit(xs, ys, 1)
                worst = max(worst, max(abs(np.polyval(line, x) - y) / max(y, 1.0) for x, y in zip(xs, ys)))
    return out, float(worst)


def _poly_at(xs: List[int], ys: List[float], degree: int, x: float) -> float:
    if len(xs) == 1:
        return ys[0] * x / xs[0]
    return float(np.polyval(np.polyfit(xs, ys, min(degree, len(xs) - 1)), x))


def _partial_shares(
    runner, mb: Microbatch, repeats: int, kinds: Dict[str, str], label: str, p_bytes: Dict[str, float], spare: float
) -> Dict[str, float]:
    """``{unit kind: share of the unit's R replay time that P level ``label`` saves}``, measured on ``mb``
    itself. Within B the probes are short (on SmolLM2 at 1.10 B_GC, all-H of 30 layers fits
    a few hundred tokens), where a replay's per-op overhead hides what P keeps: scaled from
    them, an attention unit's P saved 7-17 ms of a 139 ms replay, while on 2048 tokens it
    saves 135-154 ms of 160-181. So per kind, up to two units (first and middle) whose P
    bytes fit ``spare`` go P on ``mb`` with every other unit R, and their replay times are
    set against the same units' under R. Kinds with no unit that fits keep the probes' value;
    units missing from ``p_bytes`` (the level keeps nothing of them) are not measured."""
    shares: Dict[str, float] = {}
    for kind in dict.fromkeys(kinds.values()):
        members = [n for n in runner.engine.unit_names if kinds[n] == kind and n in p_bytes]
        if not members:
            continue
        picked, used = [], 0.0
        for n in dict.fromkeys([members[0], members[len(members) // 2]]):
            if used + p_bytes[n] <= spare:
                picked.append(n)
                used += p_bytes[n]
        if not picked:
            continue
        plan = {n: (plan_for_label(label) if n in picked else "checkpoint") for n in runner.engine.unit_names}
        runner.run(mb, plan)  # warm-up (and, under a watching runner, its peak)
        rec = {k: {n: [] for n in picked} for k in ("R", "P")}
        for _ in range(repeats):
            for k, method in (("R", "all-r"), ("P", plan)):
                res = runner.run(mb, method, profile=True)
                for n in picked:
                    rec[k][n].append(res.unit_seconds[n]["recompute"])
        r, q = (sum(statistics.median(rec[k][n]) for n in picked) for k in ("R", "P"))
        shares[kind] = max(0.0, r - q) / max(r, 1e-12)
    return shares
