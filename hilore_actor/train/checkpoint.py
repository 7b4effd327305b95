"""Atomic checkpoints of the training job, and their format.

Layout under ``--ckpt.path``: ``step_<N>/`` (DeepSpeed's ``ds/`` with model, optimizer and
scheduler states; per rank ``rng_rank<r>.pt`` and ``hilore_rank<r>.json`` with budget, plan,
calibration and what the rank keeps across steps (``warmed_up``, the online chooser's ``online``
state); the coordinator's ``coordinator.json``; the driver's ``meta.json``, with its own
across-step state: ``skipped_in_a_row``) and
``latest`` naming the newest complete one. Every rank writes into ``.step_<N>.tmp``; only when
all have returned does the driver write ``meta.json`` and rename the folder, then replace
``latest`` (temp file + ``os.replace``). A crash at any point leaves the previous checkpoint and
``latest`` untouched.

``meta.json`` also keeps the run's flags (``config``: ``resume.py`` refuses or re-plans what a
``--resume`` changes) and lists every file's size and SHA-256 (``files``). ``resumable`` checks them
(a disk that filled up, a copy cut short, a flipped bit) and falls back to the newest older
checkpoint that checks out, saying which one it skipped and why: a damaged checkpoint is never
loaded.

Every JSON file of a checkpoint carries ``format_version`` (``FORMAT_VERSION``; a file without
one is version 1). Readers take the files through ``read_state``, which brings any older layout
to the current one in one place (``migrate``), so the code that resumes knows one layout.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

CHUNK = 1 << 20
FORMAT_VERSION = 3  # the layout this code writes (see ``migrate``)
META = "meta.json"
WORLD = "world_size"  # in ``config``, beside the flags: --actor.num_nodes x --actor.num_gpus_per_node


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def manifest(folder: Path) -> Dict[str, Dict]:
    """``relative path -> {"bytes", "sha256"}`` of every file under ``folder`` but meta.json."""
    folder = Path(folder)
    return {
        str(f.relative_to(folder)): {"bytes": f.stat().st_size, "sha256": file_digest(f)}
        for f in sorted(folder.rglob("*"))
        if f.is_file() and f.name != META
    }


def damage(folder: Path) -> Optional[str]:
    """What is wrong with a committed checkpoint (None: every listed file is there, whole)."""
    folder = Path(folder)
    try:
        meta = migrate({"meta": json.loads((folder / META).read_text())})["meta"]
    except (OSError, ValueError) as e:
        return f"meta.json unreadable ({e})"
    for rel, want in meta["files"].items():
        f = folder / rel
        if not f.is_file():
            return f"{rel} is missing"
        if f.stat().st_size != want["bytes"]:
            return f"{rel} has {f.stat().st_size} bytes, {want['bytes']} were written"
        if file_digest(f) != want["sha256"]:
            return f"{rel} does not match its checksum"
    return None


class CheckpointDir:
    def __init__(self, root):
        self.root = Path(root)

    def latest(self) -> Optional[Path]:
        f = self.root / "latest"
        if not f.is_file():
            return None
        p = self.root / f.read_text().strip()
        return p if (p / META).is_file() else None

    @staticmethod
    def meta(path: Path) -> Dict:
        """``meta.json`` in the current layout."""
        return read_state(path)["meta"]

    def staging(self, step: int) -> Path:
        p = self.root / f".step_{step}.tmp"
        if p.exists():
            shutil.rmtree(p)  # left by a crash mid-save
        p.mkdir(parents=True)
        return p

    def complete(self) -> List[Path]:
        """Committed checkpoints, newest first."""
        done = [p for p in self.root.glob("step_*") if p.name[5:].isdigit() and (p / META).is_file()]
        return sorted(done, key=lambda p: int(p.name[5:]), reverse=True)

    def resumable(self, log: Callable[[str], None] = print) -> Tuple[Optional[Path], List[Tuple[Path, str]]]:
        """(the newest checkpoint whose files match their checksums, the newer ones skipped with
        why). ``latest`` first; if it is damaged, older ones, newest first."""
        first = self.latest()
        candidates = ([first] if first is not None else []) + [p for p in self.complete() if p != first]
        skipped = []
        for p in candidates:
            why = damage(p)
            if why is None:
                for bad, reason in skipped:
                    log(f"[train] checkpoint {bad} is damaged ({reason}); resuming from {p} instead")
                return p, skipped
            skipped.append((p, why))
        for bad, reason in skipped:
            log(f"[train] checkpoint {bad} is damaged ({reason})")
        return None, skipped

    def commit(self, staging: Path, step: int, meta: Dict, keep: int = 2) -> Path:
        files = manifest(staging)
        (staging / META).write_text(json.dumps(versioned(dict(meta, step=step, files=files)), indent=1))
        final = self.root / f"step_{step}"
        if final.exists():  # an older run's checkpoint of the same step: replace it
            old = self.root / f".step_{step}.old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(staging, final)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".latest.")
        with os.fdopen(fd, "w") as f:
            f.write(final.name)
        os.replace(tmp, self.root / "latest")
        done = sorted((p for p in self.root.glob("step_*") if p.name[5:].isdigit()), key=lambda p: int(p.name[5:]))
        for p in done[:-keep] if keep > 0 else []:
            shutil.rmtree(p, ignore_errors=True)
        return final


def rank_file(folder, rank: int) -> Path:
    """A learner rank's budget, plan and calibration in checkpoint ``folder``."""
    return Path(folder) / f"hilore_rank{rank}.json"


