"""Shared plumbing of the two-gloo-rank worker scripts (``*_ranks.py``): spawn two ranks on a free
port, gather what each rank saw into one JSON file written by rank 0, and, on the test's side, run
a script and read that file."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hilore_actor.runtime.distributed import free_port


def spawn_two(rank_main, *args) -> None:
    """``rank_main(rank, 2, port, *args)`` in two processes, ``port`` a free local one."""
    port = free_port()
    torch.set_num_threads(1)
    mp.spawn(rank_main, args=(2, port, *args), nprocs=2, join=True)


def rank_env(rank: int, world: int, port: int) -> None:
    """What torch.distributed and DeepSpeed read on one CPU rank of ``spawn_two``."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        DS_ACCELERATOR="cpu",
    )


def start_deepspeed_rank(rank: int, world: int, port: int, hang_seconds: float) -> None:
    """One DeepSpeed CPU rank of ``spawn_two``: its environment, one thread, gloo through DeepSpeed;
    a rank still running after ``hang_seconds`` prints where it hangs and exits."""
    import faulthandler

    from hilore_actor.runtime.distributed import init_deepspeed_distributed

    faulthandler.dump_traceback_later(hang_seconds, exit=True)
    rank_env(rank, world, port)
    torch.set_num_threads(1)
    init_deepspeed_distributed("cpu")


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


def run_ranks(script: str, *args, out, timeout: int, cwd=None, env=None) -> list:
    """Every rank's ``seen`` from ``tests/helpers/<script> *args``, which writes ``out`` through
    ``write_ranks``; the script's output in the assertion message when it failed. ``env``: set
    over this process's environment."""
    run = subprocess.run(
        [sys.executable, str(Path(__file__).resolve().parent / script), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**os.environ, **(env or {})},
    )
    assert run.returncode == 0 and Path(out).is_file(), run.stdout[-3000:] + run.stderr[-5000:]
    return json.loads(Path(out).read_text())["ranks"]
