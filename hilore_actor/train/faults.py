"""Faults a long run meets: what the job does about them, and how tests inject them.

``HILORE_FAULT`` (passed to every Ray worker) injects one fault, ``KIND:ARGS``:

- ``learner:<rank>:<step>``: that learner rank dies (a hard exit) as it starts the update of
  step index ``<step>``; the driver reports it and names the checkpoint to ``--resume`` from;
- ``sigterm:<step>``: the driver receives SIGTERM (a preempted node) while step index
  ``<step>`` runs; the job finishes that step, checkpoints it and exits 0 (``StopRequest``).

A damaged checkpoint is handled by ``checkpoint.CheckpointDir.resumable``.
"""
from __future__ import annotations

import os
import signal
from typing import Optional


def injected(kind: str, *args) -> bool:
    """Whether ``HILORE_FAULT`` asks for fault ``kind`` at ``args`` (e.g. a rank and a step)."""
    return os.environ.get("HILORE_FAULT", "") == ":".join([kind, *map(str, args)])


class StopRequest:
    """SIGTERM (a preemption notice; Kubernetes and Slurm send it before killing) or SIGINT,
    turned into a request to stop at the next step boundary: the driver checkpoints the step it
    finished and exits 0 with a message saying how to resume. A second signal stops at once."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signal: Optional[int] = None
        self._previous = {}

    def __enter__(self) -> "StopRequest":
        for s in self.SIGNALS:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)

    def _handle(self, signum, frame) -> None:
        if self.signal is not None:  # asked twice: do not wait for the step
            raise KeyboardInterrupt(f"signal {signum} received twice")
        self.signal = signum
        print(f"\n[train] {signal.Signals(signum).name} received: stopping after this step, with a checkpoint",
              flush=True)

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def inject(self, step: int) -> None:
        """``HILORE_FAULT=sigterm:<step>``: the driver signals itself, as a preemption would."""
        if injected("sigterm", step):
            os.kill(os.getpid(), signal.SIGTERM)
