"""Starting process groups: DeepSpeed's without its CPU shared-memory kernel, and a rendezvous port.

On the CPU accelerator, ``deepspeed.init_distributed`` JIT-compiles ``deepspeed_shm_comm``
(30-50 s on 2 cores; again for every new build flag set) under a file lock in
``TORCH_EXTENSIONS_DIR`` (``~/.cache/torch_extensions``). Two things make that a hazard:

- the kernel serves only ``inference_all_reduce``; training's collectives (ZeRO's reduce and
  gather) go through gloo either way, so the compile buys a learner nothing;
- a process killed while it compiles (a timed-out test, a killed Ray actor) leaves the lock
  file behind, and every later ``init_distributed`` on that machine waits on it forever in
  ``torch.utils.file_baton.FileBaton.wait`` (a CI run has hung there).

DeepSpeed builds the kernel only when ``deepspeed.ops.__compatible_ops__`` marks it compatible
(``deepspeed/comm/torch.py: build_shm_op``), and that dict is probed once per process and kept
(``deepspeed/ops/__init__.py``), so marking it incompatible makes DeepSpeed take its own
"no kernel: plain gloo" path. CUDA (nccl) never builds it; this changes nothing there.

A rendezvous port is chosen before the ranks start and bound by rank 0 seconds later
(``free_port``). A port the kernel hands out for ``bind(0)`` comes from its ephemeral range,
which is also where every outgoing connection takes its source port: Ray's gRPC clients open
many while actors boot, and one took the port first (``EADDRINUSE`` at rank 0's bind, about one
job start in ten on a busy 2-core machine). The port is drawn below that range instead, above
Ray's worker ports (10002-19999), where only a listener can take it.
"""

from __future__ import annotations

import os
import random
import socket

SHM_OP = "deepspeed_shm_comm"


def skip_cpu_shm_kernel() -> None:
    """Mark DeepSpeed's CPU shared-memory all-reduce kernel unavailable in this process."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[SHM_OP] = False


def init_deepspeed_distributed(device_type: str) -> None:
    """``deepspeed.init_distributed`` for this process's device: nccl on CUDA; on CPU the CPU
    accelerator and gloo, without the shared-memory kernel (module docstring). The rendezvous
    comes from the environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK)."""
    if device_type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        skip_cpu_shm_kernel()
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl" if device_type == "cuda" else "gloo")


RAY_WORKER_PORTS_END = 19999  # Ray's default --max-worker-port


def ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (Linux's default 32768 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that binds now and that no outgoing connection will take before a rank
    binds it (module docstring); the kernel's own choice where no such port is free."""
    low, high = RAY_WORKER_PORTS_END + 1, ephemeral_start() - 1
    draw = random.SystemRandom()  # leaves the job's seeded random state alone
    for _ in range(64 if high > low else 0):
        port = draw.randint(low, high)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
