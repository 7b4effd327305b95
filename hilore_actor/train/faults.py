"""Faults a long run meets: what the job does about them, and how tests inject them.

``HILORE_FAULT`` (passed to every Ray worker) injects faults, ``KIND:ARGS`` (several joined by
commas):

- ``learner:<rank>:<step>``: that learner rank dies (a hard exit) as it starts the update of
  step index ``<step>``; the driver reports it and names the checkpoint to ``--resume`` from;
- ``rollout:<worker>:<step>``: that rollout worker dies in that step's ``generate`` (once: the
  copy Ray restarts does not); the job redoes the step's rollouts (``Job.generate``);
- ``sigterm:<step>``: the driver receives SIGTERM (a preempted node) while step index
  ``<step>`` runs; the job finishes that step, checkpoints it and exits 0 (``StopRequest``);
- ``coordinator:<step>``: the budget coordinator dies at the first report of that step; Ray
  restarts it, it reloads its state from the last checkpoint, ranks re-register with their
  next report (``learner/coordinator.py``);
- ``oom:<rank>:<step>``: that rank's first microbatch of that step runs out of memory after
  its forward (``torch.OutOfMemoryError``, as CUDA raises it); the rank frees it, gives up half
  of what its plan stores at that size, tells the coordinator, reruns the microbatch all-R
  with the same random state and goes on (``Learner._forward_backward``);
- ``nonfinite:<rank>:<step>``: that rank's first microbatch of each update in that step has a
  NaN loss. DeepSpeed's ZeRO optimizer then skips the update on every rank (the all-reduced
  gradient norm is not finite); the job counts it (``skipped_updates``) and goes on, and stops
  after ``--train.max_skipped_updates`` in a row (``SkipCounter``).

- ``unshared:<rank>``: that rank's node cannot see the checkpoint folder; the job stops before
  any learner starts (``placement.check_shared``, on a Ray cluster: the job's own one-node
  instance runs no probe).

``*`` stands for any rank or step (``learner/fault_injection.py`` reads the variable).

A damaged checkpoint is handled by ``checkpoint.CheckpointDir.resumable``.
"""

from __future__ import annotations

import os
import signal
from typing import Optional

from ..learner.fault_injection import injected


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
        print(
            f"\n[train] {signal.Signals(signum).name} received: stopping after this step, with a checkpoint", flush=True
        )

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def inject(self, step: int) -> None:
        """``HILORE_FAULT=sigterm:<step>``: the driver signals itself, as a preemption would."""
        if injected("sigterm", step):
            os.kill(os.getpid(), signal.SIGTERM)


class TooManySkipped(RuntimeError):
    """Updates skipped for non-finite gradients, too many in a row: the run is diverging."""


class SkipCounter:
    """Updates skipped in a row; ``TooManySkipped`` at ``limit`` (0: never). ``in_a_row``: the count
    a resumed run starts from (the checkpoint's ``skipped_in_a_row``), so a streak spans the resume."""

    def __init__(self, limit: int, in_a_row: int = 0):
        self.limit, self.in_a_row = int(limit), int(in_a_row)

    def update(self, skipped: bool, step: int) -> None:
        self.in_a_row = self.in_a_row + 1 if skipped else 0
        if skipped:
            print(
                f"[train] step {step}: an update had a non-finite gradient and was skipped on every rank "
                f"({self.in_a_row} in a row)",
                flush=True,
            )
        if self.limit and self.in_a_row >= self.limit:
            raise TooManySkipped(
                f"{self.in_a_row} updates in a row had a non-finite gradient (the last in step {step}), "
                "so the run stopped: lower the learning rate or check the data and rewards of those "
                "steps (--train.max_skipped_updates sets the limit)"
            )
