"""The learner's microbatch on the meta device: what each unit saves, and each pass's peak,
computed without allocating.

A meta tensor has a shape, a dtype and a storage size but no memory and no values, so a 72B
model's forward and backward over 32k tokens run here in seconds on a CPU. What runs is the
learner's own code: the recovery engine's hooks (``recovery/engine.py``), the GRPO loss of
``grpo/microbatch.py`` and the chunked head. So:

- each unit's saved bytes (H: exact; L: per codec; P) are read from the engine's own
  accounting, ``Step.bytes_by_unit(shared=False)``, the numbers the planner's profiling probes
  read on a real device (``allocation/profiling.py``);
- a pass's peak is the running maximum of live tensor storages (``runtime/storage_meter.py``,
  which counts meta storages as it counts CPU ones): the in-microbatch peak the CPU meter
  measures, as the allocator would see it without caching or fragmentation.

Three things the meta device cannot run, replaced by what the real kernels save:

1. SDPA on meta decomposes into its math path (a ``[T, T]`` score matrix saved per head). The
   learner runs fused attention: flash-attn on GPUs, SDPA's flash kernel on CPU; both save the
   queries, keys and values, the output and the row log-sum-exp. The meta model's attention is
   therefore ``ATTENTION``, the CPU flash kernel's meta function (GQA's keys and values kept
   unexpanded, as both kernels keep them).
2. A packed row's attention mask is built from the position ids' values: on meta each row is
   one causal sequence (flash-attn's varlen path builds no mask either; SDPA on CPU keeps a
   ``[1, 1, T, T]`` boolean mask for a packed row, T^2 bytes, which the estimate does not count).
3. Data-dependent control flow: an MoE router's token routing (``nonzero``, ``.item()``) has no
   values to route by; such models raise ``MetaUnsupported`` naming the op.

``head_is_linear`` reads values too: the verdict comes from a tiny random twin of the model's
class on CPU (``linear_head``).
"""

from __future__ import annotations

from typing import Dict, Iterable, Optional

import torch

ATTENTION = "hilore_meta_flash"


class MetaUnsupported(RuntimeError):
    """The model's forward reads tensor values somewhere (the message names the op)."""


def _flash_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' attention interface over the CPU flash kernel: ``query [B, H, T, D]``,
    ``key``/``value [B, KV, T, D]`` (GQA without expansion), causal, output ``[B, T, H, D]``."""
    causal = query.shape[2] > 1 and (is_causal if is_causal is not None else getattr(module, "is_causal", True))
    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, float(dropout), bool(causal), scale=scaling
    )
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> None:
    """``ATTENTION`` in transformers' attention registry (once; no mask function: a row is one
    causal sequence, as the module docstring says)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, _flash_attention)


def meta_model(config, *, dtype: torch.dtype, lora=None):
    """``config``'s causal LM on the meta device with ``ATTENTION``, LoRA-wrapped when ``lora``."""
    import warnings

    from ..models.factory import apply_lora, build_model

    register_attention()
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # peft's call of a renamed transformers method
        model = build_model(config, dtype=dtype, seed=None)
        model.config._attn_implementation = ATTENTION
        model = apply_lora(model, lora) if lora is not None else model
    model.train()
    return model


def linear_head(config) -> bool:
    """``chunked_head.head_is_linear`` for ``config``'s class, checked on a tiny random twin on
    CPU (two layers, width 64, the same head options): the meta model has no values to check."""
    from ..models.chunked_head import head_is_linear
    from ..models.factory import build_model

    small = config.__class__.from_dict(config.to_dict())
    for key, value in (
        ("hidden_size", 64),
        ("intermediate_size", 128),
        ("num_hidden_layers", 2),
        ("num_attention_heads", 4),
        ("num_key_value_heads", min(4, getattr(config, "num_key_value_heads", 4) or 4)),
        ("head_dim", 16),
        ("vocab_size", 512),
    ):
        if hasattr(small, key):
            setattr(small, key, value)
    return head_is_linear(build_model(small, seed=0))


