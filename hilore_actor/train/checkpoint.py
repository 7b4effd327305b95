"""Atomic checkpoints of the training job.

Layout under ``--ckpt.path``: ``step_<N>/`` (DeepSpeed's ``ds/`` with model, optimizer and
scheduler states; per rank ``rng_rank<r>.pt`` and ``hilore_rank<r>.json`` with budget, plan
and calibration; the driver's ``meta.json``) and ``latest`` naming the newest complete one.
Every rank writes into ``.step_<N>.tmp``; only when all have returned does the driver write
``meta.json`` and rename the folder, then replace ``latest`` (temp file + ``os.replace``). A
crash at any point leaves the previous checkpoint and ``latest`` untouched.

``meta.json`` also keeps the run's flags (``config``: ``resume.py`` refuses or re-plans what a
``--resume`` changes) and lists every file's size and SHA-256 (``files``). ``resumable`` checks them
(a disk that filled up, a copy cut short, a flipped bit) and falls back to the newest older
checkpoint that checks out, saying which one it skipped and why: a damaged checkpoint is never
loaded. Checkpoints from before checksums (no ``files``) are taken as they are.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

CHUNK = 1 << 20


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
        if f.is_file() and f.name != "meta.json"
    }


def damage(folder: Path) -> Optional[str]:
    """What is wrong with a committed checkpoint (None: every listed file is there, whole)."""
    folder = Path(folder)
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError) as e:
        return f"meta.json unreadable ({e})"
    for rel, want in (meta.get("files") or {}).items():
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
        return p if (p / "meta.json").is_file() else None

    @staticmethod
    def meta(path: Path) -> Dict:
        return json.loads((Path(path) / "meta.json").read_text())

    def staging(self, step: int) -> Path:
        p = self.root / f".step_{step}.tmp"
        if p.exists():
            shutil.rmtree(p)  # left by a crash mid-save
        p.mkdir(parents=True)
        return p

    def complete(self) -> List[Path]:
        """Committed checkpoints, newest first."""
        done = [p for p in self.root.glob("step_*") if p.name[5:].isdigit() and (p / "meta.json").is_file()]
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
        (staging / "meta.json").write_text(json.dumps(dict(meta, step=step, files=files), indent=1))
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
