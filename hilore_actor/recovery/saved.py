"""The saved-tensor hooks of one engine step: how a tensor autograd saves in forward becomes a
handle into its unit's store (``pack``), and how backward gets it back (``unpack``: the stored
tensor, its decoded L copy, or a recomputation).

``step.py`` installs these hooks for one microbatch and ``engine.py`` replays units for them;
both import this module and neither imports the other. ``pack`` and ``unpack`` read the step's
engine only through attributes (``attention_core_exact``, the attention-core depth counters,
``codec``, ``_recompute``), so the mechanism keeps one direction: engine -> step -> saved.
"""

from __future__ import annotations

import torch

from .codecs import PAYLOADS, decode
from .state import CHECKPOINT, COMPRESSED, PARTIAL, RECOMPUTED, UnitState, storage_key
from .zero3 import gathered_alias, is_partitioned


class Handle:
    """What autograd holds for a tensor a unit saved: the unit and the tensor's index in it."""

    __slots__ = ("unit", "idx")

    def __init__(self, unit: UnitState, idx: int):
        self.unit, self.idx = unit, idx


def is_param(t: torch.Tensor, st) -> bool:
    """Parameters and their views pass through untouched: never copied, never counted.

    ``param_keys`` holds the storages of the model's parameters as the step began. FSDP2 and
    ZeRO-3 substitute other parameters while a module runs (FSDP2's unsharded parameter, a view
    of its all-gather buffer; ZeRO-3's gathered ``.data``), and ``F.linear`` saves a transposed
    view of them, whose storage is in no such set. The view's ``_base`` names the parameter;
    keeping it (not a copy) also lets FSDP2 free that storage after forward and refill it for
    backward, as plain autograd would."""
    return (
        isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter) or storage_key(t) in st.param_keys
    )


def pack(st, t: torch.Tensor):
    """Forward: file ``t`` under the running unit as its plan says (exact, compressed, or
    nothing for checkpoint and partial plans) and return its handle."""
    eng = st.engine
    if eng._step is not st or st.mode != "forward":
        return t
    if st.current is None:  # outside the units; an H layer region's tensors are plain autograd's
        return st.canonical(t) if st.in_region else t
    if is_param(t, st):
        return t
    u = st.current
    idx = u.n_saved
    u.n_saved += 1
    ext = storage_key(t) in u.ext_keys
    if ext:
        u.external.add(idx)
    if eng._sign_depth > 0:
        u.signed.add(idx)
    if u.plan in (CHECKPOINT, PARTIAL):
        u.entries[idx] = None
    elif ext:
        u.entries[idx] = st.canonical(t)
    elif eng.attention_core_exact and eng._core_depth > 0 and eng._child_depth == 0:
        u.kept.add(idx)  # the attention core: exact even under L (rules.KEEP_EXACT)
        u.entries[idx] = st.canonical(t)
        st.kept_keys.add(storage_key(u.entries[idx]))  # the storage held (a shared mask: the first copy's)
    elif u.plan == COMPRESSED and eng.compiled and not t.is_contiguous() and torch._debug_has_internal_overlap(t) != 0:
        u.entries[idx] = st.canonical(t)  # overlapping elements (expanded): no strides to decode into
    elif u.plan == COMPRESSED:
        u.entries[idx] = st.compress(t, u, keep_sign=idx in u.signed)
        if eng.compiled and isinstance(u.entries[idx], PAYLOADS) and not t.is_contiguous():
            u.strides[idx] = t.stride()  # the compiled backward asserts the saved strides (compiled.py)
    else:
        u.entries[idx] = st.canonical(t)
    return Handle(u, idx)


def unpack(st, h):
    """Backward: the tensor behind ``h``, exact, decoded (L) or recomputed (R, P)."""
    if isinstance(h, torch.Tensor):
        return gathered_alias(h) if is_partitioned(h) else h
    eng = st.engine
    if eng._step is not st:
        raise RuntimeError(
            "hilore: backward ran after its engine step ended; call loss.backward() inside `with engine.step():`"
        )
    st.ensure_actions()
    u, idx = h.unit, h.idx
    if u.action in RECOMPUTED:
        if idx not in u.recomputed:
            eng._recompute(st, u)
        return u.recomputed.pop(idx)
    if idx not in u.entries:
        raise RuntimeError(f"hilore: saved tensor {idx} of {u.name} was already used; one backward per engine step")
    v = u.entries.pop(idx)
    if not isinstance(v, PAYLOADS):
        return v
    t0 = st.clock() if st.profile else 0.0
    out = decode(u.codec or eng.codec, v)
    stride = u.strides.pop(idx, None)
    if stride is not None:
        out = torch.empty_strided(out.shape, stride, dtype=out.dtype, device=out.device).copy_(out)
    if st.profile:
        u.codec_seconds += st.clock() - t0
    return out
