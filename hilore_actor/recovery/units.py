"""Recovery units of an HF decoder model (docs/DESIGN.md section 3).

A unit is everything a decoder layer runs between two residual adds, found by tracing the
layer (``structure.py``); attribute names only label units. For the Llama family (Llama,
Qwen2, Phi3, Mistral, Qwen3, ...) that gives the familiar two units per layer:

- ``<layer>.self_attn``: the input norm and the attention block (projections, rotary, the
  SDPA / eager / flash core, output projection); checkpoint input: the layer input;
- ``<layer>.mlp``: the post-attention norm and the MLP; checkpoint input: the residual stream
  after attention.

Post-norm layers (OLMo 2: attention, then its norm) and sandwich norms (Gemma 3: a norm before
and after each block) put each norm in the unit of the block it belongs to. A layer whose
attention and MLP share one residual add (GPT-J, GPT-NeoX, Cohere) is one unit (kind
``block``). A unit with a sequence mixer that is not softmax attention (linear attention, state
space, convolution: hybrid models) is kind ``mixer``. An MLP unit whose block routes tokens to
experts is kind ``moe``: its saved tensors are gathered expert rows, not token rows, so token L
is not offered on it.

A unit's bundle is every tensor autograd saves while its modules run. When a model cannot be
traced (no HF config), the attribute-name table below finds the two Llama-family units; a layer
neither can cut is one whole-layer unit (plain decoder-layer checkpointing), with a warning
naming its class.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from typing import List, Optional

import torch.nn as nn

ATTN_NAMES = ("self_attn", "attn", "attention", "self_attention")
MLP_NAMES = ("mlp", "feed_forward", "ffn")
NORM1_NAMES = ("input_layernorm", "ln_1", "attention_norm")
NORM2_NAMES = ("post_attention_layernorm", "ln_2", "ffn_norm")
MIXER_WORDS = {
    "mamba",
    "mixer",
    "ssm",
    "conv",
    "delta",
    "deltanet",
    "recurrent",
    "rnn",
    "retention",
    "lru",
    "rwkv",
    "gdn",
}
WRAPPER_PREFIXES = (
    "module.",
    "base_model.model.",
    "_orig_mod.",
    "_fsdp_wrapped_module.",
    "_checkpoint_wrapped_module.",
)
WRAPPED = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")  # FSDP1, checkpoint_wrapper, compile


@dataclass
class UnitSpec:
    """One recovery unit: the layer's child modules it runs, in call order."""

    name: str  # stable, e.g. "model.layers.7.mlp"
    kind: str  # "attn" | "mlp" | "moe" | "block" (attention and MLP on one residual add) | "mixer" | "layer"
    layer: int
    modules: List[nn.Module]
    attention: Optional[nn.Module] = None  # the attention module whose own code is the core (rules.KEEP_EXACT)

    @property
    def token_wise(self) -> bool:
        """Each token's output depends on that token alone (norm + MLP): its saved tensors are
        token rows, so token L may keep some rows exact (``labels.ROWS``)."""
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
                name, changed = name[len(p) :], True
    return name


def _child(module: nn.Module, names) -> Optional[nn.Module]:
    for n in names:
        m = getattr(module, n, None)
        if isinstance(m, nn.Module):
            return m
    return None


def find_decoder_layers(model: nn.Module):
    """(path, ModuleList) of the model's decoder layers: the longest ModuleList of blocks of which
    at least one mixes tokens (attention, or the linear-attention and state-space layers hybrid
    models mix with it, under one class or several)."""
    best = None
    for path, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0 and all(len(list(_unwrap(m).children())) > 1 for m in mod):
            if any(_mixes_tokens(m) for m in mod) and (best is None or len(mod) > len(best[1])):
                best = (path, mod)
    return best


def _unwrap(m: nn.Module) -> nn.Module:
    """A layer inside FSDP1's, checkpoint_wrapper's or torch.compile's single-child wrapper."""
    while any(isinstance(getattr(m, w, None), nn.Module) for w in WRAPPED):
        m = next(getattr(m, w) for w in WRAPPED if isinstance(getattr(m, w, None), nn.Module))
    return m


def _mixes_tokens(block: nn.Module) -> bool:
    """The block mixes tokens: it holds softmax attention or another sequence mixer."""
    return any(
        _is_attention(n.rsplit(".", 1)[-1], m) or _is_mixer(n.rsplit(".", 1)[-1], m)
        for n, m in block.named_modules()
        if n
    )


def _innermost(model: nn.Module) -> nn.Module:
    """The model inside DeepSpeed's (``.module``) and peft's (``.base_model.model``) wrappers. An
    HF model's own ``base_model`` is itself or its backbone, which has no ``.model``: the walk
    stops at the first object that wraps nothing further."""
    inner, seen = model, set()
    while id(inner) not in seen:
        seen.add(id(inner))
        nxt = getattr(inner, "module", None)
        if not isinstance(nxt, nn.Module):
            nxt = getattr(inner, "_orig_mod", None)  # torch.compile
        if not isinstance(nxt, nn.Module):
            nxt = getattr(getattr(inner, "base_model", None), "model", None)
        if not isinstance(nxt, nn.Module):
            break
        inner = nxt
    return inner


def _is_attention(name: str, m: nn.Module) -> bool:
    """Softmax attention, whose own code is the core L keeps exact (``rules.KEEP_EXACT``)."""
    cls = _class_words(m)
    return (name in ATTN_NAMES or bool(cls & {"attention", "attn"})) and not _is_mixer(name, m)


