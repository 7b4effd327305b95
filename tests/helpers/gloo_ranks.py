"""Shared plumbing of the two-gloo-rank worker scripts (``*_ranks.py``): spawn two ranks on a free
port, and gather what each rank saw into one JSON file written by rank 0."""

import json

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hilore_actor.runtime.distributed import free_port


def spawn_two(rank_main, *args) -> None:
    """``rank_main(rank, 2, port, *args)`` in two processes, ``port`` a free local one."""
    port = free_port()
    torch.set_num_threads(1)
    mp.spawn(rank_main, args=(2, port, *args), nprocs=2, join=True)


def write_ranks(seen: dict, out: str, world: int, **extra) -> None:
    """Every rank's ``seen`` into ``out`` (``{"ranks": [...], **extra}``, by rank 0), then an
    orderly shutdown of the process group."""
    parts = [None] * world
    dist.all_gather_object(parts, seen)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"ranks": parts, **extra}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
