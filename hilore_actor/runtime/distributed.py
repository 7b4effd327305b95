"""DeepSpeed's process group, started without DeepSpeed's CPU shared-memory kernel.

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
"""

from __future__ import annotations

import os

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
