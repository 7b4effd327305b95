"""HiLoRe's policy actor for OpenRLHF 0.11.2: a subclass of its ``PolicyModelActor``.

``PolicyModelActor`` is a Ray actor class; the subclass derives from the plain class under it
(``__ray_actor_class__``) and is made a Ray actor again with the same options. In
``init_model_from_pretrained`` it

1. turns OpenRLHF's gradient checkpointing off (the recovery engine decides per unit);
2. plans on the bare model just before OpenRLHF's ``strategy.prepare`` wraps it in
   DeepSpeed (``learner/plan.py``; ZeRO-2 only for now: under ZeRO-3 the model is
   partitioned at load), after moving it to the GPU (DeepSpeed's ``module.to`` would do it
   inside ``initialize``; OpenRLHF loads it on the CPU), and sizes ZeRO-2's reduce bucket to
   the trainable parameters (OpenRLHF's ``auto`` leaves DeepSpeed's 5e8 elements). The GPU
   is read there, not before: OpenRLHF's ``setup_distributed`` (inside its
   ``init_model_from_pretrained``) calls ``torch.cuda.set_device(LOCAL_RANK)`` first, and
   ``LOCAL_RANK`` is Ray's GPU id when ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`` is set;
3. lets OpenRLHF build everything else unchanged, then attaches the recovery engine to the
   DeepSpeed module and wraps the trainer's ``training_step`` (``training_step.py``), with
   peaks going to the shared budget coordinator (a named Ray actor);
4. with ``--hilore.chunked_head`` (default), gives the ``Actor`` a forward that never builds
   the full logits (``chunked_head.py``);
5. watches memory around each training step (``watch_memory``): after the first one, the
   resident bytes are measured again (ZeRO-2's gradient buckets and partitions and the
   optimizer state exist from the first backward and step on) and the plan rebased; each
   step's maximum allocated and reserved bytes go into OpenRLHF's metrics. The actor's process
   gets ``expandable_segments:True`` unless the user set allocator settings
   (``runtime.memory.default_allocator_settings``).

Runs only where OpenRLHF's trainer runs: on CUDA (``DeepspeedStrategy`` calls ``torch.cuda``).
"""
from __future__ import annotations

import json
import os
from functools import partial
from types import SimpleNamespace
from typing import Optional

import ray
import torch
from openrlhf.trainer.ray.ppo_actor import PolicyModelActor

from .patching import shadowed

CONFIG_ENV = "HILORE_OPENRLHF_CONFIG"
COORDINATOR_NAME = "hilore_budget_coordinator"


def hilore_settings() -> SimpleNamespace:
    """The ``--hilore.*`` settings the launcher put into the workers' environment."""
    from ..learner.settings import hilore_settings as with_defaults

    return with_defaults(**json.loads(os.environ.get(CONFIG_ENV, "{}")))


def current_cuda_device() -> torch.device:
    """The GPU OpenRLHF's strategy selected (``setup_distributed``'s ``set_device``)."""
    return torch.device("cuda", torch.cuda.current_device())


def planning_prepare(strategy, hcfg, device: Optional[torch.device], holder: dict):
    """``strategy.prepare`` that first plans the actor (its first model) on ``device``, the one
    DeepSpeed trains on (its ``module.to`` in ``initialize``; OpenRLHF loads on the CPU), and
    sizes ZeRO-2's reduce bucket to the trainable parameters (OpenRLHF's ``auto`` leaves
    DeepSpeed's 5e8 elements, 1 GB in bf16 in every backward). Later calls (the EMA or
    reference models) pass through. ``device`` None: the current CUDA device, read when
    ``prepare`` runs (after OpenRLHF set it). The plan lands in ``holder["plan"]``, the device
    in ``holder["device"]``."""
    from ..grpo.microbatch import microbatch_loss
    from ..learner.plan import plan_before_wrapping
    from ..learner.scope import estimate_resident

    args, real_prepare, given = strategy.args, strategy.prepare, device

    def prepare(*models, **kwargs):
        first = models[0][0] if isinstance(models[0], tuple) else models[0]
        if "plan" in holder:
            return real_prepare(*models, **kwargs)
        device = holder["device"] = given if given is not None else current_cuda_device()
        first.model.to(device)
        holder["plan"] = plan_before_wrapping(
            first.model, hcfg, backend="hilore", tokens=args.train.micro_batch_size * args.data.max_len,
            seqs_per_microbatch=args.train.micro_batch_size, group_size=args.rollout.n_samples_per_prompt,
            loss_options=dict(clip_eps_low=args.actor.eps_clip_low_high[0], clip_eps_high=args.actor.eps_clip_low_high[1],
                              kl_coef=args.algo.kl.init_coef if args.algo.kl.use_loss else 0.0,
                              kl_estimator=args.algo.kl.estimator),
            # B from gc as OpenRLHF runs it (full logits); the plan for the head the actor will run
            loss_fn=partial(microbatch_loss, chunked_head=hcfg.chunked_head), std_loss_fn=microbatch_loss,
            device=device, seed=args.train.seed,
            resident=estimate_resident(first.model, world=torch.distributed.get_world_size(),
                                       zero_stage=args.ds.zero_stage, mixed_precision=True),  # bf16/fp16 weights
            write_calibration=torch.distributed.get_rank() == 0, log=strategy.print)
        trainable = sum(p.numel() for p in first.model.parameters() if p.requires_grad)
        real_config = strategy.get_ds_train_config

        def train_config(*a, **k):
            cfg = real_config(*a, **k)
            cfg["zero_optimization"]["reduce_bucket_size"] = int(max(trainable, 2**20))
            return cfg

        with shadowed(strategy, get_ds_train_config=train_config):
            return real_prepare(*models, **kwargs)

    return prepare


