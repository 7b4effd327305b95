"""Two CPU ranks of a helper script under ``torchrun`` (gloo), for the rank-level tests: the
JSON each script prints after ``RESULT `` on rank 0's stdout."""

import json
import os
import subprocess
import sys
from pathlib import Path

from hilore_actor.runtime.distributed import free_port

HELPERS = Path(__file__).resolve().parent


def torchrun(script: str, *args: str, cwd, timeout: int = 600, env=None):
    """Run ``tests/helpers/<script>`` on 2 ranks; the first ``RESULT`` line's JSON (the run's
    output in the assertion message when it failed or printed none)."""
    e = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", **(env or {}))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(HELPERS / script),
        *args,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e, cwd=cwd)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[0][len("RESULT ") :])
