"""Per-step metrics: one JSON object per line in ``<save_path>/metrics.jsonl``, TensorBoard
scalars, and a one-line summary for the progress bar."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Dict, Optional


class MetricsLog:
    def __init__(self, save_path, tensorboard_dir: Optional[str] = None, resume_step: Optional[int] = None):
        self.path = Path(save_path) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.is_file():
            # keep the steps the checkpoint covers; drop later ones (they are recomputed)
            kept = [ln for ln in self.path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= resume_step]
            self.path.write_text("".join(ln + "\n" for ln in kept))
        elif self.path.exists():
            self.path.unlink()
        self.tb_dir = tensorboard_dir or str(Path(save_path) / "tensorboard")
        self._tb = None

    def _writer(self):
        if self._tb is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard not installed: JSONL only
                self._tb = False
            else:
                self._tb = SummaryWriter(self.tb_dir)
        return self._tb or None

    def log(self, step: int, metrics: Dict) -> None:
        rec = dict(step=step, **metrics)
        with self.path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())
        tb = self._writer()
        if tb is not None:
            for k, v in _scalars(metrics).items():
                tb.add_scalar(k, v, step)
            tb.flush()

    def close(self) -> None:
        if self._tb:
            self._tb.close()


def _scalars(d: Dict, prefix: str = "") -> Dict[str, float]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_scalars(v, f"{prefix}{k}/"))
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[prefix + k] = float(v)
    return out


def summary(m: Dict) -> str:
    parts = [f"reward {m['reward_mean']:.3f}", f"acc {m['accuracy']:.2f}", f"loss {m['loss']:+.4f}",
             f"update {m['update_seconds']:.1f}s", f"peak/B {m['peak_over_budget_max']:.3f}"]
    if "grad_rel_error" in m:
        parts.append(f"grad err {m['grad_rel_error']:.4f}")
    if "compare_speedup_vs_gc" in m:
        parts.append(f"x{m['compare_speedup_vs_gc']:.2f} vs gc")
    return ", ".join(parts)
