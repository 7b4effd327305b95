"""Weights the learner sends to rollout workers after every update.

- ``adapter``: the LoRA adapter tensors only (into a peft model of the same shape);
- ``merged``: base weights with each LoRA delta folded in (``W + scale * B @ A``), under the
  base model's parameter names, for engines that load plain HF weights (vLLM, HF generate
  workers: no LoRA branch while sampling);
- ``full``: every parameter (full fine-tuning).

The export walks the model one module at a time (a LoRA layer with its base layer and adapters,
else a module's own tensors): its delta is built, folded into the CPU copy of its weight and
dropped before the next, so the device holds one module's float32 delta at most, not every
delta of the model (~11 GB for Qwen2.5-3B with all-linear LoRA). Under ZeRO-3 ``gather`` makes
that module's parameters whole for its turn only (``zero3_gather``), not the whole model.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

KINDS = ("adapter", "merged", "full")


def _is_peft(model) -> bool:
    return hasattr(model, "peft_config")


Gather = Callable[[List[torch.nn.Parameter]], contextlib.AbstractContextManager]


def zero3_gather(params: List[torch.nn.Parameter]) -> contextlib.AbstractContextManager:
    """``gather`` for a DeepSpeed ZeRO-3 model: those parameters whole on every rank, read-only."""
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def _gathered(gather: Optional[Gather], tensors: Iterable[torch.Tensor]) -> contextlib.AbstractContextManager:
    params = [t for t in tensors if isinstance(t, torch.nn.Parameter)]
    return gather(params) if gather is not None and params else contextlib.nullcontext()


def _modules(root, owner_cls=None) -> Iterator[Tuple[str, torch.nn.Module, List[Tuple[str, torch.Tensor]]]]:
    """``root``'s state dict (its tensors, not copies) in order, one owning module at a time:
    ``(name, module, [(key, tensor)])``. The owner of a key is its innermost module, or the
    outermost ``owner_cls`` instance above it (a LoRA layer owns its base layer and adapters)."""
    mods = dict(root.named_modules(remove_duplicate=False))

    def owner(key: str) -> str:
        parts, name = key.split(".")[:-1], ""
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix not in mods:
                break
            name = prefix
            if owner_cls is not None and isinstance(mods[prefix], owner_cls):
                break
        return name

    group: List[Tuple[str, torch.Tensor]] = []
    current = None
    for k, v in root.state_dict(keep_vars=True).items():
        o = owner(k)
        if group and o != current:
            yield current, mods[current], group
            group = []
        current = o
        group.append((k, v))
    if group:
        yield current, mods[current], group


def export_weights(
    model, kind: str, gather: Optional[Gather] = None, keep: bool = True
) -> Optional[Dict[str, torch.Tensor]]:
    """CPU copies of ``model``'s weights in the form ``kind`` names, one module at a time.
    ``gather(params)``: a context that makes those parameters whole (``zero3_gather``); every
    rank then calls this alike (the gathers are collectives) and ``keep=False`` ranks only take
    part in them (returning None)."""
    if kind not in KINDS:
        raise ValueError(f"unknown weight kind {kind!r}; choose one of {KINDS}")
    if not keep and gather is None:  # nothing to take part in
        return None
    if kind == "adapter":
        if not _is_peft(model):
            raise ValueError("adapter weights need a peft LoRA model")
        from peft import get_peft_model_state_dict

        adapter = [p for n, p in model.named_parameters() if p.requires_grad or "lora_" in n]
        with _gathered(gather, adapter):
            if not keep:
                return None
            return {k: v.detach().to("cpu", copy=True) for k, v in get_peft_model_state_dict(model).items()}
    if kind == "full" or not _is_peft(model):
        out = {}
        for _, _, items in _modules(model):
            with _gathered(gather, (v for _, v in items)):
                out.update((k, v.detach().to("cpu", copy=True)) for k, v in items if keep)
        return out if keep else None
    return merged_state_dict(model, gather, keep)


@torch.no_grad()
def merged_state_dict(model, gather: Optional[Gather] = None, keep: bool = True) -> Optional[Dict[str, torch.Tensor]]:
    """Base-model state dict with LoRA merged, without modifying ``model``: per LoRA layer its
    float32 delta on the device, added to the CPU copy of its weight there, then dropped."""
    from peft.tuners.lora import LoraLayer

    out = {}
    for name, mod, items in _modules(model.get_base_model(), LoraLayer):
        lora = isinstance(mod, LoraLayer)
        with _gathered(gather, list(mod.parameters()) if lora else (v for _, v in items)):
            if not keep:
                continue
            delta = None
            if lora:
                delta = torch.zeros_like(mod.get_base_layer().weight, dtype=torch.float32)
                for ad in mod.active_adapters:
                    if ad in mod.lora_A:
                        delta += mod.get_delta_weight(ad).float()
                delta = delta.cpu()
            for k, v in items:
                if ".lora_" in k:
                    continue
                clean = k.replace(".base_layer.", ".")
                if delta is not None and clean == name + ".weight":
                    v = v.detach().cpu()
                    out[clean] = (v.float() + delta).to(v.dtype)
                else:
                    out[clean] = v.detach().to("cpu", copy=True)
            del delta
    return out if keep else None


def load_weights(model, weights: Dict[str, torch.Tensor], kind: str) -> None:
    """The receiving side for HF models: ``adapter`` into a peft model, ``full`` into any."""
    if kind == "adapter":
        from peft import set_peft_model_state_dict

        res = set_peft_model_state_dict(model, weights)
        unexpected = getattr(res, "unexpected_keys", [])
        if unexpected:
            raise ValueError(f"adapter weights do not match the rollout model: unexpected {unexpected[:3]}")
    elif kind in ("full", "merged"):  # merged: a plain (non-peft) model takes the base names
        model.load_state_dict(weights, strict=True)
    else:
        raise ValueError(f"unknown weight kind {kind!r}; choose one of {KINDS}")
