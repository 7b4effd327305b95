"""Running the training job from tests: the tiny preset (2 learner ranks under ZeRO-2, 1 HF
rollout worker, a reference worker, the budget coordinator) in H/R mode, whose gradients are
exact, so runs compare bitwise."""

import json
import os
import subprocess
import sys
from pathlib import Path

TINY = ["--preset", "tiny", "--hilore.mode", "hilore-hr"]


def job(tmp, *args, env=None, timeout=420):
    e = dict(os.environ, DS_ACCELERATOR="cpu")
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "hilore_actor.train_grpo", *TINY, "--save_path", str(tmp), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=e,
    )


def main_without_ray(argv, monkeypatch, capsys):
    """(exit code, stdout, stderr, seconds) of the job's ``main`` run in this process with Ray's
    start made an error: how a mistake refused before Ray is answered."""
    import time

    import ray

    from hilore_actor import train_grpo

    def no_ray(*a, **k):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(ray, "init", no_ray)
    t = time.perf_counter()
    try:
        code = train_grpo.main(argv)
    except SystemExit as e:  # argparse
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err, time.perf_counter() - t


def metrics(path):
    return [json.loads(ln) for ln in (Path(path) / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def same_training(rows, ref, steps, keys=("loss", "policy_loss", "kl", "grad_norm", "reward_mean", "response_length")):
    """Bitwise equal metrics of the given step indices (what an exact run reproduces)."""
    for i in steps:
        for key in keys:
            assert rows[i][key] == ref[i][key], (i, key)


def wandb_run_file(save_path):
    """The one offline W&B run's record file under ``<save_path>/wandb``."""
    [path] = Path(save_path).glob("wandb/offline-run-*/run-*.wandb")
    return path


def wandb_records(path):
    """The protobuf ``Record`` s of a ``.wandb`` file. The format is wandb's LevelDB-style log
    (wandb 0.31 ships no Python reader): a 7-byte header (``:W&B``, magic, version), then
    32 KiB blocks of chunks, each with a 7-byte header (crc32c, length, type: 1 full, 2 first,
    3 middle, 4 last); a block's last < 7 bytes are padding."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, block, parts = 7, 32768, []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zero padding: the rest of the block
            pos += left
            continue
        parts.append(data[pos + 7 : pos + 7 + n])
        pos += 7 + n
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(b"".join(parts))
            parts = []
            yield rec


def wandb_history(save_path):
    """``{step: {name: value}}`` of the offline W&B run's logged values (W&B's own ``_*`` keys
    left out; a table appears as its fields ``name.field``)."""
    rows = {}
    for rec in wandb_records(wandb_run_file(save_path)):
        if rec.WhichOneof("record_type") != "history":
            continue
        items = {".".join(i.nested_key) or i.key: json.loads(i.value_json) for i in rec.history.item}
        step = items.pop("_step")
        rows.setdefault(step, {}).update({k: v for k, v in items.items() if not k.startswith("_")})
    return rows


def wandb_scalars(save_path):
    """``{(name, step): value}`` of the W&B run's logged numbers (what TensorBoard's scalars
    hold; a table's fields, ``name.field``, left out: the job's names hold no dot)."""
    return {
        (k, s): float(v)
        for s, row in wandb_history(save_path).items()
        for k, v in row.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and "." not in k
    }


def tensorboard_scalars(logdir):
    """``{(tag, step): value}`` of every TensorBoard scalar event under ``logdir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = {}
    for f in Path(logdir).glob("events.out.tfevents.*"):
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0, "tensors": 0})
        acc.Reload()
        for t in acc.Tags()["scalars"]:
            out.update({(t, e.step): e.value for e in acc.Scalars(t)})
    return out


def tensorboard_counts(logdir):
    """``{(tag, step): how many scalar events}`` over every event file under ``logdir``, each file
    read on its own (no reader's purge across files), so a step logged twice counts twice."""
    from collections import Counter

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = Counter()
    for f in Path(logdir).glob("events.out.tfevents.*"):
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0, "tensors": 0})
        acc.Reload()
        for t in acc.Tags()["scalars"]:
            out.update((t, e.step) for e in acc.Scalars(t))
    return out
