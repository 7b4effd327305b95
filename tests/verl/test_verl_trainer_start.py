"""verl's own trainer (``verl.trainer.main_ppo``: Ray, its ``TaskRunner``, TransferQueue, the actor
worker group) started by HiLoRe's launcher on an upstream verl GRPO recipe on this CPU machine: it
runs as far as verl goes without CUDA and stops at verl's first CUDA step with one line, exit code
2 and no traceback (``hilore_actor/verl/stops.py``); and the launcher's other stops there (no GPU in
the Ray cluster, no rollout engine) as one line each."""

import os
import re
import subprocess
import sys

import pandas as pd
import pytest

pytest.importorskip("verl")  # verl's trainer needs TransferQueue, part of the verl install: no skip without it

from test_verl_recipes import FSDP2, OFFLOAD_7B  # noqa: E402

ENABLE = "+actor_rollout_ref.actor.hilore.enable=true"
# verl's optional engines, which verl's engine package names in a warning when they are missing
OPTIONAL = {"torchtitan", "veomni", "nemo_automodel", "megatron"}
# A Ray cluster of its own (not one another test started), small for this machine: logical CPUs
# for verl's placement group (3 per GPU) and TransferQueue's actors (one per storage unit, one
# storage unit), no dashboard, a small object store.
RAY = [
    "+ray_kwargs.ray_init.address=local",
    "ray_kwargs.ray_init.num_cpus=8",
    "+ray_kwargs.ray_init.include_dashboard=false",
    "+ray_kwargs.ray_init.object_store_memory=200000000",
    "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
]
# A Ray cluster that offers one GPU, as a GPU node whose torch has no CUDA build would
ONE_GPU = ["+ray_kwargs.ray_init.num_gpus=1"]


def _recipe(tmp_path) -> list:
    """examples/tuning/7b/qwen2-7b_grpo_2_h800_fsdp_vllm.sh with FSDP2 (``test_verl_recipes.py``),
    sized for this machine: the tiny model (SmolLM2's tokenizer and chat template), eight GSM8K-style
    prompts in verl's parquet layout, one GPU, console logging."""
    from verl_cpu import save_tiny_chat_model

    model = save_tiny_chat_model(tmp_path / "tiny")
    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"What is {i} + {i}? Answer after ####."}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(8)
    ]
    pd.DataFrame(rows).to_parquet(tmp_path / "train.parquet")
    pd.DataFrame(rows).to_parquet(tmp_path / "test.parquet")
    sized = {
        "data.train_files": f"['{tmp_path / 'train.parquet'}']",
        "data.val_files": f"['{tmp_path / 'test.parquet'}']",
        "actor_rollout_ref.model.path": model,
        "data.train_batch_size": "8",
        "actor_rollout_ref.actor.ppo_mini_batch_size": "8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "2",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": "2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size": "1",
        "trainer.logger": '["console"]',
        "trainer.n_gpus_per_node": "1",
    }
    recipe = [f"{k}={sized[k]}" if k in sized else f"{k}={v}" for k, v in (a.split("=", 1) for a in OFFLOAD_7B)]
    return recipe + FSDP2 + [ENABLE]


def _launcher(args, cwd, timeout=300):
    """The launcher as a user runs it, from ``cwd`` (Hydra writes its outputs there): (exit code,
    stdout and stderr together, stderr)."""
    done = subprocess.run(
        [sys.executable, "-m", "hilore_actor.verl.main_ppo", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "RAY_DEDUP_LOGS": "0"},
    )
    return done.returncode, done.stdout + done.stderr, done.stderr


def _missing_modules(output: str) -> set:
    return set(re.findall(r"No module named '([\w.]+)'", output)) - OPTIONAL


def test_verls_trainer_starts_on_cpu_and_stops_at_its_first_cuda_step(tmp_path):
    """The launcher runs verl's default (v1) trainer on the recipe, its Ray cluster offering one
    GPU: verl's TaskRunner starts (TransferQueue imported and started, the dataset read), the
    actor worker group is created, HiLoRe's engine is registered in its worker, and the worker's
    ``init_model`` stops where verl first needs CUDA (its NCCL process group); the launcher ends
    with that one line, exit code 2, no traceback."""
    code, out, err = _launcher(_recipe(tmp_path) + RAY + ONE_GPU, cwd=tmp_path)
    assert "Traceback" not in out and not _missing_modules(out), out[-6000:]
    last = err.strip().splitlines()[-1]
    assert code == 2, out[-6000:]
    where = re.match(
        r"error: verl's trainer stopped where it first needs CUDA in ray::WorkerDict\.actor_rollout_ref_init_model "
        r"\(pid (\d+)\), at verl/utils/distributed\.py:initialize_global_process_group_ray: RuntimeError: .*NCCL",
        last,
    )
    assert where, last
    assert re.search(r"\(TaskRunnerV1 pid=\d+\).*train dataset size: 8", out)
    assert "create worker group dict_keys(['actor_rollout_ref'])" in out
    registered = rf"\((?:WorkerDict )?pid={where.group(1)}\)\S* \[hilore\] rank 0: HiLoRe's actor engine is registered"
    assert re.search(registered, out), out[-6000:]


