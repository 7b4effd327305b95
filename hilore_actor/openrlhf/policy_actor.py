"""HiLoRe's policy actor for OpenRLHF 0.11.2: a subclass of its ``PolicyModelActor``.

``PolicyModelActor`` is a Ray actor class; the subclass derives from the plain class under it
(``__ray_actor_class__``) and is made a Ray actor again with the same options.

In ``init_model_from_pretrained`` it turns OpenRLHF's gradient checkpointing off (the recovery
engine decides per unit) and sizes ZeRO's reduce bucket to the trainable parameters inside
``strategy.prepare`` (OpenRLHF's ``auto`` leaves DeepSpeed's 5e8 elements, 1 GB in bf16 in
every backward). Everything else OpenRLHF builds unchanged: under ZeRO-3 the model is
partitioned at load (``HfDeepSpeedConfig``), and with ``--ds.enable_sleep`` its DeepSpeed
states go to the CPU before this method returns.

So HiLoRe plans at the first ``fit`` (``plan_wrapped``), on the DeepSpeed-wrapped model, where
training will run: OpenRLHF's ``ppo_train`` has reloaded the states it offloaded, a colocated
vLLM sleeps (``samples_generator``: wake, generate, sleep), the critic is offloaded, and every
rank enters ``fit`` together. Planning then runs

- on ``engine.module`` (ZeRO-3's gather hooks live on the module; calling the engine would
  start DeepSpeed's backward bookkeeping, so the first real microbatch would accumulate into
  a stale gradient partition), with every rank in lockstep (``learner/lockstep.py``: rank 0
  decides, the others replay each pass, so ZeRO-3's all-gathers match), one budget and plan;
- with ``torch.autograd.grad`` as its backward: DeepSpeed's gradient reduction hooks are
  post-accumulate hooks, which it never fires, so no planning gradient reaches an update;
  the gradients it returns are the trainable parameters' whole ones (a planning pass holds
  them at the end of its backward, where ZeRO would have reduce-scattered them: with LoRA a
  few MB; with full fine-tuning, B and the plan are conservative by that much);
- with B counting what the rank holds now (``resident_now``: on CUDA the allocator's count),
  and ``--hilore.budget auto`` reading the device's free memory while vLLM sleeps.

Then the recovery engine is attached to the DeepSpeed module and the trainer's
``training_step`` wrapped (``training_step.py``), peaks going to the shared budget
coordinator (a named Ray actor); where ``--hilore.skip_zero_advantage`` resolves on for the
recipe, the trainer's ``ppo_train`` leaves out the responses with advantage 0 (``skip.py``).
With ``--hilore.chunked_head`` (default; not under ZeRO-3, whose head weight is partitioned
outside the head's own forward) the ``Actor`` gets a forward that never builds the full logits
(``chunked_head.py``). ``watch_memory`` rebases B once after the first step (ZeRO's buckets and
partitions exist from the first backward on) and puts each step's maximum allocated and reserved
bytes into OpenRLHF's metrics.

Allocator settings (``allocator_settings``): the actor's process gets ``expandable_segments:True``
unless the user set allocator settings or its weights go to vLLM by CUDA IPC
(``weights_via_cuda_ipc``: ``--train.colocate_all``, the NCCL sync backend, not async). There
OpenRLHF's ``broadcast_to_vllm`` exports a clone of each weight with ``reduce_tensor``; torch
exports expandable-segment memory through ``pidfd_getfd``, which unprivileged containers and
Yama (``ptrace_scope`` 1, between sibling Ray workers) refuse, so the first sync after ``fit``
would fail. Without expandable segments, free space trapped in partly used segments counts
against B (``learner/microbatch_run.py``).

Runs only where OpenRLHF's trainer runs: on CUDA (``DeepspeedStrategy`` calls ``torch.cuda``).
"""

from __future__ import annotations

import contextlib
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


def weights_via_cuda_ipc(args) -> bool:
    """Whether OpenRLHF 0.11.2 sends the actor's weights to vLLM by CUDA IPC: its
    ``ActorPPOTrainer.__init__`` sets ``use_cuda_ipc`` so. Read here, before the trainer exists
    and before CUDA starts (the allocator settings must be known by then)."""
    backend, train = getattr(getattr(args, "vllm", None), "sync_backend", "nccl"), getattr(args, "train", None)
    colocated, async_ = getattr(train, "colocate_all", False), getattr(train, "async_enable", False)
    return backend == "nccl" and bool(colocated) and not async_


def allocator_settings(args) -> str:
    """Apply the actor's allocator settings for the recipe ``args`` (module docstring); returns a
    line for the log, or "" when there is nothing to say."""
    from ..runtime.memory import ALLOC_CONF_VARS, default_allocator_settings, expandable_segments_chosen

    if not weights_via_cuda_ipc(args):
        default_allocator_settings()
        return ""
    why = "--train.colocate_all sends the actor's weights to vLLM by CUDA IPC"
    if expandable_segments_chosen():
        return (
            f"[hilore] warning: your allocator settings turn expandable segments on, and {why}: exporting that "
            "memory needs pidfd_getfd, which containers and Yama ptrace_scope 1 refuse; if the weight sync fails, "
            "unset expandable_segments"
        )
    if any(k in os.environ for k in ALLOC_CONF_VARS):
        return ""  # the user's settings, without expandable segments
    return f"[hilore] allocator: expandable segments left off ({why}, which cannot export such memory)"


