"""Calibrated risk of L (Eq. 10 and 11 of docs/DESIGN.md).

On C independent microbatches, for each L-eligible unit u: two passes that differ only in u's
recovery (u -> L against u -> R, every other unit R: within the budget, and all-R's gradient
is bitwise the exact one) give the reconstruction error ``e_ub``, the gradient
error ``y_ub = ||g_L - g_ex|| / (||g_ex|| + eps)`` and ``x_ub = E_ub * e_ub``. Per
state/layer group c (unit kind x depth third) the susceptibility is the least-squares slope
through the origin ``kappa_c = sum x y / sum x^2``. At training time the risk of L is
``psi_u = kappa_c(u) * E_u * e_bar_u``. Calibration is saved as JSON next to the run and
reused on restart.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from ..recovery.labels import plan_for_label, split_label
from .exposure import unit_exposure
from .runner import GradOp

EPS_NUM = 1e-12


def unit_group(name: str, n_layers: int, layer: int, kind: str) -> str:
    third = ("early", "middle", "late")[min(2, 3 * layer // max(1, n_layers))]
    return f"{kind}:{third}"


@dataclass
class Calibration:
    codec: str
    kappa: Dict[str, float]  # group -> susceptibility
    e_bar: Dict[str, float]  # unit -> mean reconstruction error
    exposure_mean: Dict[str, float]  # unit -> mean exposure over the calibration batches
    groups: Dict[str, str]  # unit -> group
    samples: List[dict] = field(default_factory=list)  # (unit, batch, E, e, y) records

    def risk(self, unit: str, exposure: float) -> float:
        """``psi_u = kappa_c(u) * E_u * e_bar_u``."""
        return self.kappa.get(self.groups[unit], 0.0) * exposure * self.e_bar[unit]

    def static_risk(self, unit: str) -> float:
        """Risk at the calibration-mean exposure (``hilore-static``)."""
        return self.risk(unit, self.exposure_mean[unit])

    def save(self, path) -> None:
        """Atomic write (temp file + rename): a crash never leaves a half-written file."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(self), f, indent=1)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path) -> "Calibration":
        try:
            return cls(**json.loads(Path(path).read_text()))
        except (json.JSONDecodeError, TypeError) as e:
            raise ValueError(f"{path}: not a hilore calibration file ({e})") from None


def save_levels(calibrations: Dict[str, "Calibration"], path) -> None:
    """One file for one or several L levels (one level: the single-calibration format)."""
    if set(calibrations) == {"L"}:
        calibrations["L"].save(path)
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    with os.fdopen(fd, "w") as f:
        json.dump({"levels": {a: asdict(c) for a, c in calibrations.items()}}, f, indent=1)
    os.replace(tmp, path)


def load_levels(path) -> Dict[str, "Calibration"]:
    """``{level: calibration}`` from ``save_levels`` (or a single calibration: level ``"L"``)."""
    try:
        d = json.loads(Path(path).read_text())
        if "levels" in d:
            return {a: Calibration(**v) for a, v in d["levels"].items()}
        return {"L": Calibration(**d)}
    except (json.JSONDecodeError, TypeError) as e:
        raise ValueError(f"{path}: not a hilore calibration file ({e})") from None


def check_levels(calibrations: Dict[str, "Calibration"], codecs: str, path="the calibration") -> None:
    """Refuse a saved calibration that does not describe ``codecs`` (a comma list: the engine's
    codec first, one more L level per further codec): the same levels, each calibrated with
    its own codec. Risks of one codec applied to another's copies would be silently wrong."""
    from ..recovery.labels import codec_levels, split_label

    default, levels = codec_levels(codecs)
    want = {a: split_label(a)[1] or default for a in levels}
    got = {a: c.codec for a, c in calibrations.items()}
    if got != want:
        raise ValueError(
            f"{path} calibrates {got} (L level: codec), the codecs asked for need {want}: "
            f"remove the file, or point the calibration path elsewhere, to calibrate again"
        )


def fit_kappa(samples: Sequence[dict]) -> Dict[str, float]:
    """Least squares through the origin per group: ``kappa = sum x y / sum x^2``."""
    sxy: Dict[str, float] = {}
    sxx: Dict[str, float] = {}
    for s in samples:
        x = s["exposure"] * s["recon"]
        sxy[s["group"]] = sxy.get(s["group"], 0.0) + x * s["grad_err"]
        sxx[s["group"]] = sxx.get(s["group"], 0.0) + x * x
    return {g: (sxy[g] / sxx[g] if sxx[g] > 0 else 0.0) for g in sxy}


INTERVENTION = {"track_error": True, "track_tokens": True}  # what a single-unit L pass measures (and its gradient)
REFERENCE = "calibration reference"  # the held exact gradient (``runner.HeldGradients``)


