"""runtime/distributed.py: a rendezvous port outside the ephemeral range; a learner's process group
on CPU starts without compiling DeepSpeed's shared-memory kernel, so a lock file left by a killed
compile cannot block it."""

import os
import subprocess
import sys
import textwrap

from hilore_actor.runtime.distributed import free_port

SCRIPT = textwrap.dedent("""
    import torch.distributed as dist
    from deepspeed import comm
    from hilore_actor.runtime.distributed import init_deepspeed_distributed
    init_deepspeed_distributed("cpu")
    print("backend", dist.get_backend(), "world", dist.get_world_size(), "shm", comm.comm.cdb.shm_comm_op)
    dist.destroy_process_group()
""")


def test_cpu_init_ignores_a_stale_shm_build_lock(tmp_path):
    """The stale lock is what a compile killed mid-way leaves: before the fix, init waited on it
    forever. Now init returns (in seconds), on gloo, with no shared-memory kernel loaded."""
    tag = f"py{sys.version_info.major}{sys.version_info.minor}_cpu"
    build = tmp_path / tag / "deepspeed_shm_comm"
    build.mkdir(parents=True)
    (build / "lock").write_text("")
    env = dict(
        os.environ,
        TORCH_EXTENSIONS_DIR=str(tmp_path),
        DS_ACCELERATOR="cpu",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
    )
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "backend gloo world 1 shm None" in out.stdout, out.stdout[-2000:]
    assert sorted(p.name for p in build.iterdir()) == ["lock"]  # nothing was compiled there


def test_a_free_port_lies_below_the_ephemeral_range_and_leaves_the_seeded_random_state():
    """Outgoing connections take their source ports from the ephemeral range, so a rendezvous port
    drawn there can be gone before rank 0 binds it; the draw must not move a seeded job's random state."""
    import random
    import socket

    from hilore_actor.runtime.distributed import RAY_WORKER_PORTS_END, ephemeral_start

    random.seed(3)
    want = random.random()
    random.seed(3)
    ports = {free_port() for _ in range(8)}
    assert random.random() == want
    assert all(RAY_WORKER_PORTS_END < p < ephemeral_start() for p in ports) and len(ports) > 1, ports
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))