def current_cuda_device() -> torch.device:
    """The GPU OpenRLHF's strategy selected (``setup_distributed``'s ``set_device``)."""
    return torch.device("cuda", torch.cuda.current_device())


def has_cuda() -> bool:
    """Whether this worker has a CUDA device (the tests' CPU ranks stand in for one)."""
    return torch.cuda.is_available()


def trainable_count(model) -> int:
    """Trainable elements, also of ZeRO-3-partitioned parameters (``ds_numel``)."""
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters() if p.requires_grad)


def bucket_prepare(strategy):
    """``strategy.prepare`` that sizes ZeRO's reduce bucket to the actor's trainable parameters
    (its first call; OpenRLHF's ``auto`` leaves DeepSpeed's 5e8 elements, 1 GB in bf16 in every
    backward). Later calls (EMA, reference) pass through."""
    real_prepare, done = strategy.prepare, []

    def prepare(*models, **kwargs):
        if done:
            return real_prepare(*models, **kwargs)
        done.append(True)
        first = models[0][0] if isinstance(models[0], tuple) else models[0]
        trainable, real_config = trainable_count(first.model), strategy.get_ds_train_config

        def train_config(*a, **k):
            cfg = real_config(*a, **k)
            cfg["zero_optimization"]["reduce_bucket_size"] = int(max(trainable, 2**20))
            return cfg

        with shadowed(strategy, get_ds_train_config=train_config):
            return real_prepare(*models, **kwargs)

    return prepare