def calibration_prefix(runner, mb, level: str, room: int, margin: float = 1.15):
    """The longest prefix of ``mb`` (a multiple of 64 tokens, or ``mb`` itself) whose heaviest
    calibration pass fits the ``room`` (the in-microbatch peak allowed), found from up to four
    measured prefixes, each at most twice the last (a peak grows faster than its tokens: attention's
    scores), and a polynomial through their peaks (times ``margin``). The heaviest is
    the all-L pass or a single-unit intervention (``calibrate``: the others R, the unit's exact
    copy kept beside its L one to measure the error) on the earliest unit of a kind: its bundle
    is held through every later unit's recompute, which all-L never runs. Exposure is a sum of
    |omega| normalised by the microbatch's tokens, so it does not grow with the prefix; recon and
    gradient errors are relative."""
    from .profiling import _poly_at

    names = runner.engine.unit_names
    specs = runner.engine.unit_specs
    earliest = list({specs[n].kind: n for n in reversed(names)}.values())  # the first unit of each kind
    all_r = {n: "R" for n in names}
    plan = {n: plan_for_label(level) for n in names}
    T, rows = mb.input_ids.shape[1], mb.input_ids.shape[0]
    t, xs, ys, best = min(T, max(64, T // 8)), [], [], None
    for _ in range(4):
        part = mb.prefix(t) if t < T else mb
        peak = max(
            [runner.run(part, plan, measure_peak=True).peak_bytes]
            + [
                runner.run(part, dict(all_r, **{u: level}), **INTERVENTION, measure_peak=True).peak_bytes
                for u in earliest
            ]
        )
        if peak > room:
            break
        best = part
        if t == T:
            return mb
        xs.append(part.num_tokens)
        ys.append(peak)
        larger = list(range(t + 64, min(T, 2 * t + 1), 64)) + ([T] if T <= 2 * t else [])  # T once, at most 2t
        fits = [c for c in larger if _poly_at(xs, ys, 2, c * rows) * margin <= room]
        if not fits:
            break
        t = max(fits)
    if best is None:
        raise ValueError(
            f"even a {min(T, max(64, T // 8))}-token prefix of a calibration microbatch holds more than "
            f"{room} B under L: give a larger budget or use hilore-hr"
        )
    return best


def calibrate(
    runner, batches, units: Optional[Sequence[str]] = None, progress=None, level: str = "L", room: Optional[int] = None
) -> Calibration:
    """Single-unit L interventions on ``batches`` (see module docstring). ``runner`` is an
    ``allocation.runner.Runner``; ``progress`` an optional callable(done, total); ``level``
    the L action label (``"L"``: the engine's codec; ``"L:bf16"``: that codec); ``room``: no
    pass may peak above it (each batch is cut to ``calibration_prefix``)."""
    engine = runner.engine
    codec = split_label(level)[1] or engine.codec.name
    if room is not None:
        batches = [calibration_prefix(runner, mb, level, room) for mb in batches]
    names = list(units or engine.unit_names)
    specs = engine.unit_specs
    n_layers = len(engine.layer_specs)
    groups = {n: unit_group(n, n_layers, specs[n].layer, specs[n].kind) for n in engine.unit_names}
    samples, done, total = [], 0, len(batches) * (len(names) + 1)
    all_r = {n: "R" for n in engine.unit_names}
    for b, mb in enumerate(batches):
        # the exact gradient stays held (one set) while each intervention's is compared with it
        # parameter by parameter as backward produces it (``runner.GradOp``; docs/planning.md)
        ref = runner.run(mb, "all-r", grad_op=GradOp(add=REFERENCE, restart=True) if names else None, seed=b)
        done += 1
        for k, name in enumerate(names):
            last = k == len(names) - 1
            op = GradOp(compare=REFERENCE, drop=(REFERENCE,) if last else ())
            res = runner.run(mb, dict(all_r, **{name: level}), **INTERVENTION, grad_op=op, seed=b)
            e = res.reconstruction.get(name, 0.0)
            diff, _, _, ref_sq = res.grad_sums
            y = diff**0.5 / (ref_sq**0.5 + EPS_NUM)
            E = unit_exposure(ref.omega, res.token_norms[name], ref.mask)
            E_adv = unit_exposure(mb.advantages, res.token_norms[name], ref.mask)  # advantage-only proxy
            samples.append(
                {
                    "unit": name,
                    "batch": b,
                    "group": groups[name],
                    "exposure": E,
                    "adv_exposure": E_adv,
                    "recon": e,
                    "grad_err": y,
                }
            )
            done += 1
            if progress:
                progress(done, total)
    return from_samples(codec, groups, samples)


def calibrate_levels(
    runner, batches, levels: Sequence[str], progress=None, room: Optional[int] = None
) -> Dict[str, Calibration]:
    """``{level: calibration}`` for several L levels (every enabled codec's single-unit error)."""
    return {a: calibrate(runner, batches, progress=progress, level=a, room=room) for a in levels}


def from_samples(codec: str, groups: Dict[str, str], samples: List[dict]) -> Calibration:
    """Eq. 10 on intervention samples: kappa per group, e_bar and mean exposure per unit."""
    by_unit: Dict[str, List[dict]] = {}
    for smp in samples:
        by_unit.setdefault(smp["unit"], []).append(smp)
    return Calibration(
        codec=codec,
        kappa=fit_kappa(samples),
        e_bar={n: statistics.fmean(s["recon"] for s in v) for n, v in by_unit.items()},
        exposure_mean={n: statistics.fmean(s["exposure"] for s in v) for n, v in by_unit.items()},
        groups=groups,
        samples=samples,
    )


def merge(parts: Sequence[Calibration]) -> Calibration:
    """One calibration from several ranks' shares of the interventions (each rank ran them
    on its own microbatches): the samples pooled, then Eq. 10 once over all of them."""
    if not parts:
        raise ValueError("nothing to merge")
    codecs = {c.codec for c in parts}
    if len(codecs) != 1:
        raise ValueError(f"calibrations of different codecs cannot be merged: {sorted(codecs)}")
    batches, samples = 0, []
    for c in parts:  # renumber batches so that every rank's microbatches stay distinct
        samples += [dict(smp, batch=smp["batch"] + batches) for smp in c.samples]
        batches += 1 + max((smp["batch"] for smp in c.samples), default=-1)
    return from_samples(parts[0].codec, parts[0].groups, samples)
