"""The runs of a fidelity study: one training job per (arm, seed), each resumable.

A run lives in ``<runs>/<arm>-seed<S>/`` (the job's ``--save_path``: checkpoints, metrics,
final weights, ``job.log``, and ``study-run.json``: the flags it was started with). Its state
follows from what is on disk: ``done`` when the final weights exist and the metrics hold every
step, ``partial`` when a checkpoint exists (the job continues from it with ``--resume``), else
``fresh``; ``stale`` when the folder was made with other flags (another task, learning rate or
budget), which the study refuses to continue rather than mix two studies. So re-running the
study's command skips finished runs and continues an interrupted one; a study completes in as
many pieces as needed.

Arms (all with the same model, task, head and shared flags; ``JOB``), paired by seed:

- ``gc``: gradient checkpointing on every layer (the reference: exact gradients);
- ``hilore``: mode ``hilore`` (H/L/R per unit and microbatch, L on the default codec set) at a
  budget where its plans use L, with ``--measure_grad_error`` (each update's gradient against
  the exact one on the same microbatches, beside training);
- ``control``: a positive control that must hurt. ``hilore-static`` at a budget that stores
  every unit, with the deliberately coarse codec ``int2`` and risk and tolerance so large that
  nothing is refused for its error: L wherever it saves room, whatever it costs the gradient;
- ``hilore-hr`` (optional): H/R only, whose gradients equal gc's bit for bit;
- ``replay``: gc's learner with rollout-level replay (the replay study, docs/training-job.md).

H, P and R are exact; only L approximates, so the study is about L: the arms differ in how
much of it they use and how coarse it is. Every arm uses the model's own head
(``--hilore.chunked_head false``), as gc does, so what HiLoRe does with activations is the only
difference.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

# the default task: 2-term addition of 1-2 digit numbers (no negation or parentheses), about 10,000
# distinct problems. Its held-out problems are mostly two 2-digit terms (the few 1-digit sums are nearly
# all in some seed's training set): the base model answers 8% of them, gc's pilot 50% after 40 steps at
# lr 5e-4 (docs/benchmark.md). Signed 1-2 digit +/- (base 7%) did not learn within 40 steps at 3e-4
# and collapsed at 1e-3; --pilot checks another task before the study's hours are spent on it
TASK = "rg:basic_arithmetic"
TASK_OPTIONS = {
    "min_terms": 2,
    "max_terms": 2,
    "min_digits": 1,
    "max_digits": 2,
    "operators": ["+"],
    "allow_parentheses": False,
    "allow_negation": False,
}
INSTRUCTION = " Answer with the number only."
# the job's flags shared by every run (the cpu-demo shape: 4 prompts x 4 samples, 2 microbatches of 8);
# the study's command line sets the task, learning rate and held-out evaluation on top (cli.shared_flags)
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
    "actor.adam.lr": 5e-4,
    "algo.kl.use_loss": True,
    "hilore.chunked_head": False,
    "hilore.profile_repeats": 1,
    "hilore.loo": False,
    "ckpt.save_steps": 5,
    "ckpt.max_num": 1,
    "compare_gc": False,
}
# the control's L: no risk budget or validation tolerance it could exceed, no leave-one-out (which
# could trade an L for an R); the budget and codec come from the study's --control-budget/--control-codec
CONTROL = [
    "--actor_backend",
    "hilore",
    "--hilore.mode",
    "hilore-static",
    "--hilore.delta",
    "100",
    "--hilore.tolerance",
    "100",
    "--hilore.loo",
    "false",
    "--measure_grad_error",
]
METHODS: Dict[str, List[str]] = {
    "gc": ["--actor_backend", "gc"],
    "hilore": ["--actor_backend", "hilore", "--hilore.mode", "hilore", "--measure_grad_error"],
    "control": CONTROL,
    "hilore-hr": ["--actor_backend", "hilore", "--hilore.mode", "hilore-hr"],
    # the replay study (docs/training-job.md): gc's learner with rollout-level replay, against gc
    "replay": ["--actor_backend", "gc", "--replay.enable"],
}
USES_L = ("hilore", "control")  # arms that calibrate L's risk (once per codec set: the file is reused)


def arm_flags(
    method: str,
    out: Path,
    hilore_budget: Optional[str] = None,
    control_budget: str = "1.30",
    control_codec: str = "int2",
) -> List[str]:
    """The job flags that make ``method`` what it is: ``METHODS`` plus its budget and codec and,
    for an arm with L, its calibration file in ``out`` (one per codec: calibration measures L's
    error with the codec, so the control's coarse codec has its own)."""
    flags = list(METHODS[method])
    if method == "hilore":
        flags += ["--hilore.budget", hilore_budget] if hilore_budget else []
        flags += ["--hilore.calibration", str(out / "calibration.json")]
    elif method == "control":
        flags += ["--hilore.budget", control_budget, "--hilore.codec", control_codec]
        flags += ["--hilore.calibration", str(out / f"calibration-{control_codec}.json")]
    return flags


def digest(data) -> str:
    """A short fingerprint of JSON-able ``data``: what an evaluation or a run was made with."""
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


class StudyError(RuntimeError):
    """A run failed or the study's inputs are wrong; the message says which and where to look."""


@dataclass
class Run:
    method: str
    seed: int
    root: Path  # the folder of all runs
    flags: List[str] = field(default_factory=list)  # the arm's job flags (arm_flags); METHODS' alone if empty

    @property
    def name(self) -> str:
        return f"{self.method}-seed{self.seed}"

    @property
    def dir(self) -> Path:
        return self.root / self.name

    @property
    def final(self) -> Path:
        return self.dir / "final"

    @property
    def job_flags(self) -> List[str]:
        return self.flags or list(METHODS[self.method])

    def key(self, shared: Dict, model: str) -> Dict:
        """What the run is: its shared flags, its arm's flags, the model and its seed (not its
        steps: a longer run continues a shorter one)."""
        return {"shared": digest(shared), "arm": self.job_flags, "model": model, "seed": self.seed}

    def metrics(self) -> List[Dict]:
        p = self.dir / "metrics.jsonl"
        return [json.loads(ln) for ln in p.read_text().splitlines() if ln.strip()] if p.is_file() else []

    def state(self, steps: int, key: Optional[Dict] = None) -> str:
        """``fresh``, ``partial``, ``done``, or (given the run's ``key``) ``stale``: a folder with
        a checkpoint or weights that another study's flags made."""
        begun = (self.dir / "checkpoints" / "latest").is_file() or (self.final / "adapter_config.json").is_file()
        made = self.dir / "study-run.json"
        if key is not None and begun and (not made.is_file() or json.loads(made.read_text()) != key):
            return "stale"
        if (self.final / "adapter_config.json").is_file() and len(self.metrics()) >= steps:
            return "done"
        return "partial" if (self.dir / "checkpoints" / "latest").is_file() else "fresh"

    def command(self, config: Path, steps: int, model: str, extra: List[str]) -> List[str]:
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
            *self.job_flags,
            *extra,
        ]
        if self.state(steps) == "partial":
            cmd.append("--resume")
        elif self.dir.is_dir():  # a run that stopped before its first checkpoint: start it again
            cmd.append("--overwrite_output_dir")
        return cmd


