"""Plan and attach HiLoRe to a verl FSDP engine that verl has just built (``fsdp_engine.py``, step 3).

The plan is made on the wrapped model, under the autocast verl trains with, with synthetic GRPO
microbatches of the planning size (``learner/plan.py``), by rank 0 while the other FSDP ranks
replay its passes (``learner/lockstep.py``): B from gc with verl's full-logits head
(what verl's own gradient checkpointing needs), the plan for the same head. The planning size is
``+actor_rollout_ref.actor.hilore.plan_tokens``, else what the launcher read from the data
config (micro-batch x longest sequence), else verl's ``max_token_len_per_gpu`` under dynamic
batch sizes.

Under Ulysses sequence parallelism (``ulysses_sequence_parallel_size`` = sp > 1) each rank of
an SP group holds one slice of the packed sequence, and verl's attention trades it for a share
of the heads by all-to-all (``verl.models.transformers.monkey_patch``). A unit recomputed on one
rank and stored on another would leave the first in an all-to-all the second skips, so:

- planning passes run with verl's SP group unset (attention does no all-to-all: each rank is a
  whole model on its own tokens) on ``ceil(tokens / sp)`` tokens, a rank's share; FSDP's
  collectives keep them in lockstep as without SP, and every rank adopts rank 0's plan;
- the resident bytes that rebase B are the group's largest, so B and the plan stay one;
- per microbatch (``UlyssesMicrobatches``): the plan is sized to the rank's share of the tokens,
  the online choice sees each unit's token norms gathered over the group (omega is whole on
  every rank: verl gathers the log-probs), so every rank solves the same problem, and the
  group's first rank's answer is the group's; the measured peak that ``observe`` and the
  coordinator see is the group's largest, so later plans and ``tighten`` stay one too.
"""

from __future__ import annotations

import contextlib

from types import SimpleNamespace

import torch

from ..learner.lockstep import agree_max, agree_object
from .microbatches import Microbatches
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
        raise ValueError(
            f"HiLoRe needs the planning microbatch's size: set +{PREFIX}plan_tokens=N (the launcher "
            "sets it from data.max_prompt_length + data.max_response_length)"
        )
    return int(tokens)


def sp_size(fsdp_engine) -> int:
    return int(getattr(fsdp_engine, "ulysses_sequence_parallel_size", 1) or 1)


@contextlib.contextmanager
def without_sp_group():
    """verl's Ulysses group unset inside the block (planning's rank-local passes)."""
    from verl.utils.ulysses import get_ulysses_sequence_parallel_group, set_ulysses_sequence_parallel_group

    previous = get_ulysses_sequence_parallel_group()
    set_ulysses_sequence_parallel_group(None)
    try:
        yield
    finally:
        set_ulysses_sequence_parallel_group(previous)


def attach(fsdp_engine):
    """The training engine's ``Microbatches``: plan, recovery engine, coordinator."""
    from ..grpo.microbatch import microbatch_loss
    from ..learner.plan import make_engine, plan_in_lockstep

    hcfg, job, ec = fsdp_engine.hilore_cfg, fsdp_engine.hilore_job, fsdp_engine.engine_config
    device, model = _device(), fsdp_engine.module
    rank, sp = torch.distributed.get_rank(), sp_size(fsdp_engine)
    group = fsdp_engine.ulysses_parallel_group if sp > 1 else None
    dtype = getattr(fsdp_engine, "_autocast_dtype", torch.float32)
    autocast = (
        contextlib.nullcontext() if dtype == torch.float32 else torch.autocast(device_type=device.type, dtype=dtype)
    )
    with autocast, without_sp_group():
        plan = plan_in_lockstep(
            model,
            hcfg,
            backend="hilore",
            tokens=-(-planning_tokens(hcfg, job, ec) // sp),
            seqs_per_microbatch=int(job.get("seqs_per_microbatch") or ec.micro_batch_size_per_gpu or 1),
            group_size=int(job.get("group_size", 8)),
            loss_options=dict(job.get("loss_options", {})),
            loss_fn=microbatch_loss,
            std_loss_fn=microbatch_loss,
            device=device,
            seed=int(ec.seed or 0),
            resident=estimate_resident_local(model),
            write_calibration=rank == 0,
            log=print,
        )
    resident = resident_bytes(fsdp_engine, device)
    plan.rebase(resident if group is None else agree_max([resident], group, device)[0])
    engine = make_engine(model, hcfg)
    coordinator = None
    try:
        import ray

        if ray.is_initialized():
            from ..learner.coordinator import BudgetCoordinator

            coordinator = (
                ray.remote(BudgetCoordinator).options(name=COORDINATOR_NAME, get_if_exists=True, num_cpus=0).remote()
            )
            ray.get(coordinator.register.remote(rank, plan.budget))
    except ImportError:
        pass
    print(f"[hilore] verl rank {rank}: B = {plan.budget / 2**20:.1f} MiB, plan {plan.info.get('plan')}")
    extra = {} if group is None else {"group": group, "sp": sp}
    return (Microbatches if group is None else UlyssesMicrobatches)(
        plan, engine, device, coordinator, rank, resident=lambda: resident_bytes(fsdp_engine, device), **extra
    )


class UlyssesMicrobatches(Microbatches):
    """``Microbatches`` whose every per-microbatch decision is the SP group's (module docstring)."""

    def __init__(self, *args, group, sp: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.group, self.sp = group, int(sp)
        self.disagreements = 0  # microbatches whose own choice the group's first rank overruled

    def tokens(self, micro_batch) -> int:
        """This rank's slice: verl pads the packed sequence to a multiple of sp and gives each
        rank one slice (``ulysses_pad_and_slice_inputs``)."""
        return -(-super().tokens(micro_batch) // self.sp)

    def close(self) -> None:
        """The group's largest peaks (in-microbatch, in B's scope, trapped) before ``Microbatches.close``
        reports them: ``observe`` and the coordinator then answer every rank alike."""
        if self._open is not None:
            stack, rec = self._open
            stack.close()  # the record is complete
            rec.peak_bytes, scope, rec.trapped_bytes = agree_max(
                [rec.peak_bytes, rec.scope_peak, rec.trapped_bytes], self.group, self.device
            )
            rec.resident = scope - rec.peak_bytes
            self._open = (contextlib.ExitStack(), rec)
        super().close()

    def _choose(self, rec, loss, held, data):
        """The whole sequence's problem on every rank; the group's first rank's answer for all."""
        step = SimpleNamespace(token_norms=lambda: self._whole_norms(rec.step.token_norms()))
        own = super()._choose(SimpleNamespace(step=step, sp=rec.sp), loss, held, data)
        agreed = agree_object(own, self.group)
        self.disagreements += int(agreed != own)
        return agreed

    def _whole_norms(self, norms):
        """Each unit's per-token input norms over the whole (padded) packed sequence: the
        group's slices gathered in rank order (verl's ``all_gather_tensor``), one collective."""
        from verl.utils.ulysses import all_gather_tensor

        if not norms:
            return norms
        names = list(norms)  # the units in model order, as on every rank
        local = torch.stack([norms[n].reshape(-1).float() for n in names], dim=1).contiguous()
        whole = all_gather_tensor(local, group=self.group)
        return {n: whole[:, i].reshape(1, -1) for i, n in enumerate(names)}
