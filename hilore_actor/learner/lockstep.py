"""Planning on a sharded model: rank 0 plans, every other rank replays its passes in lockstep.

Under FSDP every forward and backward of the wrapped model is a sequence of collectives
(parameter all-gathers, gradient reduce-scatters), so every rank must run the same passes in
the same order. Planning (``plan.plan_before_wrapping``) runs a data-dependent number of
passes: its decisions follow measured times and peaks, which differ from rank to rank. So one
rank decides and the others follow:

- rank 0 plans with a ``Leader`` runner, which broadcasts each pass (its microbatch, method,
  fixed actions and options) before running it, and, for an online chooser, the actions it
  chose after the loss, at the point where the followers' passes ask for them;
- every other rank runs ``follow``: it replays each pass on its own shard (the same
  collectives) and decides nothing;
- rank 0 broadcasts its finished plan (``RankPlanner.state``), which every rank adopts
  (``plan.restore_rank_planner``): one budget, one plan, one calibration.

A pass that returns gradients gathers them whole (``Runner``: ``full_tensor`` of a DTensor),
a collective every rank joins, so rank 0's gradient errors cover every shard. Calibration
runs on rank 0's passes (not ``plan.shared_calibration``, whose gather only the planning
ranks would join). Messages travel by ``torch.distributed.broadcast_object_list``, tensors
on the CPU (a CUDA tensor would unpickle onto rank 0's device).

``agree_actions`` makes the ranks of a ZeRO-3 group take one action per unit on each
microbatch: an R replay there gathers the unit's weights (a collective), so a unit that one
rank recomputes and another keeps would deadlock both.

``agree_object`` and ``agree_max`` make one decision per process group, for the ranks of a
Ulysses sequence-parallel group (``verl/attach.py``), which must take the same action for every
unit on every microbatch.
"""

from __future__ import annotations

from typing import Dict

import torch

from ..allocation import Runner

DONE = "done"


def _send(obj) -> None:
    torch.distributed.broadcast_object_list([obj], src=0)


def _receive():
    box = [None]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


class Leader(Runner):
    """Rank 0's runner: each pass is broadcast before it runs (see the module docstring)."""

    def run(self, mb, method, actions=None, **options):
        chooser = actions if callable(actions) else None
        _send(("run", mb.to("cpu"), method, None if chooser else actions, chooser is not None, options))
        if chooser is None:
            return super().run(mb, method, actions, **options)

        def choose_and_send(step, out):
            chosen = chooser(step, out)
            _send(chosen)
            return chosen

        return super().run(mb, method, choose_and_send, **options)


def finish(state: Dict) -> None:
    """Rank 0, planning done: the followers leave ``follow`` with ``state``."""
    _send((DONE, state))


def follow(runner: Runner) -> Dict:
    """Replay rank 0's passes on ``runner`` until it sends its plan; return that plan's state."""
    while True:
        msg = _receive()
        if msg[0] == DONE:
            return msg[1]
        _, mb, method, actions, chooses, options = msg
        if chooses:
            actions = lambda step, out: _receive()  # noqa: E731  (rank 0's choice for this pass)
        runner.run(mb.to(runner.device), method, actions, **options)


# ---- one decision per process group (Ulysses sequence parallelism) ----------------------------
# The ranks of a sequence-parallel group run collectives inside a unit (verl's all-to-all in
# attention), so a unit recomputed on one rank and stored on another hangs the first in a
# collective the second never joins: per microbatch, the group must decide as one rank.


def agree_object(obj, group):
    """``obj`` as the group's first rank has it, on every rank of ``group``."""
    box = [obj]
    torch.distributed.broadcast_object_list(box, group=group, group_src=0)
    return box[0]


def agree_max(values, group, device) -> list:
    """Element-wise maximum over ``group`` of a list of integers (on ``device``: NCCL's tensors
    live on the GPU)."""
    t = torch.tensor([int(v) for v in values], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group)
    return [int(v) for v in t.tolist()]


def agree_actions(actions: Dict[str, str], group=None) -> Dict[str, str]:
    """Each unit's action where every rank of ``group`` chose the same, else R (allowed for
    every plan, and never above what a rank planned to hold)."""
    maps = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(maps, actions, group=group)
    return {n: a if all(m.get(n) == a for m in maps) else "R" for n, a in actions.items()}
