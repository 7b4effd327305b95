"""Two gloo ranks through OpenRLHF 0.11.2's real actor path under DeepSpeed ZeRO-3, for
``test_openrlhf_zero3.py``.

Per rank, twice on the same weights and experiences: OpenRLHF's own ``PolicyModelActor`` with
its gradient checkpointing, then this package's ``HiLoRePolicyModelActor`` (their plain
classes, in this process). Each runs the real ``init_model_from_pretrained`` (OpenRLHF's CLI
parses the recipe; ``DeepspeedStrategy``; the model partitioned at load by ZeRO-3's
``HfDeepSpeedConfig``; ``strategy.prepare``) and three real ``fit`` calls (``ppo_train`` over the
replay buffer, two microbatches per optimizer step). The whole gradient is read as the
optimizer step begins (``safe_get_full_grad``, a collective). The drop-in plans at its first
``fit``, in lockstep; the second ``fit`` runs an alternating H/R map; in the third only rank 0's
plan stores nothing (as after a ``tighten`` of its own), which every rank must follow.

CPU stand-ins, and only these (``cpu_stand_ins``): ``torch.cuda`` device calls (``set_device``,
``current_device`` -> the CPU, ``synchronize``), OpenRLHF's ``init_device_mesh("cuda")`` on the
CPU, OpenRLHF's ZeRO-3 loading patch for transformers 5.15 left out (see ``rank_main``),
DeepSpeed's ``torch_adam`` (its fused Adam is a CUDA/JIT kernel), the budget coordinator
a plain object (no Ray), and the vllm/flash_attn import shims (``openrlhf_shims.py``).
``--ds.enable_sleep`` is left out: DeepSpeed's ``offload_states`` takes only its FusedAdam
(``stage3.py``: "Offloading is supported only for DeepSpeed FusedAdam"), a CUDA kernel; that
planning happens after its reload is ``test_openrlhf.py``'s order test.

``openrlhf_ranks.py`` runs it as the case ``drop-in``.
"""

import copy
import json
import os

import torch

MICRO, SAMPLES, P, A, VOCAB = 2, 4, 12, 20, 128


def recipe(model_dir: str, stage: int = 3, kl: bool = True):
    """OpenRLHF's documented RL flags (ZeRO-3, packing off: its flash-attn path is GPU-only);
    ``stage`` and ``kl`` (``--algo.kl.use_loss``) for ``openrlhf_skip_ranks.py``."""
    return [
        "--actor.model_name_or_path",
        model_dir,
        "--data.prompt_dataset",
        "unused",
        "--ds.zero_stage",
        str(stage),
        "--ds.param_dtype",
        "bf16",
        "--ds.attn_implementation",
        "sdpa",
        "--vllm.num_engines",
        "0",
        "--rollout.n_samples_per_prompt",
        "4",
        "--algo.advantage.estimator",
        "group_norm",
        *(["--algo.kl.use_loss"] if kl else []),
        "--algo.kl.estimator",
        "k3",
        "--actor.num_gpus_per_node",
        "2",
        "--rollout.batch_size",
        "4",
        "--train.batch_size",
        str(2 * SAMPLES),
        "--train.micro_batch_size",
        str(MICRO),
        "--rollout.micro_batch_size",
        str(MICRO),
        "--data.max_len",
        str(P + A),
        "--train.max_epochs",
        "1",
        "--actor.gradient_checkpointing_enable",
        "--vllm.sync_backend",
        "gloo",
    ]


FP32 = [False]  # the stand-ins' precision switch (cpu_stand_ins)


def cpu_stand_ins(pa, fp32: bool = False) -> None:
    """The CUDA calls OpenRLHF's actor path makes, on the CPU (module docstring), installed once
    per process. With ``fp32`` the model and DeepSpeed train in float32 until the next call
    (OpenRLHF's ``--ds.param_dtype`` offers only bf16 and fp16), so comparisons within 1e-6 mean
    something."""
    FP32[0] = fp32
    if getattr(cpu_stand_ins, "installed", False):
        return
    cpu_stand_ins.installed = True
    import openrlhf.trainer.ppo_utils.replay_buffer as rb
    import openrlhf.utils.deepspeed.deepspeed as ods
    import openrlhf.utils.utils as outils
    from torch.distributed.device_mesh import init_device_mesh

    cpu = lambda: torch.device("cpu")  # noqa: E731
    torch.cuda.set_device = lambda *a: None
    torch.cuda.current_device = cpu
    torch.cuda.synchronize = lambda *a: None
    ods.init_device_mesh = lambda _type, *a, **k: init_device_mesh("cpu", *a, **k)
    pa.has_cuda = lambda: True
    pa.current_cuda_device = lambda: torch.device("cpu")
    real = ods.DeepspeedStrategy.get_ds_train_config

    def train_config(self, *a, **k):
        cfg = real(self, *a, **k)
        if "optimizer" in cfg:
            cfg["optimizer"]["params"]["torch_adam"] = True
        if FP32[0]:
            cfg["bf16"]["enabled"] = cfg["fp16"]["enabled"] = False
        return cfg

    # Actor loads the model in convert_to_torch_dtype(param_dtype), imported when it loads
    convert = outils.convert_to_torch_dtype
    outils.convert_to_torch_dtype = lambda dtype: torch.float32 if FP32[0] else convert(dtype)

    ods.DeepspeedStrategy.get_ds_train_config = train_config
    buffer_init = rb.NaiveReplayBuffer.__init__

    def replay_buffer(self, *a, **k):  # it names its device f"cuda:{current_device()}"
        torch.cuda.current_device = lambda: 0
        try:
            buffer_init(self, *a, **k)
        finally:
            torch.cuda.current_device = cpu
        self.target_device = cpu()

    rb.NaiveReplayBuffer.__init__ = replay_buffer


