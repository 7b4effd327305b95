"""A training run's folder as the report reads it: the steps' rows (``metrics.jsonl``), the action
each unit took on each microbatch (``actions.jsonl``) and the run's flags (the newest checkpoint's
``meta.json``), from the folder alone. A folder that is not a run is one ``NotARun`` message."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List

from ..train.run_dir import ACTIONS_FILE, METRICS_FILE


class NotARun(ValueError):
    """The folder holds no training run the report can read; the message says why."""


@dataclass
class Run:
    path: Path
    metrics: List[Dict]  # one row per step, in step order
    actions: List[Dict] = field(default_factory=list)  # one line per step (``metrics.step_actions``)
    flags: Dict = field(default_factory=dict)  # the run's flags; empty when its checkpoints are elsewhere

    @property
    def backend(self) -> str:
        """``--actor_backend``: from the flags, else from the name of ``--compare_gc``'s timing."""
        if self.flags.get("actor.backend"):
            return str(self.flags["actor.backend"])
        keys = [k for k in self.metrics[-1] if k.startswith("compare_") and k.endswith("_seconds")]
        timed = [k[len("compare_") : -len("_seconds")] for k in keys]  # gc and the backend (gc alone under gc)
        return next((k for k in timed if k != "gc"), "gc" if timed else "hilore")


def _jsonl(path: Path) -> List[Dict]:
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise NotARun(f"{path}, line {n}: not JSON") from None
        if not isinstance(row, dict) or "step" not in row:
            raise NotARun(f"{path}, line {n}: not a step's row (no 'step')")
        rows.append(row)
    return sorted(rows, key=lambda r: r["step"])


def _flags(folder: Path) -> Dict:
    """The flags the newest checkpoint under ``checkpoints/`` was saved with ({} without one)."""
    latest = folder / "checkpoints" / "latest"
    try:
        meta = json.loads((latest.parent / latest.read_text().strip() / "meta.json").read_text())
    except (OSError, ValueError):
        return {}
    return meta.get("config") or {}


def read(folder) -> Run:
    """The run in ``folder``; ``NotARun`` when it is no folder, has no step written yet, or its
    files are not the job's."""
    path = Path(folder)
    if not path.is_dir():
        raise NotARun(f"{path}: no such folder")
    metrics = path / METRICS_FILE
    if not metrics.is_file():
        raise NotARun(
            f"{path} is not a training run's folder: no {METRICS_FILE} (python -m hilore_actor.train_grpo writes "
            "one into its --save_path after every step)"
        )
    rows = _jsonl(metrics)
    if not rows:
        raise NotARun(f"{path}: {METRICS_FILE} holds no step yet")
    actions = _jsonl(path / ACTIONS_FILE) if (path / ACTIONS_FILE).is_file() else []
    return Run(path, rows, actions, _flags(path))


def peaks_by_step(run: Run) -> List[Dict]:
    """Each step's microbatches per rank, with their peak over B: ``actions.jsonl``'s lines, or
    for a run without one the budget coordinator's record in ``metrics.jsonl``."""
    if run.actions:
        return run.actions
    out = []
    for m in run.metrics:
        ranks = {
            r: [{"peak_over_budget": p, "skipped": False} for p in rec.get("peaks_over_budget", [])]
            for r, rec in (m.get("coordinator") or {}).items()
        }
        out.append({"step": m["step"], "units": [], "ranks": ranks})
    return out
