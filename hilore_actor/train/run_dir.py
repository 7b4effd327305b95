"""The run folder (``--save_path``): a run's outputs are never lost to the next run.

- A folder the user named (command line or YAML) that already holds a run is refused for a
  fresh run, with the three ways on (``--resume``, another path, ``--overwrite_output_dir``),
  as the Hugging Face Trainer refuses a non-empty ``output_dir``.
- A folder the user did not name (the default, or a preset's) is a parent: each fresh run
  gets a new, timestamped folder under it, and ``--resume`` takes the newest run there that
  has a checkpoint.
- Either way the folder must be a writable directory; that is checked before Ray starts.
- A folder another run is using (a second job, or a second ``--resume`` of the same run) is
  refused, before anything in it is touched: the job holds an exclusive ``flock`` on
  ``LOCK_FILE`` in its folder while it runs (the kernel drops it however the job ends).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

# the files of the steps (``metrics.py``): their rows, sample generations, each unit's action on each
# microbatch and each step's pictures; the run report's folder (``python -m hilore_actor.report``)
METRICS_FILE, SAMPLES_FILE, ACTIONS_FILE, PICTURES_DIR = "metrics.jsonl", "samples.jsonl", "actions.jsonl", "pictures"
REPORT_DIR = "report"
# what a run writes into its folder; any of them but error.log (a run that failed before its
# first step) means the folder holds a run
RUN_OUTPUTS = (
    METRICS_FILE,
    SAMPLES_FILE,
    ACTIONS_FILE,
    PICTURES_DIR,
    REPORT_DIR,
    "tensorboard",
    "checkpoints",
    "final",
    "wandb",
    "error.log",
)


LOCK_FILE = ".hilore-run.lock"  # in the run folder: held by the job using it, names that job
_held: Dict[str, int] = {}  # this process's locks: resolved folder -> descriptor


class RunDirError(ValueError):
    """The run folder cannot be used as asked; the message says why and what to do."""


def claim(folder: Path, flag: str = "--save_path") -> None:
    """Hold ``folder`` for this process until ``release_all`` (or the process ends); refused with
    the holder's pid and host when another process holds it (``flag``: how the user named the
    folder). Claiming again is a no-op."""
    key = str(Path(folder).resolve())
    if key in _held:
        return
    fd = os.open(Path(folder) / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.read(fd, 256).decode(errors="replace").strip() or "a process"
        os.close(fd)
        raise RunDirError(
            f"{flag} {folder} is in use by another run ({holder}): wait for it to end, or stop it "
            "(Ctrl-C checkpoints it) and continue it with --resume"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}".encode())
    _held[key] = fd


def release_all() -> None:
    """Let go of every folder this process claimed (the job's end)."""
    while _held:
        os.close(_held.popitem()[1])  # closing the descriptor drops its flock


def outputs(folder: Path) -> List[str]:
    """The run outputs a folder holds (empty: no run there)."""
    return [name for name in RUN_OUTPUTS if name != "error.log" and (Path(folder) / name).exists()]


def _writable(folder: Path, flag: str) -> None:
    if folder.exists() and not folder.is_dir():
        raise RunDirError(f"{flag} {folder}: a file, not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-probe-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise RunDirError(f"{flag} {folder}: cannot write there ({e.strerror or e})") from None


def _has_checkpoint(folder: Path) -> bool:
    return (folder / "checkpoints" / "latest").is_file()


def _newest_run(parent: Path) -> Optional[Path]:
    runs = [p for p in parent.iterdir() if p.is_dir() and _has_checkpoint(p)] if parent.is_dir() else []
    if _has_checkpoint(parent):  # a run written straight into the parent
        runs.append(parent)
    return max(runs, key=lambda p: (p / "checkpoints" / "latest").stat().st_mtime, default=None)


def _new_run(parent: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, k = parent / stamp, 1
    while path.exists():
        k += 1
        path = parent / f"{stamp}-{k}"
    return path


def resolve(cfg, log: Callable[[str], None] = print) -> None:
    """Set ``cfg.save_path`` to the run's own folder, checked and created (``RunDirError``)."""
    named = "save_path" in getattr(cfg, "user_set", ())
    resume, overwrite = cfg.ckpt.load_enable, cfg.overwrite_output_dir
    folder = Path(cfg.save_path)
    if resume and overwrite:
        raise RunDirError("--resume continues the run in --save_path and --overwrite_output_dir deletes it: choose one")
    if named or cfg.ckpt.path:
        held = outputs(folder) if folder.is_dir() else []
        if cfg.ckpt.path and not resume and Path(cfg.ckpt.path, "latest").is_file():
            held.append(f"checkpoints in --ckpt.path {cfg.ckpt.path}")
        if held and not resume and not overwrite:
            raise RunDirError(
                f"--save_path {folder} already holds a run ({', '.join(held)}): continue it with "
                "--resume, choose another --save_path, or pass --overwrite_output_dir to replace it"
            )
        if held and overwrite:
            claim(folder)  # not while another run writes there
            for name in RUN_OUTPUTS:
                p = folder / name
                shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
            if cfg.ckpt.path:
                shutil.rmtree(cfg.ckpt.path, ignore_errors=True)
            log(f"[train] --overwrite_output_dir: removed the previous run's outputs in {folder}")
        if not named and not resume:  # only --ckpt.path was named: the outputs still get a folder of their own
            folder = _new_run(folder)
    elif resume:
        last = _newest_run(folder)
        if last is None:
            raise RunDirError(f"--resume: no run with a checkpoint under {folder}; name the run with --save_path")
        folder = last
        log(f"[train] --resume: the newest run under {cfg.save_path} is {folder}")
    else:
        folder = _new_run(folder)
    _writable(folder, "--save_path")
    claim(folder)
    if cfg.logger.tensorboard_dir:
        _writable(Path(cfg.logger.tensorboard_dir), "--logger.tensorboard_dir")
    if cfg.ckpt.path:
        _writable(Path(cfg.ckpt.path), "--ckpt.path")
    if not named and not resume:
        log(f"[train] run folder: {folder}")
    cfg.save_path = str(folder)
