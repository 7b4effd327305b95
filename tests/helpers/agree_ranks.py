"""Two gloo ranks with different action maps agree on one (``lockstep.agree_actions``);
``python tests/helpers/agree_ranks.py OUT.json`` (rank 0 writes what both ranks got)."""

import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from gloo_ranks import spawn_two, write_ranks  # noqa: E402

OWN = [{"a": "H", "b": "R", "c": "L", "d": "P"}, {"a": "H", "b": "H", "c": "L:bf16", "d": "P"}]


def rank_main(rank, world, port, out):
    from hilore_actor.learner.lockstep import agree_actions

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    write_ranks({"agreed": agree_actions(OWN[rank])}, out, world)


if __name__ == "__main__":
    spawn_two(rank_main, sys.argv[1])
