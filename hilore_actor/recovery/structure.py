"""Where a decoder layer's residual adds fall: the structure recovery units are cut from.

A recovery unit is everything a decoder layer runs between two residual adds (docs/DESIGN.md
section 3). Attribute names cannot say where those are: OLMo 2 normalises after attention,
Gemma 3 wraps both blocks in two norms each, GPT-J and Cohere add attention and MLP to the
residual at once. So the layer is traced instead: a shrunken copy of the model (same class,
same layer count and layer types, tiny widths, random weights, on the CPU) runs one forward on
a few tokens while hooks record, per decoder layer,

- each call of a direct child module (``("call", name)``),
- each add at the layer's own level that takes the residual stream: the layer's input, then the
  result of the previous such add (``("add", None)``),
- each tensor autograd saves at the layer's own level, outside every child (``("save", None)``).

``segments`` cuts those events at the adds. A layer is cut only when each child runs once and no
layer-level op saves a tensor between two children of one segment (the engine replays a unit's
child calls, not the layer's own code between them); otherwise its structure is ``None`` and the
caller falls back. The trace costs one tiny forward per model class and config (cached) and
leaves the caller's random state as it was.
"""

from __future__ import annotations

import copy
import warnings
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

ADDS = {
    torch.add,
    torch.Tensor.add,
    torch.Tensor.__add__,
    torch.Tensor.__radd__,
    torch.Tensor.add_,
    torch.Tensor.__iadd__,
}
# Width fields a shrunken copy sets when its config has them (layer counts and types are kept).
SMALL = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_attention_heads": 4,
    "head_dim": 16,
    "n_embd": 64,
    "n_head": 4,
    "n_inner": 96,
    "rotary_dim": 8,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "vocab_size": 128,
    "d_model": 64,
    "n_heads": 4,
    "ffn_dim": 96,
}
AT_MOST = {
    "num_key_value_heads": 2,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "topk_group": 1,
    "n_group": 1,
}
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")
MAX_COPY_PARAMS = 50_000_000  # a config whose widths this table does not reach: units by name instead
_CACHE: Dict[str, Optional[List[Optional[List[str]]]]] = {}


def _set(cfg, key: str, value) -> None:
    """Set a config field unless the config derives it (a read-only property, e.g. Falcon's head_dim)."""
    try:
        setattr(cfg, key, value)
    except (AttributeError, TypeError, ValueError):
        pass


def shrunk_config(config, model_class=None):
    """A copy of an HF config with tiny widths and the same layer count and layer types; a
    composite config (a text model inside a multimodal one) has its sub-configs shrunk too."""
    cfg = copy.deepcopy(config)
    for sub in {
        id(c): c
        for c in [_text_config(cfg), *(getattr(cfg, k, None) for k in getattr(cfg, "sub_configs", {}) or {})]
        if c is not None and c is not cfg
    }.values():
        _shrink(sub)
    _shrink(cfg)
    if getattr(cfg, "_attn_implementation", None) not in ("eager", "sdpa"):
        cfg._attn_implementation = "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"
    return cfg


def _text_config(cfg):
    """The language model's config: itself, or the text part of a composite (multimodal) one."""
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _shrink(cfg) -> None:
    wanted = {k: v for k, v in SMALL.items() if isinstance(getattr(cfg, k, None), int)}
    wanted.update({k: v for k, v in AT_MOST.items() if isinstance(getattr(cfg, k, None), int) and getattr(cfg, k) > v})
    for k, v in wanted.items():
        _set(cfg, k, v)
    for k in TOKEN_IDS:
        ids = getattr(cfg, k, None)
        if isinstance(ids, int) and ids >= getattr(cfg, "vocab_size", 0) or isinstance(ids, list):
            _set(cfg, k, 0)


def _record(layers: nn.ModuleList, events: List[List[Tuple[str, Optional[str]]]]):
    """Hooks that append each layer's child calls and layer-level saves to ``events[i]``; returns
    (hooks, state) where ``state`` tracks the running layer, the stream and the child depth."""
    st = {"layer": None, "stream": None, "depth": 0}
    hooks = []
    for i, layer in enumerate(layers):

        def layer_pre(mod, args, kwargs, i=i):
            if any(e[0] == "layer" for e in events[i]):
                events[i].append(("again", None))  # a shared or recurrent layer: runs twice per forward
            events[i].append(("layer", None))
            st["layer"], st["depth"] = i, 0
            st["stream"] = args[0] if args else kwargs.get("hidden_states")

        def layer_post(mod, args, out):
            st["layer"] = None

        hooks += [layer.register_forward_pre_hook(layer_pre, with_kwargs=True), layer.register_forward_hook(layer_post)]
        for name, child in layer.named_children():

            def pre(mod, args, name=name, i=i):
                if st["layer"] == i and st["depth"] == 0:
                    events[i].append(("call", name))
                st["depth"] += 1

            def post(mod, args, out):
                st["depth"] -= 1

            hooks += [child.register_forward_pre_hook(pre), child.register_forward_hook(post)]
    return hooks, st