def write_config(path: Path, shared: Dict) -> Path:
    """The shared flags as the job's YAML config (``--config``), kept beside the results."""
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(shared, sort_keys=True))
    return path


def train(run: Run, cmd: List[str], key: Optional[Dict] = None, log=print) -> None:
    """Run (or continue) one training job, its output appended to ``<run>/job.log`` and its
    progress lines echoed; ``key`` (``Run.key``) is written beside it first, so a later study
    with other flags does not take this run for its own. SIGINT/SIGTERM reach the job, which
    finishes its step and checkpoints (``train/faults.py``); then the study stops, to be
    continued by re-running."""
    run.dir.mkdir(parents=True, exist_ok=True)
    if key is not None:
        (run.dir / "study-run.json").write_text(json.dumps(key, sort_keys=True))
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
                out.flush()  # job.log is where a user looks while a run plans or trains
                if line.startswith(("[train]", "[plan]", "[step", "error")):
                    log(f"[{run.name}] {line.rstrip()}")
            rc = proc.wait()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
    if forwarded:
        raise KeyboardInterrupt(f"{run.name} stopped by {signal.Signals(forwarded[0]).name}")
    if rc != 0:
        raise StudyError(f"{run.name}: the training job exited with {rc}; see {run.dir / 'job.log'}")