def watch_memory(trainer, plan, device, model, register=None) -> None:
    """Wrap ``trainer.training_step`` (outside HiLoRe's own wrapper) with a ``MemoryMeter``.

    After the first step, the resident bytes are measured again and the plan rebased
    (``RankPlan.rebase``; only ever upwards): the measurement before it (``_attach``) saw no
    ZeRO-2 gradient buckets or partitions and no optimizer state yet; DeepSpeed allocates them
    in the first backward and step, and every later microbatch starts with them. A changed B
    goes to ``register`` (the coordinator). Each step's maximum allocated and reserved bytes
    (what an OOM follows) go into its metrics as ``hilore_max_{allocated,reserved}_gb``."""
    from ..learner.scope import resident_now
    from ..runtime.memory import MemoryMeter

    inner, state = trainer.training_step, {"warm": False}

    def training_step(*args, **kwargs):
        with MemoryMeter(device) as meter:
            result = inner(*args, **kwargs)
        if not state["warm"]:
            state["warm"] = True
            if plan.rebase(resident_now(device, model)) and register is not None:
                register(plan.budget)
        r = meter.report
        if isinstance(result, dict) and isinstance(result.get("metrics"), dict):
            for k, v in (("hilore_max_allocated_gb", r.max_allocated_bytes), ("hilore_max_reserved_gb", r.max_reserved_bytes)):
                result["metrics"][k] = v / 2**30
                if isinstance(result.get("weights"), dict):
                    result["weights"][k] = None
        return result

    trainer.training_step = training_step


class _HiLoRePolicyModelActor(PolicyModelActor.__ray_actor_class__):
    def __init__(self, *args, **kwargs):
        from ..runtime.memory import default_allocator_settings

        default_allocator_settings()  # before anything in this process starts CUDA
        super().__init__(*args, **kwargs)

    def init_model_from_pretrained(self, strategy, pretrain, max_steps=None, vllm_engines=None):
        args, hcfg = strategy.args, hilore_settings()
        if not torch.cuda.is_available():  # checked here, on the worker: the driver may be a CPU-only head node
            raise RuntimeError("--actor_backend hilore: this OpenRLHF actor has no CUDA device")
        if args.ds.zero_stage == 3:
            raise ValueError("--actor_backend hilore with OpenRLHF supports --ds.zero_stage 0-2 for now "
                             "(ZeRO-3 partitions the model at load, before HiLoRe can plan on it)")
        if args.actor.gradient_checkpointing_enable:
            strategy.print("[hilore] --actor.gradient_checkpointing_enable is replaced by HiLoRe's per-unit recompute")
            args.actor.gradient_checkpointing_enable = False
        holder = {}  # the device is read inside prepare: OpenRLHF's setup_distributed sets it first
        with shadowed(strategy, prepare=planning_prepare(strategy, hcfg, None, holder)):
            super().init_model_from_pretrained(strategy, pretrain, max_steps, vllm_engines)
        self._attach(strategy, hcfg, holder["plan"], holder["device"])

    def _attach(self, strategy, hcfg, plan, device) -> None:
        """The recovery engine, the coordinator and the step wrappers, once OpenRLHF built the trainer."""
        from ..recovery import RecoveryEngine
        from ..recovery.state import codec_levels
        from ..learner.coordinator import BudgetCoordinator
        from ..learner.scope import resident_now
        from .training_step import HiLoReTrainingStep

        plan.rebase(resident_now(device, self.actor.model))
        engine = RecoveryEngine(self.actor.model, codec=codec_levels(hcfg.codec)[0])
        coordinator = ray.remote(BudgetCoordinator).options(name=COORDINATOR_NAME, get_if_exists=True, num_cpus=0).remote()
        rank = torch.distributed.get_rank()
        ray.get(coordinator.register.remote(rank, plan.budget))
        self.hilore = HiLoReTrainingStep(plan, engine, coordinator, rank, device=device)
        self.hilore.install(self.trainer)
        watch_memory(self.trainer, plan, device, self.actor.model,
                     register=lambda b: ray.get(coordinator.register.remote(rank, b)))
        if hcfg.chunked_head:
            from .chunked_head import install

            install(self.actor)
        strategy.print(f"[hilore] rank {rank}: B = {plan.budget / 2**30:.2f} GiB, plan {plan.info.get('plan')}")


HiLoRePolicyModelActor = ray.remote(num_gpus=1)(_HiLoRePolicyModelActor)