class _Adds(TorchFunctionMode):
    """Records a layer-level add that takes the residual stream, and makes its result the stream."""

    def __init__(self, st, events):
        super().__init__()
        self.st, self.events = st, events

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        st = self.st
        if st["layer"] is None or st["depth"] != 0:
            return out
        if func in ADDS and any(a is st["stream"] for a in args):
            self.events[st["layer"]].append(("add", None))
            st["stream"] = out
        elif getattr(func, "__name__", "").endswith("_") or getattr(func, "__name__", "").startswith("__i"):
            self.events[st["layer"]].append(("save", None))  # an in-place op of the layer's own: not replayed
        return out


def _model_class(model: nn.Module) -> type:
    """The model's own class: FSDP2's ``fully_shard`` swaps in a subclass (``FSDP<Name>``)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return type(model)
    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


def trace_events(model: nn.Module, layers_path: str, n_layers: int) -> List[List[Tuple[str, Optional[str]]]]:
    """Events per decoder layer of a shrunken copy of ``model`` (an HF model with a ``config``)."""
    cls = _model_class(model)
    cfg = shrunk_config(model.config, cls)
    with torch.device("meta"):
        n = sum(p.numel() for p in cls(cfg).parameters())
    if n > MAX_COPY_PARAMS:
        raise ValueError(f"the shrunken copy would still hold {n / 1e6:.0f}M parameters")
    with torch.random.fork_rng(devices=[]), torch.device("cpu"), torch.enable_grad(), torch.inference_mode(False):
        torch.default_generator.manual_seed(0)  # the CPU generator only: fork_rng restores it, CUDA's is untouched
        skeleton = cls(cfg).float().train()
        layers = skeleton.get_submodule(layers_path)  # the same class: its layers sit at the same path
        if not isinstance(layers, nn.ModuleList) or len(layers) != n_layers:
            raise ValueError("the shrunken copy's decoder layers differ from the model's")
        events: List[list] = [[] for _ in range(n_layers)]
        hooks, st = _record(layers, events)

        def save(t):
            if st["layer"] is not None and st["depth"] == 0:
                events[st["layer"]].append(("save", None))
            return t

        try:
            with torch.autograd.graph.saved_tensors_hooks(save, lambda t: t), _Adds(st, events):
                vocab = getattr(_text_config(cfg), "vocab_size", 128)
                skeleton(input_ids=torch.randint(1, vocab, (1, 8)), use_cache=False, return_dict=True)
        finally:
            for h in hooks:
                h.remove()
    return events


def segments(events: List[Tuple[str, Optional[str]]]) -> Optional[List[List[str]]]:
    """The layer's child calls cut at its residual adds, or ``None`` when it cannot be cut.
    (A layer that ran twice in one forward, a shared or recurrent layer, is refused before this:
    the engine records each layer's call once per step.)"""
    segs: List[List[str]] = []
    cur: List[str] = []
    saved_since_call = False
    for kind, name in events:
        if kind == "call":
            if name in cur or any(name in s for s in segs) or (cur and saved_since_call):
                return None  # a child run twice, or layer code that saves between two children of a unit
            cur.append(name)
            saved_since_call = False
        elif kind == "save":
            saved_since_call = True
        elif kind == "add" and cur:
            segs.append(cur)
            cur, saved_since_call = [], False
    if cur:
        segs.append(cur)
    return segs or None


def layer_structure(model: nn.Module, layers_path: str, n_layers: int) -> Optional[List[Optional[List[List[str]]]]]:
    """Per decoder layer, its segments (child names between residual adds) or ``None``; ``None``
    for the whole model when it cannot be traced (no HF config, or the shrunken copy fails)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_json_string"):
        return None
    try:
        cls = _model_class(model)
        key = f"{cls.__module__}.{cls.__qualname__}:{layers_path}:{n_layers}:" + config.to_json_string()
    except (TypeError, ValueError):
        key = None
    if key is not None and key in _CACHE:
        return _CACHE[key]
    try:
        events = trace_events(model, layers_path, n_layers)
    except Exception as e:  # a config the shrunken copy cannot build or run: units by name instead
        warnings.warn(
            f"hilore: could not trace {type(model).__name__}'s decoder layers on a shrunken copy "
            f"({type(e).__name__}: {str(e)[:160]}); finding units by name",
            stacklevel=3,
        )
        result = None
    else:
        if any(kind == "again" for ev in events for kind, _ in ev):
            raise ValueError(
                f"hilore: {type(model).__name__} runs a decoder layer more than once per forward (shared or "
                "recurrent layers); the recovery engine needs each layer to run once: use gradient "
                "checkpointing for this model"
            )
        result = [segments(ev) for ev in events]
    if key is not None:
        _CACHE[key] = result
    return result
