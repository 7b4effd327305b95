"""Recovery units of an HF decoder model (docs/DESIGN.md section 3).

Each decoder layer of the Llama family (Llama, Qwen2, Phi3, Mistral, Qwen3, Gemma, ...) has
``input_layernorm -> self_attn -> (+residual) -> post_attention_layernorm -> mlp -> (+residual)``.
It yields two units:

- ``<layer>.self_attn``: the input norm and the attention block (projections, rotary, the
  SDPA / eager / flash core, output projection); checkpoint input: the layer input;
- ``<layer>.mlp``: the post-attention norm and the MLP; checkpoint input: the residual stream
  after attention.

A unit's bundle is every tensor autograd saves while its modules run. Models whose layers do
not follow this shape fall back to whole-layer units (plain decoder-layer checkpointing).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import List, Optional

import torch.nn as nn

ATTN_NAMES = ("self_attn", "attn", "attention", "self_attention")
MLP_NAMES = ("mlp", "feed_forward", "ffn")
NORM1_NAMES = ("input_layernorm", "ln_1", "attention_norm")
NORM2_NAMES = ("post_attention_layernorm", "ln_2", "ffn_norm")
WRAPPER_PREFIXES = ("module.", "base_model.model.", "_orig_mod.")


@dataclass
class UnitSpec:
    """One recovery unit: modules run in order, the first one takes the checkpoint input."""

    name: str  # stable, e.g. "model.layers.7.mlp"
    kind: str  # "attn" | "mlp" | "layer"
    layer: int
    modules: List[nn.Module]

    @property
    def token_wise(self) -> bool:
        """Each token's output depends on that token alone (norm + MLP): its saved tensors are
        token rows, so token L may keep some rows exact (``state.ROWS``)."""
        return self.kind == "mlp"


@dataclass
class LayerSpec:
    index: int
    name: str
    module: nn.Module
    units: List[UnitSpec] = field(default_factory=list)


def stable_name(name: str) -> str:
    """Strip DeepSpeed / peft / torch.compile wrapper prefixes from a module path."""
    changed = True
    while changed:
        changed = False
        for p in WRAPPER_PREFIXES:
            if name.startswith(p):
                name, changed = name[len(p):], True
    return name


def _child(module: nn.Module, names) -> Optional[nn.Module]:
    for n in names:
        m = getattr(module, n, None)
        if isinstance(m, nn.Module):
            return m
    return None


def find_decoder_layers(model: nn.Module):
    """(path, ModuleList) of the model's decoder layers: the largest ModuleList of same-class
    blocks that hold an attention child."""
    best = None
    for path, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0 and len({type(m) for m in mod}) == 1:
            if _child(mod[0], ATTN_NAMES) is not None and (best is None or len(mod) > len(best[1])):
                best = (path, mod)
    return best


def _innermost(model: nn.Module) -> nn.Module:
    """The model inside DeepSpeed's (``.module``) and peft's (``.base_model.model``) wrappers, for
    messages. An HF model's own ``base_model`` is itself or its backbone, which has no ``.model``:
    the walk stops at the first object that wraps nothing further."""
    inner, seen = model, set()
    while id(inner) not in seen:
        seen.add(id(inner))
        nxt = getattr(inner, "module", None)
        if not isinstance(nxt, nn.Module):
            nxt = getattr(getattr(inner, "base_model", None), "model", None)
        if not isinstance(nxt, nn.Module):
            break
        inner = nxt
    return inner


def discover_units(model: nn.Module) -> List[LayerSpec]:
    """Units per decoder layer; whole-layer units (with a warning naming the class) when the
    layer does not have the norm/attention/norm/MLP structure."""
    found = find_decoder_layers(model)
    if found is None:
        raise ValueError(f"{type(model).__name__}: no decoder layers found (a ModuleList of blocks with an attention child)")
    path, layers = found
    path = stable_name(path)
    specs = []
    fallback = False
    for i, layer in enumerate(layers):
        name = f"{path}.{i}"
        parts = [_child(layer, names) for names in (NORM1_NAMES, ATTN_NAMES, NORM2_NAMES, MLP_NAMES)]
        spec = LayerSpec(i, name, layer)
        if all(p is not None for p in parts):
            attn_name = next(n for n in ATTN_NAMES if getattr(layer, n, None) is parts[1])
            mlp_name = next(n for n in MLP_NAMES if getattr(layer, n, None) is parts[3])
            spec.units = [
                UnitSpec(f"{name}.{attn_name}", "attn", i, [parts[0], parts[1]]),
                UnitSpec(f"{name}.{mlp_name}", "mlp", i, [parts[2], parts[3]]),
            ]
        else:
            fallback = True
            spec.units = [UnitSpec(name, "layer", i, [layer])]
        specs.append(spec)
    if fallback:
        inner = _innermost(model)
        warnings.warn(
            f"hilore: {type(inner).__name__} decoder layers ({type(layers[0]).__name__}) do not have the "
            "norm/attention/norm/MLP structure the engine understands; falling back to whole-layer units "
            "(plain decoder-layer checkpointing)",
            stacklevel=2,
        )
    return specs
