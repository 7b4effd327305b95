"""Another process holding a folder as a running job (or study) does (``train/run_dir.py``)."""

import contextlib
import subprocess
import sys


@contextlib.contextmanager
def held_by_another_process(folder, flag: str = "--save_path"):
    """Inside the block a second process holds ``folder`` (``run_dir.claim``); yields its pid.
    It lets go as the block ends."""
    holder = subprocess.Popen(
        [sys.executable, "-c", f"from hilore_actor.train.run_dir import claim; claim({str(folder)!r}, {flag!r}); "
         "print('held', flush=True); input()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        yield holder.pid
    finally:
        holder.communicate("\n", timeout=60)