def start_rank(rank, world, port) -> None:
    """The rank's environment, the import shims and its gloo process group."""
    from gloo_ranks import rank_env

    rank_env(rank, world, port)  # before the imports: DeepSpeed reads its accelerator as it loads
    import openrlhf_shims
    import transformers.integrations.deepspeed as hf_deepspeed

    # OpenRLHF 0.11.2 patches this ZeRO-3 loading helper for its pinned transformers 5.15; on
    # 5.24 (installed here) the helper is a generator and the patch fails: keep 5.24's own.
    hf_deepspeed._apply_weight_conversions_to_state_dict._openrlhf_patched = True
    openrlhf_shims.install()
    from hilore_actor.runtime.distributed import skip_cpu_shm_kernel

    skip_cpu_shm_kernel()
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)


def drop_in(rank, model_dir):
    """OpenRLHF's actor with its gradient checkpointing, then the drop-in (module docstring)."""
    import openrlhf.cli.train_ppo_ray as cli
    from openrlhf.trainer.ray.ppo_actor import PolicyModelActor
    from openrlhf.utils import get_strategy

    from hilore_actor.learner.coordinator import BudgetCoordinator
    from hilore_actor.openrlhf import policy_actor as pa
    from hilore_actor.openrlhf.train_ppo_ray import run_cli_main
    from hilore_actor.openrlhf.verify import experience

    cpu_stand_ins(pa)
    parsed = {}
    run_cli_main(cli, recipe(model_dir), train=lambda a: parsed.setdefault("args", a))
    args = parsed["args"]
    coordinator = BudgetCoordinator()
    pa._HiLoRePolicyModelActor._coordinator = staticmethod(lambda: coordinator)
    os.environ[pa.CONFIG_ENV] = json.dumps({"mode": "hilore-hr", "budget": "1.25", "profile_repeats": 1})
    exps = [experience(100 * rank + i, SAMPLES, P, A, VOCAB) for i in range(3)]  # each rank its own data
    seen = {}
    for name, cls in (("openrlhf-gc", PolicyModelActor), ("hilore", pa.HiLoRePolicyModelActor)):
        args.actor.gradient_checkpointing_enable = True  # the drop-in turns it off itself
        actor = cls.__ray_actor_class__.__new__(cls.__ray_actor_class__)
        torch.manual_seed(0)
        actor.init_model_from_pretrained(get_strategy(args), model_dir, max_steps=8)
        seen[name] = fits(actor, exps, alternate=name == "hilore")
        del actor
    pairs = list(zip(seen["openrlhf-gc"].pop("grads"), seen["hilore"].pop("grads")))
    seen["bitwise"] = [torch.equal(a, b) for a, b in pairs]
    seen["rel_err"] = [float((a - b).norm() / a.norm()) for a, b in pairs]
    seen["grad_norm"] = [float(a.norm()) for a, _ in pairs]
    return seen


def fits(actor, exps, alternate: bool):
    """One ``fit`` call per experience; the gradient as each optimizer step begins."""
    from deepspeed.utils import safe_get_full_grad

    from hilore_actor.openrlhf.patching import shadowed

    strategy, grads, actions, out = actor.strategy, [], [], {}
    real_step = strategy.optimizer_step
    engine = actor.actor.model

    def optimizer_step(*a, **k):
        if engine.is_gradient_accumulation_boundary():
            grads.append(
                torch.cat(
                    [safe_get_full_grad(p).float().flatten() for p in engine.module.parameters() if p.requires_grad]
                )
            )
        return real_step(*a, **k)

    for i, exp in enumerate(exps):
        actor.trainer.replay_buffer.clear()
        actor.trainer.replay_buffer.append(_with_info(exp))
        if alternate and i == 1:  # the second fit: an alternating H/R map instead of the plan's
            plan = actor.hilore.plan
            out["plan"] = {"budget": plan.budget, "plan": dict(plan.sp.plan), "counts": plan.info.get("plan")}
            out["units"] = actor.hilore.engine.unit_names
            sp = plan.sp
            sp.plan = {n: ("exact", "checkpoint")[j % 2] for j, n in enumerate(actor.hilore.engine.unit_names)}
        if alternate and i == 2 and torch.distributed.get_rank() == 0:  # the third: rank 0 alone plans all R
            plan = actor.hilore.plan
            all_r = copy.copy(plan.for_tokens(MICRO * (P + A)))
            all_r.plan = dict.fromkeys(all_r.plan, "checkpoint")
            plan.for_tokens = lambda tokens, sp=all_r: sp
        torch.manual_seed(1 + i)  # ppo_train's shuffle
        with shadowed(strategy, optimizer_step=optimizer_step):
            actor.fit(0.01)
        if getattr(actor, "hilore", None) is not None:
            actions.append(sorted(set(actor.hilore.last["actions"].values())))
    return dict(out, grads=grads, n_steps=len(grads), actions=actions)


def _with_info(exp):
    """The per-sample info OpenRLHF's experience maker fills (the replay buffer splits it)."""
    exp.info = {
        "reward": torch.zeros(exp.sequences.shape[0]),
        "response_length": exp.action_mask.sum(-1).float(),
        "total_length": exp.attention_mask.sum(-1).float(),
    }
    return exp
