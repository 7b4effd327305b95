"""What a rank's budget B counts (``--hilore.budget_scope``; docs/DESIGN.md section 6).

- ``device`` (default; the paper's B_GC): the rank's whole peak during the update: what a
  microbatch starts with (weights, gradients, optimizer state, DeepSpeed's buffers: the
  *resident* bytes) plus what it allocates. This is what a GPU's capacity bounds. A ratio
  budget is that ratio of gc's device peak, resident + gc's in-microbatch peak.
- ``activations``: only what a microbatch allocates above what it starts with. Stricter: at
  the same ratio it leaves far less room, because the weights are not part of the base.

Either way the planner gets the *room*, the in-microbatch peak a microbatch may reach: B less
the resident bytes B counts (device), or B itself (activations; docs/DESIGN.md's glossary).
Planning runs before DeepSpeed exists, so it estimates the resident bytes from the parameters
(``estimate_resident``); the learner measures them once DeepSpeed is built (``resident_now``)
and the plan is rebased. ``unique_storage_bytes`` and ``optimizer_tensors`` count them on CPU
(the benchmark counts its resident bytes with them too).

``--hilore.budget auto`` (``auto_budget``): on CUDA, the memory free when the learner plans
plus what its allocator already holds, less ``AUTO_MARGIN`` of the device (allocator fragmentation,
NCCL and CUDA-graph buffers); a colocated vLLM's share is not free, so it is left alone. On
CPU there is no capacity to read: ``CPU_AUTO_RATIO`` x gc's peak, said so in the log.
"""

from __future__ import annotations

from typing import Optional

import torch

SCOPES = ("device", "activations")  # what B counts (``--hilore.budget_scope``)
AUTO_MARGIN = 0.08
CPU_AUTO_RATIO = 1.25


def unique_storage_bytes(tensors) -> int:
    """Bytes of the distinct storages under ``tensors`` (a storage shared by several tensors
    counts once; an FSDP2 DTensor counts this rank's shard; non-tensors and empty ones are
    skipped)."""
    seen, total = set(), 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t  # an FSDP2 DTensor: this rank's shard
        if isinstance(t, torch.Tensor) and t.numel():
            s = t.untyped_storage()
            key = (s.data_ptr(), str(s.device))
            if key not in seen:
                seen.add(key)
                total += s.nbytes()
    return total


def estimate_resident(model, *, world: int = 1, zero_stage: int = 2, mixed_precision: bool = False) -> int:
    """Bytes a rank will hold between microbatches once DeepSpeed wraps ``model``: weights and
    buffers, plus per trainable parameter its gradient (partitioned from ZeRO-2 on), AdamW's
    two float32 moments and, with bf16 weights, a float32 master copy (partitioned from
    ZeRO-1 on). An estimate: DeepSpeed's buckets and alignment padding come on top, which
    the measured rebase and the coordinator's ``tighten`` absorb."""
    params = list(model.parameters())
    weights = unique_storage_bytes(params + list(model.buffers()))
    trainable = [p for p in params if p.requires_grad]
    n = sum(p.numel() for p in trainable)
    grad = sum(p.numel() * p.element_size() for p in trainable)
    state = n * 4 * (3 if mixed_precision else 2)
    world = max(1, int(world))
    return int(weights + (grad / world if zero_stage >= 2 else grad) + (state / world if zero_stage >= 1 else state))


def resident_floor(model, *, world: int = 1, zero_stage: int = 2, mixed_precision: bool = False) -> int:
    """The least a rank can hold between microbatches: ``estimate_resident``'s count with the
    weights partitioned too under ZeRO-3, and no buffers, padding or persistent weights. Read
    from shapes alone (``model`` may live on the meta device): a budget in bytes below it can
    never be met, whatever the plan."""
    params = list(model.parameters())  # each shared (tied) parameter once
    weights = sum(p.numel() * p.element_size() for p in params)
    trainable = [p for p in params if p.requires_grad]
    grad = sum(p.numel() * p.element_size() for p in trainable)
    state = sum(p.numel() for p in trainable) * 4 * (3 if mixed_precision else 2)
    world = max(1, int(world))
    return int(
        (weights / world if zero_stage >= 3 else weights)
        + (grad / world if zero_stage >= 2 else grad)
        + (state / world if zero_stage >= 1 else state)
    )


def optimizer_tensors(optimizer):
    """Tensors an optimizer (or DeepSpeed's ZeRO optimizer around one) holds."""
    out, seen = [], set()
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        for st in getattr(optimizer, "state", {}).values():
            if isinstance(st, dict):
                out += [v for v in st.values() if isinstance(v, torch.Tensor)]
        for name in ("single_partition_of_fp32_groups", "bit16_groups_flat", "fp32_groups_flat_partition"):
            out += [t for t in getattr(optimizer, name, None) or [] if isinstance(t, torch.Tensor)]
        optimizer = getattr(optimizer, "optimizer", None)
    return out


def resident_now(device, module, optimizer=None, persistent_to_come: bool = False) -> int:
    """Bytes held between microbatches. CUDA: the allocator's count (everything on the device,
    exact). CPU: the unique storages of the module's parameters, buffers and gradients and of
    the optimizer's state (DeepSpeed's flat partitions included). ``persistent_to_come``: add
    ZeRO-3's persistent weights not gathered yet, which the next forward gathers for good (B's
    resident bytes, measured before it); not for a microbatch's own start, whose measured peak
    already holds that gather."""
    device = torch.device(device)
    params = list(module.parameters()) if module is not None else []
    extra = _persistent_to_come(params) if persistent_to_come else 0
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device)) + extra
    return (
        unique_storage_bytes(
            params
            + list(module.buffers())
            + [p.grad for p in params if p.grad is not None]
            + optimizer_tensors(optimizer)
        )
        + extra
    )


def _persistent_to_come(params) -> int:
    """ZeRO-3's persistent weights (``ds_persist``: small ones, kept whole on every rank once
    gathered) that are not gathered now, at full size."""
    return sum(
        p.ds_numel * p.element_size()
        for p in params
        if getattr(p, "ds_persist", False) and getattr(getattr(p, "ds_status", None), "name", "") != "AVAILABLE"
    )


def auto_budget(device) -> Optional[int]:
    """Device bytes for ``--hilore.budget auto``, or None on CPU (see the module docstring)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return int(torch.cuda.memory_reserved(device) + free - AUTO_MARGIN * total)
