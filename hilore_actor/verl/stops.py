"""Where verl's trainer stops on a machine that lacks what it needs, as one line.

verl's trainer (``verl.trainer.main_ppo``: Ray, its ``TaskRunner``, TransferQueue, the worker
group) runs on any machine until its first step that needs a CUDA GPU or a rollout engine
(vLLM, SGLang). What it does there is a traceback (or, with no GPU in the Ray cluster, a wait
for resources that never come: verl's TransferQueue holds one Ray CPU per storage unit before
it checks the GPUs). The launcher (``main_ppo.py``) turns these into one line and exit code 2:

- ``check_lora_rollout``: before verl is imported: verl's ``validate_config`` asks vLLM for its
  largest LoRA rank when a LoRA recipe rolls out with vLLM;
- ``guard``: verl's ``run_ppo`` runs with its task runner checked against the Ray cluster's GPUs
  (after verl's ``ray.init``, before its ``TaskRunner``), and a failure whose cause is a missing
  CUDA device, a missing rollout engine or too few GPUs (verl's own check) becomes ``Stopped``
  with one line naming the Ray task and the verl function where it happened. Any other error
  keeps its traceback.
"""

from __future__ import annotations

import importlib.util
import re
from typing import Optional

ROLLOUT_ENGINES = ("vllm", "sglang", "tensorrt_llm")
# HiLoRe's engine in a worker without CUDA (fsdp_engine._need_device) begins its message so
NEEDS_CUDA = "HiLoRe's verl engine (actor_rollout_ref.actor.strategy=hilore) needs a CUDA device"
# torch's own words where a process without CUDA (or a CPU build of torch) reaches CUDA or NCCL
CUDA_MISSING = (
    NEEDS_CUDA,
    "NCCL built in",
    "Torch not compiled with CUDA enabled",
    "Found no NVIDIA driver",
    "No CUDA GPUs are available",
)
TOO_FEW_GPUS = re.compile(r"Total available GPUs (\S+) is less than total desired GPUs (\S+)")
RAY_TASK = re.compile(r"ray::([\w.]+)\(\) \(pid=(\d+)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
VERL_FRAME = re.compile(r'File "[^"]*?/((?:hilore_actor/)?verl/[^"]+\.py)", line \d+, in (\w+)')
GPU_ADVICE = "verl's FSDP workers and HiLoRe's engine train on CUDA GPUs"


class Stopped(BaseException):
    """verl's trainer reached a step this machine cannot run; ``str`` is the one line. A
    ``BaseException``: Hydra's job runner, between verl's ``main`` and the launcher, reports
    every ``Exception`` with a traceback of its own."""


def check_lora_rollout(cfg) -> None:
    """``ValueError`` with one line where verl's ``validate_config`` would import vLLM (a LoRA
    recipe that rolls out with vLLM) and vLLM is not installed; the same test as verl's."""
    from omegaconf import OmegaConf

    model = cfg.actor_rollout_ref.model
    rank = int(OmegaConf.select(model, "lora.rank", default=0) or 0)
    if rank <= 0:
        rank = int(OmegaConf.select(model, "lora_rank", default=0) or 0)
    if OmegaConf.select(model, "lora.merge", default=False):
        rank = 0
    name = str(cfg.actor_rollout_ref.rollout.name)
    if rank > 0 and name == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ValueError(
            f"actor_rollout_ref.rollout.name=vllm and vLLM is not installed: verl's validate_config asks vLLM for "
            f"its largest LoRA rank (LoRA rank {rank}) before anything starts; install the rollout engine "
            '(pip install -e ".[gpu]", a CUDA machine)'
        )


def _chain(exc):
    """(the innermost Ray task's name and pid or None, verl's innermost frame in it or None, the
    errors from the first one that is no Ray task's down its causes). A Ray task's error reaches
    the caller as Ray's dual exception (a ``RayTaskError`` and its cause's class), whose text is
    the task's name, pid and traceback."""
    from ray.exceptions import RayTaskError

    where, frame, seen = None, None, set()
    while isinstance(exc, RayTaskError) and id(exc) not in seen:
        seen.add(id(exc))
        text = ANSI.sub("", str(exc))
        tasks = RAY_TASK.findall(text)  # a task's text holds the tasks it waited on after its own
        where = f"ray::{tasks[-1][0]} (pid {tasks[-1][1]})" if tasks else where
        frames = VERL_FRAME.findall(text)
        frame = f"{frames[-1][0]}:{frames[-1][1]}" if frames else frame
        exc = exc.cause
    errors = []
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        errors.append(exc)
        exc = exc.__cause__ or exc.__context__
    return where, frame, errors


def reason(exc: BaseException, rollout_name: str) -> Optional[str]:
    """The one line for ``exc`` when its cause is a machine limit (no CUDA device, no rollout
    engine, too few GPUs), else None."""
    where, frame, errors = _chain(exc)
    at = " in " + where if where else ""
    at += f", at {frame}" if frame else ""
    for e in errors:
        text = " ".join(str(e).split())
        name = (getattr(e, "name", None) or "").split(".")[0]
        if isinstance(e, ImportError) and name in ROLLOUT_ENGINES or "vllm version None not supported" in text:
            engine = name if name in ROLLOUT_ENGINES else "vllm"
            return (
                f"verl's trainer stopped where it first needs its rollout engine{at}: {engine} is not installed "
                f"(actor_rollout_ref.rollout.name={rollout_name}); install it on a CUDA machine "
                '(pip install -e ".[gpu]")'
            )
        if any(marker in text for marker in CUDA_MISSING):
            first = text if text.startswith(NEEDS_CUDA) else f"{type(e).__name__}: {text}"
            return f"verl's trainer stopped where it first needs CUDA{at}: {first}. {GPU_ADVICE}"
        found = TOO_FEW_GPUS.search(text)
        if found:
            return (
                f"verl's trainer stopped where it first needs GPUs{at}: the Ray cluster has {found.group(1)} GPUs "
                f"free and this recipe asks for {found.group(2)}. {GPU_ADVICE}"
            )
    return None


def cluster_gpus() -> float:
    import ray

    return float(ray.cluster_resources().get("GPU", 0))


class CheckedRunner:
    """verl's task runner class, its ``remote()`` first checks that the Ray cluster (verl has
    just started or joined it) offers the GPUs of ``trainer.n_gpus_per_node`` x ``trainer.nnodes``:
    verl checks that only after TransferQueue's actors hold their CPUs, and waits forever on a
    machine with fewer CPUs than those take."""

    def __init__(self, runner, need: int):
        self.runner, self.need = runner, need

    def options(self, **kwargs):
        return CheckedRunner(self.runner.options(**kwargs), self.need)

    def remote(self, *args, **kwargs):
        have = cluster_gpus()
        if have < self.need:
            raise Stopped(
                f"verl's trainer stopped where it first needs GPUs, before its TaskRunner: the Ray cluster has "
                f"{have:g} GPUs and this recipe asks for {self.need} (trainer.n_gpus_per_node x trainer.nnodes). "
                f"{GPU_ADVICE}; a Ray cluster is given by ray_kwargs.ray_init.address or RAY_ADDRESS"
            )
        return self.runner.remote(*args, **kwargs)


def guard(verl_main_module) -> None:
    """verl's ``run_ppo`` (module ``verl.trainer.main_ppo``, which its ``main`` calls by name)
    with the task runner checked and machine limits raised as ``Stopped``; idempotent."""
    run_ppo = verl_main_module.run_ppo
    if getattr(run_ppo, "hilore_guarded", False):
        return

    def guarded(config, task_runner_class):
        runner = task_runner_class
        if str(config.trainer.get("device", "cuda")) == "cuda":
            runner = CheckedRunner(task_runner_class, int(config.trainer.n_gpus_per_node) * int(config.trainer.nnodes))
        try:
            return run_ppo(config, task_runner_class=runner)
        except Exception as e:
            line = reason(e, str(config.actor_rollout_ref.rollout.name))
            if line is None:
                raise
            raise Stopped(line) from None

    guarded.hilore_guarded = True
    verl_main_module.run_ppo = guarded