@pytest.mark.slow
def test_without_a_gpu_in_the_ray_cluster_the_launcher_stops_before_verls_task_runner(tmp_path):
    """The same recipe on the Ray cluster this machine gives (no GPU): one line as soon as verl has
    started Ray, before its TaskRunner (whose TransferQueue would otherwise wait for CPUs)."""
    code, out, err = _launcher(_recipe(tmp_path) + RAY, cwd=tmp_path)
    assert code == 2 and "Traceback" not in out, out[-6000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(
        "error: verl's trainer stopped where it first needs GPUs, before its TaskRunner: the Ray cluster has 0 GPUs "
        "and this recipe asks for 1"
    ), last
    assert "TaskRunnerV1" not in out


def test_a_lora_recipe_without_vllm_stops_before_verl_is_imported(capsys):
    """verl's validate_config asks vLLM for its largest LoRA rank: without vLLM (no CPU build) the
    launcher says so in one line, before anything starts."""
    from test_verl_recipes import LORA_3B

    from hilore_actor.verl.main_ppo import main

    assert main(LORA_3B + [ENABLE]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(
        "error: actor_rollout_ref.rollout.name=vllm and vLLM is not installed: verl's validate_config asks vLLM"
    ), err


def _ray_task_error(cause, function: str, frame: str):
    """``cause`` as the caller of a Ray task that raised it in verl's ``frame`` (``path:function``)
    sees it: Ray's dual exception, whose text is the task's name, pid and traceback."""
    from ray.exceptions import RayTaskError

    path, func = frame.split(":")
    tb = (
        "Traceback (most recent call last):\n"
        f'  File "/x/site-packages/{path}", line 70, in {func}\n'
        f"{type(cause).__name__}: {cause}"
    )
    return RayTaskError(
        function, tb, cause, proctitle=f"ray::{function}", pid=4242, ip="127.0.0.1"
    ).as_instanceof_cause()


INIT_MODEL = "WorkerDict.actor_rollout_ref_init_model"


@pytest.mark.parametrize(
    "cause,function,frame,expected",
    [
        (
            RuntimeError("Distributed package doesn't have NCCL built in"),
            INIT_MODEL,
            "verl/utils/distributed.py:initialize_global_process_group_ray",
            "verl's trainer stopped where it first needs CUDA in ray::WorkerDict.actor_rollout_ref_init_model "
            "(pid 4242), at verl/utils/distributed.py:initialize_global_process_group_ray: RuntimeError: "
            "Distributed package doesn't have NCCL built in. verl's FSDP workers and HiLoRe's engine train on "
            "CUDA GPUs",
        ),
        (
            ModuleNotFoundError("No module named 'vllm'", name="vllm"),
            INIT_MODEL,
            "verl/workers/rollout/base.py:get_rollout_class",
            "verl's trainer stopped where it first needs its rollout engine in ray::WorkerDict.actor_rollout_ref_"
            "init_model (pid 4242), at verl/workers/rollout/base.py:get_rollout_class: vllm is not installed "
            '(actor_rollout_ref.rollout.name=vllm); install it on a CUDA machine (pip install -e ".[gpu]")',
        ),
        (
            ValueError("Total available GPUs 1 is less than total desired GPUs 8"),
            "TaskRunnerV1.run",
            "verl/single_controller/ray/base.py:_check_resource_available",
            "verl's trainer stopped where it first needs GPUs in ray::TaskRunnerV1.run (pid 4242), at "
            "verl/single_controller/ray/base.py:_check_resource_available: the Ray cluster has 1 GPUs free and "
            "this recipe asks for 8. verl's FSDP workers and HiLoRe's engine train on CUDA GPUs",
        ),
        (ValueError("ppo_mini_batch_size must be positive"), INIT_MODEL, "verl/workers/config/actor.py:check", None),
    ],
)
def test_a_machine_limit_in_a_ray_task_is_one_line_and_any_other_error_is_not(cause, function, frame, expected):
    from hilore_actor.verl.stops import reason

    assert reason(_ray_task_error(cause, function, frame), "vllm") == expected


def test_verls_task_runner_is_created_only_where_the_ray_cluster_has_the_gpus(monkeypatch):
    """verl's task runner class stands behind a check of the Ray cluster's GPUs, made when verl
    creates the runner (verl has started Ray then): too few stop, enough create it as verl would."""
    from hilore_actor.verl import stops

    class Runner:
        def remote(self):
            return "runner"

        def options(self, **kw):
            return self

    monkeypatch.setattr(stops, "cluster_gpus", lambda: 1.0)
    assert stops.CheckedRunner(Runner(), 1).options(runtime_env={}).remote() == "runner"
    with pytest.raises(stops.Stopped, match="the Ray cluster has 1 GPUs and this recipe asks for 2"):
        stops.CheckedRunner(Runner(), 2).remote()
