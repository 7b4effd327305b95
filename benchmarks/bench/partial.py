"""A run's ``--json`` file, rewritten after every finished piece of work, so that a run stopped
midway (``timeout``'s SIGTERM, a crash, a SIGKILL) leaves what it finished.

Until the run ends the file holds ``"partial": {"stage": ..., "done": [...]}``, the header
once B is measured, each prepared method's plan (``prepared``: HiLoRe's plan and its
validation), each finished timing repeat's raw times (``phases``) and each measured method's
record (``records``). The finished run's file has no ``partial`` key. Every write goes to a
temporary file that then replaces the result, so a kill never leaves half a JSON file. On
SIGTERM (``stop_on_sigterm``) the run stops where it is, writes why and exits with status
143.
"""

from __future__ import annotations

import json
import os
import signal
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, List, Optional


class Stopped(BaseException):
    """Raised in the main thread by SIGTERM (a BaseException: no ``except Exception`` of the
    run takes it for a result)."""


@contextmanager
def stop_on_sigterm():
    """SIGTERM raises ``Stopped`` inside the block; the previous handler comes back after."""

    def handler(signum, frame):
        raise Stopped(f"signal {signal.Signals(signum).name}")

    try:
        old = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave the signal alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def strict_json(v):
    """NaN / inf (e.g. a peer whose gradients overflow) become null: strict JSON."""
    if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))):
        return None
    if isinstance(v, dict):
        return {k: strict_json(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [strict_json(x) for x in v]
    return v


def write_atomic(path, doc: Dict) -> None:
    """``doc`` as strict JSON (NaN and inf as null), through a temporary file beside ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(strict_json(doc), indent=1, allow_nan=False))
    os.replace(tmp, path)


class Progress:
    """The partial result of one run; ``path`` None: nothing is written."""

    def __init__(self, path: Optional[str], command: str, workload: str):
        self.path = path
        self.doc: Dict = {
            "partial": {"stage": "starting", "done": [], "stopped": None},
            "command": command,
            "workload": {"name": workload},
            "prepared": [],
            "phases": [],
            "records": [],
        }
        self.write()

    def write(self) -> None:
        if self.path:
            write_atomic(self.path, self.doc)

    def stage(self, stage: str, done: Optional[str] = None, **fields) -> None:
        """Now at ``stage``; ``done``: what just finished; ``fields``: top-level keys to set."""
        part = self.doc["partial"]
        if done:
            part["done"].append(done)
        part["stage"] = stage
        self.doc.update(fields)
        self.write()

    def prepared(self, entry: Dict) -> None:
        self.doc["prepared"].append(entry)
        self.stage(self.doc["partial"]["stage"], done=f"prepared {entry['method']}")

    def phase_times(self, label: str, times: Dict[str, List[float]], repeat: int, repeats: int) -> None:
        """The raw times of the phase being timed, after each of its repeats."""
        phases: List[Dict] = self.doc["phases"]
        if phases and phases[-1]["label"] == label and not phases[-1].get("complete", True):
            phases.pop()
        phases.append({"label": label, "times": times, "complete": repeat == repeats})
        self.stage(f"timing: {label}", done=f"{label}: repeat {repeat}/{repeats}")

    def record(self, rec: Dict) -> None:
        self.doc["records"].append(rec)
        self.stage("measuring peaks and gradients", done=f"measured {rec['method']}")

    def stopped(self, why: str) -> None:
        self.doc["partial"]["stopped"] = why
        self.write()

    def finished(self) -> None:
        """The whole result is written: nothing here may overwrite it any more."""
        self.path = None