def microbatch_shape(args):
    """(tokens, sequences) of the largest microbatch the recipe trains on: with
    ``--train.dynamic_batch_enable`` OpenRLHF fills microbatches up to
    ``--train.max_tokens_per_gpu`` tokens, else ``--train.micro_batch_size`` sequences of up to
    ``--data.max_len``."""
    if getattr(args.train, "dynamic_batch_enable", False):
        tokens = int(args.train.max_tokens_per_gpu)
        return tokens, max(1, tokens // int(args.data.max_len))
    return args.train.micro_batch_size * args.data.max_len, args.train.micro_batch_size


def plan_wrapped(actor, strategy, hcfg, device):
    """Plan on the DeepSpeed-wrapped ``actor`` (OpenRLHF's ``Actor``, its ``model`` the engine),
    every rank in lockstep (see the module docstring), on a microbatch of ``--hilore.plan_tokens``
    tokens, else the recipe's largest (``microbatch_shape``). Returns the ``RankPlanner``."""
    from ..grpo.microbatch import microbatch_loss
    from ..learner.plan import plan_in_lockstep
    from ..learner.scope import resident_now

    args, engine = strategy.args, actor.model
    module = engine.module
    params = [p for p in module.parameters() if p.requires_grad]
    zero3 = args.ds.zero_stage == 3
    tokens, seqs = microbatch_shape(args)
    tokens = hcfg.plan_tokens or tokens  # --hilore.plan_tokens, as the job and verl take it; else the recipe's largest
    plan = plan_in_lockstep(
        module,
        hcfg,
        backend="hilore",
        tokens=tokens,
        seqs_per_microbatch=seqs,
        group_size=args.rollout.n_samples_per_prompt,
        loss_options=dict(
            clip_eps_low=args.actor.eps_clip_low_high[0],
            clip_eps_high=args.actor.eps_clip_low_high[1],
            kl_coef=args.algo.kl.init_coef if args.algo.kl.use_loss else 0.0,
            kl_estimator=args.algo.kl.estimator,
        ),
        # B from gc as OpenRLHF runs it (full logits); the plan for the head the actor will run
        loss_fn=partial(microbatch_loss, chunked_head=hcfg.chunked_head and not zero3),
        std_loss_fn=microbatch_loss,
        device=device,
        seed=args.train.seed,
        resident=resident_now(device, module, engine.optimizer, persistent_to_come=True),
        write_calibration=torch.distributed.get_rank() == 0,
        log=strategy.print,
        backward=lambda loss: torch.autograd.grad(loss, params, allow_unused=True),
    )
    if zero3:  # weights gathered for modules without a gradient input stay gathered until an epilogue
        engine.optimizer.parameter_offload.release_backward_leftovers()
        engine.empty_partition_cache()
        # an MoE leaf module's full backward hook reduces even under autograd.grad: the first
        # real microbatch then writes its gradient partitions afresh (micro_step_id 0)
        engine.optimizer.zero_grad(set_to_none=True)
    return plan


def watch_memory(trainer, plan, device, model, register=None) -> None:
    """Wrap ``trainer.training_step`` (outside HiLoRe's own wrapper) with a ``MemoryMeter``.

    After the first step, the resident bytes are measured again and the plan rebased
    (``RankPlanner.rebase``; only ever upwards): the measurement before it (``_attach``) saw no
    ZeRO-2 gradient buckets or partitions and no optimizer state yet; DeepSpeed allocates them
    in the first backward and step, and every later microbatch starts with them. A changed B
    goes to ``register`` (the coordinator). Each step's maximum allocated and reserved bytes
    (what an OOM follows) go into its metrics as ``hilore_max_{allocated,reserved}_gb``."""
    from ..learner.scope import resident_now
    from ..runtime.memory import MemoryMeter

    inner, state = trainer.training_step, {"warm": False}

    def training_step(*args, **kwargs):
        # on the CPU (tests) the meter is the torch profiler, which the microbatch's own meter
        # (learner/microbatch_run.py) already runs: no outer one there
        meter = MemoryMeter(device) if torch.device(device).type == "cuda" else None
        with meter if meter is not None else contextlib.nullcontext():
            result = inner(*args, **kwargs)
        if not state["warm"]:
            state["warm"] = True
            if plan.rebase(resident_now(device, model, persistent_to_come=True)) and register is not None:
                register(plan.budget)
        r = meter.report if meter is not None else None
        if r is not None and isinstance(result, dict) and isinstance(result.get("metrics"), dict):
            for k, v in (
                ("hilore_max_allocated_gb", r.max_allocated_bytes),
                ("hilore_max_reserved_gb", r.max_reserved_bytes),
            ):
                result["metrics"][k] = v / 2**30
                if isinstance(result.get("weights"), dict):
                    result["weights"][k] = None
        return result

    trainer.training_step = training_step


class _HiLoRePolicyModelActor(PolicyModelActor.__ray_actor_class__):
    def init_model_from_pretrained(self, strategy, pretrain, max_steps=None, vllm_engines=None):
        args = strategy.args
        if not has_cuda():  # checked here, on the worker: the driver may be a CPU-only head node
            raise RuntimeError("--actor_backend hilore: this OpenRLHF actor has no CUDA device")
        # before OpenRLHF's _setup_distributed starts CUDA; the recipe is known from here on
        line = allocator_settings(args)
        if line and getattr(self, "_rank", 0) == 0:  # strategy.print prints on every rank before dist starts
            strategy.print(line)
        if args.actor.gradient_checkpointing_enable:
            strategy.print("[hilore] --actor.gradient_checkpointing_enable is replaced by HiLoRe's per-unit recompute")
            args.actor.gradient_checkpointing_enable = False
        with shadowed(strategy, prepare=bucket_prepare(strategy)):
            super().init_model_from_pretrained(strategy, pretrain, max_steps, vllm_engines)
        self.hilore = None  # planned at the first fit (module docstring)

    def fit(self, kl_ctl: float = 0):
        self.plan_and_attach()
        return super().fit(kl_ctl)

    def plan_and_attach(self) -> None:
        """Plan on the wrapped model and attach HiLoRe, once; every rank calls it together
        (the first ``fit`` does, see the module docstring)."""
        if self.hilore is not None:
            return
        torch.cuda.empty_cache()  # what the experience pass left, as OpenRLHF's fit does first
        self.actor.train()
        hcfg, device = hilore_settings(), current_cuda_device()  # after OpenRLHF's set_device
        # planning seeds its passes; the training that follows keeps its own random state
        # (ppo_train's shuffle draws from it)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            plan = plan_wrapped(self.actor, self.strategy, hcfg, device)
        self._attach(self.strategy, hcfg, plan, device)

    def _attach(self, strategy, hcfg, plan, device) -> None:
        """The recovery engine, the coordinator and the step wrappers, once OpenRLHF built the trainer."""
        from ..learner.coordinator import call
        from ..learner.plan import make_engine
        from .skip import ZeroAdvantageSkip, resolve
        from .training_step import HiLoReTrainingStep

        engine = make_engine(self.actor.model, hcfg)
        coordinator = self._coordinator()
        rank = torch.distributed.get_rank()
        call(coordinator.register, rank, plan.budget)
        self.hilore = HiLoReTrainingStep(plan, engine, coordinator, rank, device=device)
        self.hilore.install(self.trainer)
        watch_memory(
            self.trainer, plan, device, self.actor.model, register=lambda b: call(coordinator.register, rank, b)
        )
        if hcfg.chunked_head and strategy.args.ds.zero_stage < 3:
            from .actor_forward import install

            install(self.actor)
        if resolve(hcfg.skip_zero_advantage, strategy.args):  # the recipe is authoritative (the launcher checked)
            self.hilore.skip = ZeroAdvantageSkip(self.trainer).install()
        skipping = ", responses with advantage 0 skipped" if self.hilore.skip is not None else ""
        strategy.print(
            f"[hilore] rank {rank}: B = {plan.budget / 2**30:.2f} GiB, plan {plan.info.get('plan')}{skipping}"
        )

    @staticmethod
    def _coordinator():
        """The budget coordinator every rank shares (a named Ray actor)."""
        from ..learner.coordinator import BudgetCoordinator

        return ray.remote(BudgetCoordinator).options(name=COORDINATOR_NAME, get_if_exists=True, num_cpus=0).remote()


HiLoRePolicyModelActor = ray.remote(num_gpus=1)(_HiLoRePolicyModelActor)
