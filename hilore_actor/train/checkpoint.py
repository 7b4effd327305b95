"""Atomic checkpoints of the training job.

Layout under ``--ckpt.path``: ``step_<N>/`` (DeepSpeed's ``ds/`` with model, optimizer and
scheduler states; per rank ``rng_rank<r>.pt`` and ``hilore_rank<r>.json`` with budget, plan
and calibration; the driver's ``meta.json``) and ``latest`` naming the newest complete one.
Every rank writes into ``.step_<N>.tmp``; only when all have returned does the driver write
``meta.json`` and rename the folder, then replace ``latest`` (temp file + ``os.replace``). A
crash at any point leaves the previous checkpoint and ``latest`` untouched.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Dict, Optional


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

    def commit(self, staging: Path, step: int, meta: Dict, keep: int = 2) -> Path:
        (staging / "meta.json").write_text(json.dumps(dict(meta, step=step), indent=1))
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