def _class_words(m: nn.Module) -> set:
    """The words of a module's class name after its first (the model family: ``RecurrentGemma``'s
    "Recurrent" says nothing about its ``SdpaAttention``)."""
    words = re.findall(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|\d+", type(m).__name__)
    return {w.lower() for w in words[1:]} or {w.lower() for w in words}


def _is_mixer(name: str, m: nn.Module) -> bool:
    """A sequence mixer that is not softmax attention (linear attention, state space, convolution):
    its output rows depend on other tokens' rows, so its unit is not token-wise. The class name
    decides; the attribute name (Nemotron-H calls every block ``mixer``) only when it says nothing."""
    cls = _class_words(m)
    if cls & MIXER_WORDS or "linear" in cls and cls & {"attn", "attention"}:
        return True
    if cls & {"attention", "attn", "mlp", "moe", "experts", "feed", "forward", "ffn", "norm"}:
        return False
    return bool(set(name.lower().split("_")) & MIXER_WORDS)


def _is_moe(m: nn.Module) -> bool:
    """An MLP block that routes tokens to experts: it holds an ``experts`` module or an experts
    class (a dense MLP of an MoE family, ``Qwen3MoeMLP``, is not one)."""
    return any(
        n.rsplit(".", 1)[-1] in ("experts", "expert") or "expert" in type(x).__name__.lower()
        for n, x in m.named_modules()
        if n
    )


def _is_block(m: nn.Module) -> bool:
    """A child with weights that is neither a norm nor a dropout (an MLP, MoE or attention block)."""
    own = any(len(getattr(p, "ds_shape", p.shape)) >= 2 for p in m.parameters())  # ZeRO-3: the full shape
    return own and "norm" not in type(m).__name__.lower()


def _traced_units(name: str, i: int, layer: nn.Module, segs: List[List[str]]) -> Optional[List[UnitSpec]]:
    """One unit per segment, labelled by its attention or MLP child; None if a child is missing."""
    units = []
    for seg in segs:
        mods = [getattr(layer, n, None) for n in seg]
        if any(not isinstance(m, nn.Module) for m in mods):
            return None
        attn = [(n, m) for n, m in zip(seg, mods) if _is_attention(n, m)]
        mixer = [(n, m) for n, m in zip(seg, mods) if _is_mixer(n, m) and _is_block(m)]
        other = [(n, m) for n, m in zip(seg, mods) if _is_block(m) and not _is_attention(n, m) and not _is_mixer(n, m)]
        if mixer:
            kind, label = "mixer", "+".join(n for n, _ in attn + mixer + other)
        elif attn and other:
            kind, label = "block", f"{attn[0][0]}+{other[0][0]}"
        elif attn:
            kind, label = "attn", attn[0][0]
        else:
            kind = "moe" if other and _is_moe(other[0][1]) else "mlp"
            label = (other or list(zip(seg, mods)))[0][0]
        units.append(UnitSpec(f"{name}.{label}", kind, i, mods, attn[0][1] if attn else None))
    return units


def _named_units(name: str, i: int, layer: nn.Module) -> Optional[List[UnitSpec]]:
    """The Llama-family norm/attention/norm/MLP units, found by attribute name (untraceable models)."""
    parts = [_child(layer, names) for names in (NORM1_NAMES, ATTN_NAMES, NORM2_NAMES, MLP_NAMES)]
    if any(p is None for p in parts):
        return None
    weighted = [c for c in _unwrap(layer).children() if any(True for _ in c.parameters())]
    if len(weighted) != 4:  # sandwich norms (Gemma 2/3): the names would put a norm in the wrong unit
        return None
    attn_name = next(n for n in ATTN_NAMES if getattr(layer, n, None) is parts[1])
    mlp_name = next(n for n in MLP_NAMES if getattr(layer, n, None) is parts[3])
    return [
        UnitSpec(f"{name}.{attn_name}", "attn", i, [parts[0], parts[1]], parts[1]),
        UnitSpec(f"{name}.{mlp_name}", "moe" if _is_moe(parts[3]) else "mlp", i, [parts[2], parts[3]]),
    ]


def discover_units(model: nn.Module) -> List[LayerSpec]:
    """Units per decoder layer: cut at the residual adds (``structure.layer_structure``), else by
    the name table, else one whole-layer unit (with a warning naming the layer's class)."""
    from .structure import layer_structure

    found = find_decoder_layers(model)
    if found is None:
        raise ValueError(
            f"hilore: {type(model).__name__}: no decoder layers found (a ModuleList of blocks, one of them "
            "holding attention or another sequence mixer); the recovery engine cannot cut this model into units"
        )
    path, layers = found
    path = stable_name(path)
    inner = _innermost(model)
    structure = layer_structure(inner, path, len(layers))
    specs, fallback = [], []
    for i, layer in enumerate(layers):
        name = f"{path}.{i}"
        segs = structure[i] if structure is not None else None
        units = _traced_units(name, i, layer, segs) if segs else None
        if units is None and structure is None:
            units = _named_units(name, i, layer)
        if units is None:
            fallback.append(i)
            units = [UnitSpec(name, "layer", i, [layer])]
        specs.append(LayerSpec(i, name, layer, units))
    if fallback:
        warnings.warn(
            f"hilore: {type(inner).__name__} decoder layers {fallback[:8]} ({type(layers[fallback[0]]).__name__}) "
            "cannot be cut at their residual adds; falling back to whole-layer units "
            "(plain decoder-layer checkpointing)",
            stacklevel=2,
        )
    return specs
