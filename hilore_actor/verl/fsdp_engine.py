"""HiLoRe's actor engine for verl 0.9.1: a subclass of its FSDP engine under backend ``hilore``.

verl picks the actor's engine from ``EngineRegistry`` by ``actor_rollout_ref.actor.strategy``
(``TrainingWorker.__init__``), so HiLoRe is a new backend key, not a patch: the engine is
``FSDPEngineWithLMHead`` with

1. the FSDP version it wraps with restored into its config (verl branches on the strategy
   string when it wraps the model), so FSDP2 (default) or FSDP1 runs as verl runs it;
2. HF gradient checkpointing and verl's activation offload left off on the training engine (the
   recovery engine decides per unit; the launcher turns both off already, verl's own ``main_ppo``
   under the patch may not); the reference model, built on the same backend with
   ``forward_only``, is verl's;
3. after verl has built and wrapped the model: B and the plan (``learner/plan.py``, on the
   wrapped model, rank 0 leading the others: ``learner/lockstep.py``), the recovery engine on
   it, and the budget
   coordinator (a named Ray actor, when Ray runs the worker); under Ulysses sequence
   parallelism every rank of an SP group takes one action per unit per micro-batch (``attach.py``);
4. ``forward_backward_batch`` and ``forward_step`` as verl's, each micro-batch inside a learner
   microbatch (``microbatches.py``) that opens in ``forward_step`` and closes as verl's
   per-micro-batch gradient-sync context exits, i.e. after its backward and after the
   ``record_function("micro_batch<i>")`` that verl opens inside that context. The order
   matters on CPU, where the microbatch's meter is a torch profiler: a profiler stopped and
   freed inside a ``record_function`` that began while it ran leaves that scope's end to write
   into the freed profiler (a heap corruption that surfaced later as a segfault in the
   collector or a glibc abort).

Why a backend key rather than verl's other hooks (docs/DESIGN.md section 9): it is opt-in per
role, it fails loudly when the plugin is missing (verl: ``Unknown backend``), and it keeps
verl's worker, loss and trainer untouched; a loss registered with ``register_policy_loss`` sees
no forward, and a patched ``FSDPEngine`` would reach the critic too.
"""

from __future__ import annotations

import contextlib

import torch
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

from .settings import PREFIX, from_env
from .stops import NEEDS_CUDA

BACKEND = "hilore"


def _need_device() -> None:
    """In the worker (the driver may have no GPU): verl falls back to "cuda" when it finds no
    accelerator, and its FSDP engine would then fail deep inside model building."""
    from verl.utils.device import get_device_name

    device = get_device_name()
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"{NEEDS_CUDA} in each actor worker, and this worker has none: give the actor GPUs "
            f"(trainer.n_gpus_per_node) or run without +{PREFIX}enable=true"
        )


class HiLoReFSDPEngine(FSDPEngineWithLMHead):
    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config):
        self.hilore_cfg, self.hilore_job = from_env()
        self.hilore = None  # the training engine's Microbatches, once initialized
        self._skip = None  # the zero-advantage skip, resolved at the first training mini-batch
        _need_device()
        object.__setattr__(engine_config, "strategy", self.hilore_job.get("fsdp", "fsdp2"))
        if not engine_config.forward_only and getattr(model_config, "enable_activation_offload", False):
            # the launcher turns it off; verl's own main_ppo (the patch) may not: its hooks would
            # take the saved tensors from HiLoRe's (main_ppo.REPLACED)
            print(
                "[hilore] actor_rollout_ref.model.enable_activation_offload=true is turned off: HiLoRe's plan "
                "decides per unit what is kept, compressed or recomputed",
                flush=True,
            )
            object.__setattr__(model_config, "enable_activation_offload", False)
        super().__init__(model_config, engine_config, optimizer_config, checkpoint_config)

    def _build_module(self):
        module = super()._build_module()
        if not self.engine_config.forward_only and getattr(module, "is_gradient_checkpointing", False):
            module.gradient_checkpointing_disable()  # HiLoRe's recovery engine decides per unit
        return module

    def initialize(self):
        super().initialize()
        if not self.engine_config.forward_only:
            from .attach import attach

            # As verl trains: with param_offload, verl's initialize leaves the parameters (and
            # optimizer) on the CPU and train_mode() loads them, so planning's passes, gathers and
            # resident bytes are the device's; on exit verl zeroes the grads and offloads again.
            with self.train_mode():
                self.hilore = attach(self)

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        if forward_only or self.hilore is None:
            return super().forward_backward_batch(data, loss_function, forward_only)
        overrides, skipped = {}, None
        if self._skips(data, loss_function):
            from verl.utils.device import get_device_id

            from .skip import skip_batch

            group, sp = self.get_data_parallel_group(), self.ulysses_sequence_parallel_size
            data, overrides, skipped = skip_batch(data, group, get_device_id(), sp)
        with self.hilore.batch(overrides, skipped) as wrap:
            return super().forward_backward_batch(data, wrap(loss_function), forward_only)

    def _skips(self, data, loss_function) -> bool:
        """Whether this mini-batch leaves its zero-advantage responses out (``skip.py``): the
        setting resolved once against the worker's loss; never when the caller wants the model
        output of every response back."""
        if self._skip is None:
            from .skip import resolve

            self._skip = resolve(self.hilore_cfg.skip_zero_advantage, loss_function)
        from verl.utils import tensordict_utils as tu

        return self._skip and not tu.get_non_tensor_data(data=data, key="return_model_output", default=False)

    @contextlib.contextmanager
    def _gradient_sync_context(self, *, is_last_micro_batch: bool):
        """verl's, then the micro-batch's learner microbatch closes (see the module docstring)."""
        try:
            with super()._gradient_sync_context(is_last_micro_batch=is_last_micro_batch):
                yield
        finally:
            if self.hilore is not None and self.hilore.active:
                self.hilore.close()

    def forward_step(self, micro_batch, loss_function, forward_only):
        if not forward_only and self.hilore is not None and self.hilore.active:
            self.hilore.open(micro_batch)
        return super().forward_step(micro_batch, loss_function, forward_only)


def register() -> None:
    """Register the engine under ``BACKEND`` for CUDA (and NPU-free CPU tests pass ``devices``);
    idempotent: verl's registry asserts on a second registration of a key."""
    register_for(("cuda",))


def register_for(devices) -> None:
    from verl.workers.engine import EngineRegistry

    have = EngineRegistry._engines.get("language_model", {}).get(BACKEND, {})
    todo = [d for d in devices if d not in have]
    if todo:
        EngineRegistry.register(model_type="language_model", backend=BACKEND, device=list(todo))(HiLoReFSDPEngine)
