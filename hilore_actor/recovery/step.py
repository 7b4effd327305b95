"""One microbatch under the recovery engine: plans in, actions set, memory and timings out.

``Step`` owns the step's records (``state.py``) and the decisions: compressing for L,
dropping for R, and accounting. For its block it opens the engine's ``Frame`` and installs the
saved-tensor hooks (``hooks.py``) that fill and drain the records.
"""

from __future__ import annotations

import time
import weakref
from functools import partial
from typing import Dict, Optional, Set, Union

import torch

from .codecs import RowSplit, decode, get_codec, has_rows
from .hooks import pack, set_active_step, unpack
from .labels import (
    ALLOWED,
    CHECKPOINT,
    COMPRESSED,
    EXACT,
    RECOMPUTED,
    H,
    L,
    R,
    allows,
    partial_level,
    region_kind,
    row_share,
    split_label,
)
from .rules import exact_reason
from .state import Choice, LayerState, Replay, UnitState, storage_key, unit_bytes


class Step:
    """One microbatch under the engine: its records, and the saved-tensor hooks that fill them
    while its block is open (backward must run inside the block). Made by ``engine.step``.

    Args:
        engine: the ``RecoveryEngine`` this step runs under; its ``Frame`` is this step's while open.
        plans: unit -> plan label (``labels.py``), fixed before forward.
        actions: a policy name or unit -> action label, applied before backward unless
            ``set_actions`` chooses them after forward; None: each plan's default action.
        track_error: measure each L unit's reconstruction error (one extra decode per payload).
        track_tokens: per-token input norms per unit (exposure weights, Eq. 7).
        profile: per-unit recompute and encode/decode seconds (utility, Eq. 9).
        token_scores: a pre-forward weight per token (``[B, T]`` or shorter; e.g. |advantage| on
            response tokens) that token L multiplies with each row's norm to choose its exact
            rows; None: the norms alone.
        regions: a layer with a compiled layer region (``compiled.py``) whose units are all
            planned exact (then H only) or all checkpoint runs as that one region.

    Example::

        with engine.step({"model.layers.0.mlp": "exact"}) as step:
            loss = model(ids).logits.sum()
            step.set_actions({"model.layers.0.mlp": "L:bf16"})  # compresses now
            loss.backward()
        step.bytes_by_unit(), step.reconstruction_errors()
    """

    def __init__(
        self,
        engine,
        plans: Dict[str, str],
        actions,
        track_error: bool = True,
        track_tokens: bool = False,
        profile: bool = False,
        token_scores: Optional[torch.Tensor] = None,
        regions: bool = False,
    ):
        self.engine = engine
        self.frame = engine.frame  # where the engine is; open while this step's block runs
        self.token_scores = token_scores
        self.track_error = track_error
        self.track_tokens = track_tokens
        self.profile = profile
        self._device = next((p.device for p in engine.model.parameters()), torch.device("cpu"))
        self.plans = plans  # labels: a compressed plan may name its codec ("compressed:bf16")
        self._pending_actions = actions
        self.layers = [
            LayerState(
                spec,
                [
                    UnitState(
                        u,
                        Choice(
                            plan=split_label(plans[u.name])[0],
                            codec=self._codec(plans[u.name]),
                            row_share=row_share(plans[u.name]),
                            partial_level=partial_level(plans[u.name]),
                        ),
                    )
                    for u in spec.units
                ],
            )
            for spec in engine.layer_specs
        ]
        self.units = [u for ls in self.layers for u in ls.units]
        bad = [u.name for u in self.units if u.choice.row_share is not None and not u.spec.token_wise]
        if bad:
            raise ValueError(f"token L (a row share, '@') is for token-wise units (MLP) only, not {bad[:3]}")
        self.layer_of = {u.name: ls for ls in self.layers for u in ls.units}
        self.layer_joint_plan = [all(u.choice.plan == CHECKPOINT for u in ls.units) for ls in self.layers]
        with_regions = getattr(engine, "region_layers", set()) if regions and not profile else set()
        self.region = {}  # id of a layer module -> H | R (one compiled region) | None
        for ls in self.layers:
            key = id(ls.spec.module)
            self.region[key] = region_kind(u.choice.plan for u in ls.units) if key in with_regions else None
        self.actions_set = False
        self._compressed: Dict[tuple, tuple] = {}
        self._masks: Dict[tuple, torch.Tensor] = {}
        self.kept_keys: Set[int] = set()  # storages L keeps exact by rule (held in entries until backward)
        self._hooks_ctx = None

    def keep_rows(self, unit: UnitState, x: torch.Tensor) -> None:
        """Token L: mark the unit's exact rows from its input ``x`` (``[.., rows, hidden]``) as
        the unit starts: the ``row_share`` of rows with the largest ``norm x score`` (Eq. 7's
        terms with the pre-forward score for |omega|); rows scored 0 stay compressed."""
        norms = unit.stats.token_norms
        if norms is None:
            norms = torch.linalg.vector_norm(x.detach(), dim=-1, dtype=torch.float32)
        weight = norms.reshape(-1)
        if self.token_scores is not None:
            s = self.token_scores.detach().float().to(weight.device)
            if x.dim() < 3 or s.shape[:-1] != x.shape[:-2] or s.shape[-1] > x.shape[-2]:
                raise ValueError(
                    f"{unit.name}: token_scores of shape {tuple(s.shape)} do not line up with the unit's "
                    f"input rows {tuple(x.shape[:-1])} (expected [..., <= {x.shape[-2]}])"
                )
            s = torch.nn.functional.pad(s, (0, x.shape[-2] - s.shape[-1]))  # the last position predicts nothing
            weight = weight * s.reshape(-1)
        k = min(round(unit.choice.row_share * weight.numel()), int((weight > 0).sum()))  # the one device sync
        order = torch.argsort(weight, descending=True, stable=True)
        unit.saved.row_index = (order[:k], order[k:])

    def kept_rows(self) -> Dict[str, torch.Tensor]:
        """Token L: each such unit's exact rows (bool per token row), for the rest's exposure."""
        out = {}
        for u in self.units:
            if u.saved.row_index is not None:
                kept, rest = u.saved.row_index
                out[u.name] = torch.zeros(kept.numel() + rest.numel(), dtype=torch.bool, device=kept.device)
                out[u.name][kept] = True
        return out

    def _codec(self, label: str):
        """The codec an L or compressed label names, else the engine's default."""
        base, name = split_label(label)
        return get_codec(name) if name and base in (L, COMPRESSED) else self.engine.codec

    def __enter__(self) -> "Step":
        if self.frame.step is not None:
            raise RuntimeError("hilore: an engine step is already active; steps do not nest")
        # FSDP2 parameters are DTensors between forwards: their local shard has the storage.
        # ZeRO-3's (``ds_id``) are left out: a weight still gathered now is released during the
        # step and its storage reused by activations, which would then pass for weights (a
        # gathered weight is saved as the Parameter or a view of it: ``is_param``).
        self.param_keys = {
            storage_key(p.to_local() if hasattr(p, "to_local") else p)
            for p in self.engine.model.parameters()
            if p.numel() > 0 and not hasattr(p, "ds_id")
        }
        self.frame.open(self)
        self._outer = set_active_step(self)
        self._hooks_ctx = torch.autograd.graph.saved_tensors_hooks(partial(pack, self), partial(unpack, self))
        self._hooks_ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks_ctx.__exit__(*exc)
        self.frame.close()
        set_active_step(self._outer)
        for u in self.units:  # release whatever backward did not consume
            u.release()
        for ls in self.layers:
            ls.replay = Replay()
        self._masks.clear()
        self.kept_keys.clear()

    def canonical(self, t: torch.Tensor) -> torch.Tensor:
        """One shared copy of equal attention masks. SDPA turns the boolean (packed-sequence)
        mask into a fresh additive float mask in every layer (aten's ``convert_boolean_attn_mask``)
        and the kernel saves it for backward: ``[B, 1, T, T]`` on CPU; on CUDA the efficient
        kernel saves ``attn_bias`` expanded to ``[B, H, T, T]``, a stride-0 view over the heads
        of that fresh mask (padded first when ``T`` is not aligned), or, in older torch, a
        materialised expansion. The copies are equal, so every layer keeps the first layer's
        (exact: same values, same layout); the later layers' allocations are freed with their
        kernel call. Compared: square 4-D float tensors whose heads are all alike; the first of
        a layout is checked once (``_mask_like``), the rest by value on one head."""
        if t.dim() != 4 or t.shape[-1] != t.shape[-2] or not t.is_floating_point():
            return t
        key = (tuple(t.shape), tuple(t.stride()), t.dtype, t.device)
        if key not in self._masks:
            self._masks[key] = t if _mask_like(t) else None
            return t
        first = self._masks[key]
        if first is None:
            return t
        if t.is_meta or first.data_ptr() == t.data_ptr() or torch.equal(_one_head(first), _one_head(t)):
            return first  # (meta: no values; a layout's masks are taken as the same mask)
        return t

    def compress(self, t: torch.Tensor, unit: UnitState, keep_sign: bool = False):
        """The L representation of one saved tensor (``t`` itself when a ``rules.KEEP_EXACT``
        rule keeps it exact); ``keep_sign`` for what a sign-reading activation saved (a tensor
        saved again later, as the next projection's input, shares that payload)."""
        if exact_reason(t) is not None:
            return t
        if storage_key(t) in self.kept_keys:  # a view of a storage kept exact (the attention core's output): free
            return t
        # Dedup a tensor saved several times: by its base and view geometry, so the 2-D views
        # that each projection's matmul makes of one input (q/k/v, gate/up) share one payload.
        # A weak reference to the base proves it is still the same live tensor (addresses and
        # ids are reused once a tensor is freed).
        codec = unit.choice.codec or self.engine.codec
        rows = unit.saved.row_index
        keep = rows if rows is not None and has_rows(t, sum(i.numel() for i in rows)) else None
        base = t._base if t._base is not None else t
        key = (id(base), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, codec.name, id(keep))
        hit = self._compressed.get(key)
        if hit is not None and hit[0]() is base:
            return hit[1]
        t0 = self.clock() if self.profile else 0.0
        p = codec.encode(t, keep_sign) if keep is None else RowSplit.encode(codec, t, *keep, keep_sign)
        if self.profile:
            unit.stats.codec_seconds += self.clock() - t0
        # masks with -inf (SDPA's additive mask) or NaNs cannot be scaled: keep them exact
        out = p if p.finite() else self.canonical(t)
        self._compressed[key] = (weakref.ref(base), out)
        if self.track_error and out is p:
            x = t.detach().float()
            unit.stats.err_sq += float((decode(codec, p).float() - x).pow(2).sum())
            unit.stats.norm_sq += float(x.pow(2).sum())
        return out

    def reconstruction_errors(self) -> Dict[str, float]:
        """``||z^ - z|| / (||z|| + eps)`` over each compressed unit's bundle (section 4's e_u)."""
        return {u.name: u.stats.err_sq**0.5 / (u.stats.norm_sq**0.5 + 1e-12) for u in self.units if u.stats.norm_sq > 0}

    def set_actions(self, actions: Union[str, Dict[str, str], None] = None) -> None:
        """Choose H/L/R per unit after forward (a policy name or ``{unit: action}``; units not
        named take their plan's default). Memory of downgraded bundles is released here."""
        from .policies import resolve_actions

        if self.actions_set:
            raise RuntimeError("hilore: actions were already set for this step")
        chosen = resolve_actions(actions, self.plans)
        for u in self.units:
            label = chosen[u.name]
            if not allows(self.plans[u.name], label):
                raise ValueError(
                    f"{u.name}: action {label} is not available for a {self.plans[u.name]!r} bundle "
                    f"(allowed: {ALLOWED[u.choice.plan]}; a compressed copy keeps the codec it was made with)"
                )
            a = split_label(label)[0]
            if a != H and self.region[id(self.layer_of[u.name].spec.module)] == H:
                raise ValueError(
                    f"{u.name}: its layer ran as one compiled region (every unit planned exact, "
                    f"engine.step(regions=True)) and keeps its units H, not {label}; choose actions "
                    "that keep compiled.region_units H, or run the step without regions"
                )
            u.choice.action, u.choice.label = a, label
            s = u.saved
            if a == R:
                s.entries.clear()
                s.sac = None  # a partial unit sent to R drops its kept op outputs
            elif a == L and u.choice.plan == EXACT:
                u.choice.codec = self._codec(label)
                for idx, v in list(s.entries.items()):
                    if isinstance(v, torch.Tensor) and idx not in s.external and idx not in s.kept:
                        s.entries[idx] = self.compress(v, u, keep_sign=idx in s.signed)
        for ls in self.layers:
            ls.joint = all(u.choice.action in RECOMPUTED for u in ls.units)  # P units too, under their cached modes
            if ls.joint:
                for u in ls.units:
                    u.rebuild.replay = Replay()  # the layer replay rebuilds every unit: drop their own inputs
            else:
                ls.replay = Replay()
                for u in ls.units:
                    if u.choice.action not in RECOMPUTED:
                        u.rebuild.replay = Replay()
        self._compressed.clear()
        self.actions_set = True

    def clock(self) -> float:
        """Wall time, synchronised with the device so per-unit timings are real on CUDA."""
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        return time.perf_counter()

    def unit_seconds(self) -> Dict[str, Dict[str, float]]:
        """Measured per unit (``profile=True``): ``recompute`` (forward replay in backward) and
        ``codec`` (L encode + decode) seconds."""
        return {u.name: {"recompute": u.stats.replay_seconds, "codec": u.stats.codec_seconds} for u in self.units}

    def saved_counts(self) -> Dict[str, int]:
        """How many tensors each unit saved in forward: the structure of its bundle (attention
        saves a mask only for a packed microbatch of several sequences, for instance)."""
        return {u.name: u.saved.count for u in self.units}

    def token_norms(self) -> Dict[str, torch.Tensor]:
        """Per-token L2 norm of each unit's input hidden state (``track_tokens=True``), for the
        units whose plan admits L (a ``checkpoint`` unit can only be R: no exposure needed)."""
        return {u.name: u.stats.token_norms for u in self.units if u.stats.token_norms is not None}

    def ensure_actions(self) -> None:
        if not self.actions_set:
            self.set_actions(self._pending_actions)

    def bytes_by_unit(self, shared: bool = True) -> Dict[str, Dict[str, int]]:
        """Bytes held per unit now: ``exact``, ``compressed`` and ``checkpoint`` (inputs kept for
        recomputation). ``shared=True``: each storage counted once overall; ``False``: each
        unit alone (see ``state.unit_bytes``)."""
        return unit_bytes(self.layers, shared)

    def actions(self, labels: bool = False) -> Dict[str, str]:
        """H/L/R per unit; ``labels``: as chosen, L with its codec when one was named (``L:bf16``)."""
        return {u.name: (u.choice.label if labels else u.choice.action) for u in self.units}


def _one_head(t: torch.Tensor) -> torch.Tensor:
    """Head 0 of a ``[B, H, T, S]`` tensor whose heads are alike (all of them when they are
    views of one, stride 0): what an equality test of two such masks needs to read."""
    return t[:, :1] if t.shape[1] > 1 and t.stride(1) == 0 else t


def _mask_like(t: torch.Tensor) -> bool:
    """Whether a 4-D float tensor can be an attention mask broadcast over heads: one head, a
    stride-0 head dimension, or heads that are all equal (a materialised expansion; one full
    read, once per layout and step). Attention probabilities (eager attention) differ by head."""
    if t.shape[1] == 1 or t.stride(1) == 0:
        return True
    return not t.is_meta and bool(torch.equal(t[:, :1].expand_as(t), t))  # (meta: no values to compare)
