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
    return subprocess.run([sys.executable, "-m", "hilore_actor.train_grpo", *TINY, "--save_path", str(tmp), *args],
                          capture_output=True, text=True, timeout=timeout, env=e)


def metrics(path):
    return [json.loads(ln) for ln in (Path(path) / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def same_training(rows, ref, steps, keys=("loss", "policy_loss", "kl", "grad_norm", "reward_mean", "response_length")):
    """Bitwise equal metrics of the given step indices (what an exact run reproduces)."""
    for i in steps:
        for key in keys:
            assert rows[i][key] == ref[i][key], (i, key)
