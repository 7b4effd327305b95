"""Plan and attach HiLoRe to a verl FSDP engine that verl has just built (``engine.py``, step 3).

The plan is made on the wrapped model, under the autocast verl trains with, with synthetic GRPO
microbatches of the planning size (``learner/plan.py``), by rank 0 while the other FSDP ranks
replay its passes (``learner/lockstep.py``): B from gc with verl's full-logits head
(what verl's own gradient checkpointing needs), the plan for the same head. The planning size is
``+actor_rollout_ref.actor.hilore.plan_tokens``, else what the launcher read from the data
config (micro-batch x longest sequence), else verl's ``max_token_len_per_gpu`` under dynamic
batch sizes.
"""
from __future__ import annotations

import contextlib

import torch

from .settings import PREFIX

COORDINATOR_NAME = "hilore_verl_budget_coordinator"


def _device() -> torch.device:
    from verl.utils.device import get_device_id, get_device_name

    name = get_device_name()
    return torch.device(name, get_device_id()) if name != "cpu" else torch.device("cpu")


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def resident_bytes(fsdp_engine, device: torch.device) -> int:
    """What the rank holds between micro-batches (``scope.resident_now``: DTensors count their shard)."""
    from ..learner.scope import resident_now

    return resident_now(device, fsdp_engine.module, getattr(fsdp_engine, "optimizer", None))


def estimate_resident_local(module) -> int:
    """This rank's weights and buffers, plus per trainable parameter its gradient and AdamW's two
    float32 moments, all over the rank's FSDP shards (verl keeps float32 master weights)."""
    params = [_local(p) for p in module.parameters()]
    trainable = [_local(p) for p in module.parameters() if p.requires_grad]
    weights = sum(t.numel() * t.element_size() for t in params + [_local(b) for b in module.buffers()])
    return int(weights + sum(t.numel() * (t.element_size() + 8) for t in trainable))


def planning_tokens(hcfg, job, engine_config) -> int:
    tokens = hcfg.plan_tokens or job.get("plan_tokens")
    if not tokens and engine_config.use_dynamic_bsz:
        tokens = engine_config.max_token_len_per_gpu
    if not tokens:
        raise ValueError(f"HiLoRe needs the planning microbatch's size: set +{PREFIX}plan_tokens=N (the launcher "
                         "sets it from data.max_prompt_length + data.max_response_length)")
    return int(tokens)


def attach(fsdp_engine):
    """The training engine's ``Microbatches``: plan, recovery engine, coordinator."""
    from ..grpo.microbatch import microbatch_loss
    from ..learner.plan import plan_in_lockstep
    from ..recovery import RecoveryEngine
    from ..recovery.state import codec_levels
    from .microbatches import Microbatches

    hcfg, job, ec = fsdp_engine.hilore_cfg, fsdp_engine.hilore_job, fsdp_engine.engine_config
    device, model = _device(), fsdp_engine.module
    rank = torch.distributed.get_rank()
    dtype = getattr(fsdp_engine, "_autocast_dtype", torch.float32)
    autocast = (contextlib.nullcontext() if dtype == torch.float32
                else torch.autocast(device_type=device.type, dtype=dtype))
    with autocast:
        plan = plan_in_lockstep(
            model, hcfg, backend="hilore", tokens=planning_tokens(hcfg, job, ec),
            seqs_per_microbatch=int(job.get("seqs_per_microbatch") or ec.micro_batch_size_per_gpu or 1),
            group_size=int(job.get("group_size", 8)), loss_options=dict(job.get("loss_options", {})),
            loss_fn=microbatch_loss, std_loss_fn=microbatch_loss, device=device, seed=int(ec.seed or 0),
            resident=estimate_resident_local(model),
            write_calibration=rank == 0, log=print)
    plan.rebase(resident_bytes(fsdp_engine, device))
    engine = RecoveryEngine(model, codec=codec_levels(hcfg.codec)[0])
    coordinator = None
    try:
        import ray

        if ray.is_initialized():
            from ..learner.coordinator import BudgetCoordinator

            coordinator = ray.remote(BudgetCoordinator).options(
                name=COORDINATOR_NAME, get_if_exists=True, num_cpus=0).remote()
            ray.get(coordinator.register.remote(rank, plan.budget))
    except ImportError:
        pass
    print(f"[hilore] verl rank {rank}: B = {plan.budget / 2**20:.1f} MiB, plan {plan.info.get('plan')}")
    return Microbatches(plan, engine, device, coordinator, rank, resident=lambda: resident_bytes(fsdp_engine, device))