def meta_microbatch(tokens: int, rows: int, loss_options: Dict):
    """A learner microbatch of ``rows`` rows of ``tokens // rows`` tokens on the meta device (the
    action mask boolean: its 0/1 check reads values)."""
    from ..grpo.microbatch import Microbatch

    width = tokens // rows
    meta = dict(device="meta")
    f = lambda: torch.empty(rows, width - 1, **meta)  # noqa: E731
    return Microbatch(
        torch.empty(rows, width, dtype=torch.long, **meta),
        torch.arange(width, **meta).expand(rows, width),
        f(),
        f(),
        f(),
        torch.empty(rows, width - 1, dtype=torch.bool, **meta),
        loss_options=dict(loss_options),
    )


def _guarded(fn):
    """``fn()``; an op that fails on meta tensors (no values, or no meta kernel for these dtypes:
    the grouped expert matmul has one in bfloat16 only) as ``MetaUnsupported``, with its message."""
    try:
        return fn()
    except (RuntimeError, NotImplementedError) as e:
        raise MetaUnsupported(" ".join(str(e).split())[:300]) from None


def unit_bytes(engine, loss_fn, mb, levels: Iterable[str] = (), partial: bool = False) -> Dict[str, Dict]:
    """What ``allocation/profiling.py``'s probes read, from forward passes on the meta device:
    ``{"H": {unit: bytes}, level: {unit: bytes} per L level label, "P" levels when ``partial``,
    "mixed": {attention unit: its MLP's input}, "checkpoint": {unit: bytes}}``, each unit as if
    held alone (``Step.bytes_by_unit(shared=False)``)."""
    from ..recovery.labels import P_LABELS, plan_for_label

    names = engine.unit_names

    def held(plan) -> Dict[str, Dict[str, int]]:
        def run():
            with engine.step(plan, track_error=False) as step:
                loss_fn(engine.model, mb)
                step.ensure_actions()
                return step.bytes_by_unit(shared=False)

        return _guarded(run)

    h = held("all-h")
    out = {"H": {n: float(h[n]["exact"]) for n in names}, "checkpoint": {n: float(h[n]["checkpoint"]) for n in names}}
    for a in levels:
        got = held({n: plan_for_label(a) for n in names})
        out[a] = {n: float(got[n]["compressed"] + got[n]["exact"]) for n in names}
    for a in P_LABELS if partial else ():
        got = held({n: plan_for_label(a) for n in names})
        out[a] = {n: float(got[n]["partial"]) for n in names}
    mixed = {
        layer.units[0].name: layer.units[1].name
        for layer in engine.layer_specs
        if len(layer.units) == 2 and layer.units[0].kind in ("attn", "mixer")
    }
    got = held({n: ("exact" if n in mixed else "checkpoint") for n in names}) if mixed else {}
    out["mixed"] = {a: float(got[m]["checkpoint"]) for a, m in mixed.items()}
    return out


def step_peak(engine, loss_fn, mb, plan, actions: Optional[Dict[str, str]] = None, grads_held: bool = True) -> int:
    """The in-microbatch peak of one learner microbatch under ``plan`` (and ``actions``) on the
    meta device: forward, the GRPO loss, the actions, backward, as ``allocation.Runner.run``
    runs it, under the storage meter. ``grads_held``: the trainable parameters' gradients exist
    before the microbatch (an update's later microbatches; the resident bytes count them), so
    backward adds into them; else they are allocated inside it (the first microbatch, as the
    planner's passes run: ``Runner.run`` clears them)."""
    from ..runtime.storage_meter import StorageMeter

    params = [p for p in engine.model.parameters() if p.requires_grad]

    def run():
        for p in params:
            p.grad = torch.zeros_like(p) if grads_held else None
        with StorageMeter() as meter:
            with engine.step(plan, actions=actions, track_error=False) as step:
                out = loss_fn(engine.model, mb)
                step.ensure_actions()
                out.loss.backward()
        for p in params:
            p.grad = None
        return meter.peak

    return int(_guarded(run))
