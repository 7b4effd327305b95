"""Weights the learner sends to rollout workers after every update.

- ``adapter``: the LoRA adapter tensors only (into a peft model of the same shape);
- ``merged``: base weights with each LoRA delta folded in (``W + scale * B @ A``), under the
  base model's parameter names, for engines that load plain HF weights (vLLM, HF generate
  workers: no LoRA branch while sampling);
- ``full``: every parameter (full fine-tuning).
"""
from __future__ import annotations

from typing import Dict

import torch

KINDS = ("adapter", "merged", "full")


def _is_peft(model) -> bool:
    return hasattr(model, "peft_config")


def export_weights(model, kind: str) -> Dict[str, torch.Tensor]:
    """CPU copies of ``model``'s weights in the form ``kind`` names."""
    if kind not in KINDS:
        raise ValueError(f"unknown weight kind {kind!r}; choose one of {KINDS}")
    if kind == "adapter":
        if not _is_peft(model):
            raise ValueError("adapter weights need a peft LoRA model")
        from peft import get_peft_model_state_dict

        return {k: v.detach().cpu().clone() for k, v in get_peft_model_state_dict(model).items()}
    if kind == "full" or not _is_peft(model):
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return merged_state_dict(model)


@torch.no_grad()
def merged_state_dict(model) -> Dict[str, torch.Tensor]:
    """Base-model state dict with LoRA merged, without modifying ``model``."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    out = {}
    deltas = {}
    for name, mod in base.named_modules():
        if isinstance(mod, LoraLayer):
            w = mod.get_base_layer().weight
            delta = torch.zeros_like(w, dtype=torch.float32)
            for ad in mod.active_adapters:
                if ad in mod.lora_A:
                    delta += mod.get_delta_weight(ad).float()
            deltas[name + ".weight"] = delta
    for k, v in base.state_dict().items():
        if ".lora_" in k:
            continue
        clean = k.replace(".base_layer.", ".")
        v = v.detach().cpu()
        if clean in deltas:
            v = (v.float() + deltas[clean].cpu()).to(v.dtype)
        out[clean] = v.clone()
    return out


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
