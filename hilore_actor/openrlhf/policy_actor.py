"""HiLoRe's policy actor for OpenRLHF 0.11.2: a subclass of its ``PolicyModelActor``.

``PolicyModelActor`` is a Ray actor class; the subclass derives from the plain class under it
(``__ray_actor_class__``) and is made a Ray actor again with the same options. In
``init_model_from_pretrained`` it

1. turns OpenRLHF's gradient checkpointing off (the recovery engine decides per unit);
2. plans on the bare model just before OpenRLHF's ``strategy.prepare`` wraps it in
   DeepSpeed (``learner/plan.py``; ZeRO-2 only for now: under ZeRO-3 the model is
   partitioned at load), after moving it to the GPU (DeepSpeed's ``module.to`` would do it
   inside ``initialize``; OpenRLHF loads it on the CPU), and sizes ZeRO-2's reduce bucket to
   the trainable parameters (OpenRLHF's ``auto`` leaves DeepSpeed's 5e8 elements);
3. lets OpenRLHF build everything else unchanged, then attaches the recovery engine to the
   DeepSpeed module and wraps the trainer's ``training_step`` (``training_step.py``), with
   peaks going to the shared budget coordinator (a named Ray actor);
4. with ``--hilore.chunked_head`` (default), gives the ``Actor`` a forward that never builds
   the full logits (``chunked_head.py``).

Runs only where OpenRLHF's trainer runs: on CUDA (``DeepspeedStrategy`` calls ``torch.cuda``).
"""
from __future__ import annotations

import json
import os
from functools import partial
from types import SimpleNamespace

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


def planning_prepare(strategy, hcfg, device: torch.device, holder: dict):
    """``strategy.prepare`` that first plans the actor (its first model) on ``device``, the one
    DeepSpeed trains on (its ``module.to`` in ``initialize``; OpenRLHF loads on the CPU), and
    sizes ZeRO-2's reduce bucket to the trainable parameters (OpenRLHF's ``auto`` leaves
    DeepSpeed's 5e8 elements, 1 GB in bf16 in every backward). Later calls (the EMA or
    reference models) pass through. The plan lands in ``holder["plan"]``."""
    from ..grpo.microbatch import microbatch_loss
    from ..learner.plan import plan_before_wrapping
    from ..learner.scope import estimate_resident

    args, real_prepare = strategy.args, strategy.prepare

    def prepare(*models, **kwargs):
        first = models[0][0] if isinstance(models[0], tuple) else models[0]
        if "plan" in holder:
            return real_prepare(*models, **kwargs)
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


class _HiLoRePolicyModelActor(PolicyModelActor.__ray_actor_class__):
    def init_model_from_pretrained(self, strategy, pretrain, max_steps=None, vllm_engines=None):
        from ..recovery import RecoveryEngine
        from ..recovery.state import codec_levels
        from ..learner.coordinator import BudgetCoordinator
        from ..learner.scope import resident_now
        from .training_step import HiLoReTrainingStep

        args, hcfg = strategy.args, hilore_settings()
        if not torch.cuda.is_available():  # checked here, on the worker: the driver may be a CPU-only head node
            raise RuntimeError("--actor_backend hilore: this OpenRLHF actor has no CUDA device")
        if args.ds.zero_stage == 3:
            raise ValueError("--actor_backend hilore with OpenRLHF supports --ds.zero_stage 0-2 for now "
                             "(ZeRO-3 partitions the model at load, before HiLoRe can plan on it)")
        if args.actor.gradient_checkpointing_enable:
            strategy.print("[hilore] --actor.gradient_checkpointing_enable is replaced by HiLoRe's per-unit recompute")
            args.actor.gradient_checkpointing_enable = False
        holder, device = {}, torch.device("cuda", torch.cuda.current_device())
        prepare = planning_prepare(strategy, hcfg, device, holder)
        with shadowed(strategy, prepare=prepare):
            super().init_model_from_pretrained(strategy, pretrain, max_steps, vllm_engines)
        plan = holder["plan"]
        plan.rebase(resident_now(device, self.actor.model))
        engine = RecoveryEngine(self.actor.model, codec=codec_levels(hcfg.codec)[0])
        coordinator = ray.remote(BudgetCoordinator).options(name=COORDINATOR_NAME, get_if_exists=True, num_cpus=0).remote()
        rank = torch.distributed.get_rank()
        ray.get(coordinator.register.remote(rank, plan.budget))
        self.hilore = HiLoReTrainingStep(plan, engine, coordinator, rank)
        self.hilore.install(self.trainer)
        if hcfg.chunked_head:
            from .chunked_head import install

            install(self.actor)
        strategy.print(f"[hilore] rank {rank}: B = {plan.budget / 2**30:.2f} GiB, plan {plan.info.get('plan')}")


HiLoRePolicyModelActor = ray.remote(num_gpus=1)(_HiLoRePolicyModelActor)