def versioned(d: Dict) -> Dict:
    """``d`` as a checkpoint file of this layout (``format_version`` added)."""
    return dict(d, format_version=FORMAT_VERSION)


def read_state(folder) -> Dict:
    """The JSON state of checkpoint ``folder`` in the current layout: ``{"meta": meta.json,
    "ranks": [hilore_rank<r>.json for r = 0, 1, ...]}`` through ``migrate``."""
    folder = Path(folder)
    ranks = []
    while rank_file(folder, len(ranks)).is_file():
        ranks.append(json.loads(rank_file(folder, len(ranks)).read_text()))
    return migrate({"meta": json.loads((folder / META).read_text()), "ranks": ranks})


def migrate(state: Dict) -> Dict:
    """A checkpoint's JSON state (``read_state``'s dict; ``ranks`` may be left out) in any layout
    the job has written, brought to the current one (``FORMAT_VERSION``); ``state`` itself is left
    as it is. Each file is upgraded from its own ``format_version`` (none: 1); a later layout adds
    its step here, and no reader changes.

    1 -> 2: a rank keeps its L calibrations once, as ``calibrations`` (``{level: calibration}``);
    version 1 also kept one of them as ``calibration``. Version 1 files may lack what the job has
    kept since, and get: a rank's budget as given (B in bytes, which resolves to itself) and its
    scope (such plans counted activations only), resident bytes (0), fill (the flag's default),
    planning peak and its phase (None: not measured), ``calibrations`` (its one ``calibration`` as
    level L); the driver's file list (empty: nothing to check, the checkpoint is taken as it is)
    and flags. Without flags, ``config`` holds what the files tell (the world size, one plan file
    per rank; the budget settings in rank 0's plan) and ``partial_config`` is true, so that
    ``resume.check`` says the rest is not checked.

    2 -> 3: the state kept across steps. A rank gets ``warmed_up`` true (every checkpoint is
    written after an update, which is the warm-up) and ``online`` None (a fresh online chooser);
    the driver's ``skipped_in_a_row`` is 0 (version 2 did not keep it: the count starts again)."""
    state = copy.deepcopy(state)
    meta, ranks = state["meta"], state.get("ranks") or []
    if meta.get("format_version", 1) == 1:
        if not meta.get("config"):
            meta.update(config=_flags_in_plans(ranks), partial_config=True)
        meta.setdefault("files", {})
        meta["format_version"] = 2
    if meta["format_version"] == 2:
        meta.setdefault("skipped_in_a_row", 0)
        meta["format_version"] = 3
    for rank in ranks:
        if rank.get("format_version", 1) == 1:
            _rank_1_to_2(rank)
        if rank["format_version"] == 2:
            rank.setdefault("warmed_up", True)
            rank.setdefault("online", None)
            rank["format_version"] = 3
    return state


# config key -> the field of a rank's plan info that keeps it
PLAN_FLAGS = (
    ("hilore.budget", "budget_spec"),
    ("hilore.budget_scope", "budget_scope"),
    ("hilore.plan_tokens", "plan_tokens"),
    ("hilore.fill", "fill"),
)


def _flags_in_plans(ranks: List[Dict]) -> Dict:
    """What version 1 plan files tell of the run's flags: the world size and rank 0's budget settings."""
    info = ranks[0].get("info", {}) if ranks else {}
    return dict({WORLD: len(ranks)} if ranks else {}, **{k: info[f] for k, f in PLAN_FLAGS if f in info})


def _rank_1_to_2(rank: Dict) -> None:
    from .config import DEFAULTS

    info = rank["info"]
    for key, value in (
        ("budget_spec", str(rank["budget"])),
        ("budget_scope", "activations"),
        ("resident_bytes", 0),
        ("fill", float(DEFAULTS["hilore.fill"])),
        ("plan_peak_over_budget", None),
        ("plan_peak_phase", None),
    ):
        info.setdefault(key, value)
    single = rank.pop("calibration", None)
    if "plan" in rank and "calibrations" not in rank:
        rank["calibrations"] = {"L": single} if single else {}
    rank["format_version"] = 2
