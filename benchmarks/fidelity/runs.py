"""The runs of a fidelity study: one training job per (method, seed), each resumable.

A run lives in ``<runs>/<method>-seed<S>/`` (the job's ``--save_path``: checkpoints, metrics,
final weights, ``job.log``). Its state follows from what is on disk: ``done`` when the final
weights exist and the metrics hold every step, ``partial`` when a checkpoint exists (the job
continues from it with ``--resume``), else ``fresh``. So re-running the study's command skips
finished runs and continues an interrupted one; a study completes in as many pieces as needed.

Methods (all with the same model, task, head and flags; ``JOB``):

- ``gc``: gradient checkpointing on every layer (the reference: exact gradients);
- ``hilore``: mode ``hilore`` (H/L/R per unit and microbatch, L on the default codec set),
  with ``--measure_grad_error`` (each update's gradient against the exact one, beside training);
- ``hilore-hr``: H/R only, whose gradients equal gc's bit for bit: its run must reproduce gc's.

Every method uses the model's own head (``--hilore.chunked_head false``), as gc does, so the
only difference between gc and hilore is what HiLoRe does with activations.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

# the task: 2-term addition and subtraction of 1-2 digit numbers (signed), about 80,000 distinct
# problems, so held-out problems are plentiful; SmolLM2-135M-Instruct starts near 14% (greedy)
TASK = "rg:basic_arithmetic"
TASK_OPTIONS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "operators": ["+", "-"]}
INSTRUCTION = " Answer with the number only."
# the job's flags shared by every run (the cpu-demo shape: 4 prompts x 4 samples, 2 microbatches of 8)
JOB: Dict[str, object] = {
    "actor.model_name_or_path": "smollm2",
    "data.prompt_dataset": TASK,
    "data.task_options": json.dumps(TASK_OPTIONS),
    "data.instruction": INSTRUCTION,
    "rollout.batch_size": 4,
    "rollout.n_samples_per_prompt": 4,
    "rollout.max_new_tokens": 32,
    "train.batch_size": 16,
    "train.micro_batch_size": 8,
    "actor.adam.lr": 2e-4,
    "algo.kl.use_loss": True,
    "hilore.chunked_head": False,
    "hilore.profile_repeats": 1,
    "hilore.loo": False,
    "ckpt.save_steps": 5,
    "ckpt.max_num": 1,
    "compare_gc": False,
}
METHODS: Dict[str, List[str]] = {
    "gc": ["--actor_backend", "gc"],
    "hilore": ["--actor_backend", "hilore", "--hilore.mode", "hilore", "--measure_grad_error"],
    "hilore-hr": ["--actor_backend", "hilore", "--hilore.mode", "hilore-hr"],
    # the replay study (docs/training-job.md): gc's learner with rollout-level replay, against gc
    "replay": ["--actor_backend", "gc", "--replay.enable"],
}


class StudyError(RuntimeError):
    """A run failed or the study's inputs are wrong; the message says which and where to look."""


@dataclass
class Run:
    method: str
    seed: int
    root: Path  # the folder of all runs

    @property
    def name(self) -> str:
        return f"{self.method}-seed{self.seed}"

    @property
    def dir(self) -> Path:
        return self.root / self.name

    @property
    def final(self) -> Path:
        return self.dir / "final"

    def metrics(self) -> List[Dict]:
        p = self.dir / "metrics.jsonl"
        return [json.loads(ln) for ln in p.read_text().splitlines() if ln.strip()] if p.is_file() else []

    def state(self, steps: int) -> str:
        if (self.final / "adapter_config.json").is_file() and len(self.metrics()) >= steps:
            return "done"
        return "partial" if (self.dir / "checkpoints" / "latest").is_file() else "fresh"

    def command(self, config: Path, steps: int, calibration: Path, model: str, extra: List[str]) -> List[str]:
        cmd = [
            sys.executable,
            "-m",
            "hilore_actor.train_grpo",
            "--config",
            str(config),
            "--pretrain",
            model,
            "--train.seed",
            str(self.seed),
            "--max_steps",
            str(steps),
            "--save_path",
            str(self.dir),
            *METHODS[self.method],
            *extra,
        ]
        if self.method == "hilore":  # one calibration of L's risk for the study, made by its first hilore run
            cmd += ["--hilore.calibration", str(calibration)]
        if self.state(steps) == "partial":
            cmd.append("--resume")
        elif self.dir.is_dir():  # a run that stopped before its first checkpoint: start it again
            cmd.append("--overwrite_output_dir")
        return cmd


def write_config(path: Path, overrides: Optional[Dict] = None) -> Path:
    """The shared flags as the job's YAML config (``--config``), kept beside the results."""
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(dict(JOB, **(overrides or {})), sort_keys=True))
    return path


def train(run: Run, cmd: List[str], log=print) -> None:
    """Run (or continue) one training job, its output appended to ``<run>/job.log`` and its
    progress lines echoed. SIGINT/SIGTERM reach the job, which finishes its step and
    checkpoints (``train/faults.py``); then the study stops, to be continued by re-running."""
    run.dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"), PYTHONUNBUFFERED="1")
    with (run.dir / "job.log").open("a") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        # its own process group: a terminal's Ctrl-C reaches the job once, through ``forward`` (a second
        # signal would make it stop at once, without its checkpoint)
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
        )
        forwarded = []

        def forward(sig, _frame):
            forwarded.append(sig)
            proc.send_signal(sig)

        old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            for line in proc.stdout:
                out.write(line)
                if line.startswith(("[train]", "[step", "error")):
                    log(f"[{run.name}] {line.rstrip()}")
            rc = proc.wait()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
    if forwarded:
        raise KeyboardInterrupt(f"{run.name} stopped by {signal.Signals(forwarded[0]).name}")
    if rc != 0:
        raise StudyError(f"{run.name}: the training job exited with {rc}; see {run.dir / 'job.log'}")
