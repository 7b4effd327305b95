"""Low-precision codecs for the L action (docs/DESIGN.md section 3).

A codec turns one saved activation into a compact payload and back. The tensor is viewed as
rows of its last dimension (hidden / head / feature channels). Why several codecs: real LLM
activations carry a few outlier channels far above the rest (LLM.int8()), and one absmax
scale per token then spends its whole range on them; on SmolLM2's real weights per-token int8
gives a gradient error five times that of random weights. The remedies, each in
plain torch ops so it runs on CPU and CUDA alike:

- ``int8``, ``fp8-e4m3``, ``fp8-e5m2``: one absmax scale per row (per token);
- ``int8-g64``, ``int8-g128``, ``fp8-e4m3-b32``: one scale per row per group of 64 / 128 / 32
  channels (the MX / group-wise idea): an outlier only flattens its own group; a row narrower
  than a group is one group;
- ``int8-outlier``: per-row int8 with the ``k`` channels of largest magnitude kept exact in
  a side table (chosen per tensor from its own column absmax, so no calibration is needed);
- ``bf16``: a plain bfloat16 copy: half of float32, three significant digits, no scale;
- ``int2``: per-row absmax onto {-1, 0, 1} (stored as int8): deliberately coarse (relative
  error 0.85 on Gaussian rows of 576, int8's 0.0075), for positive controls (a run that must degrade; the fidelity
  study's control), never for a plan meant to train well.

Every payload reports its exact stored bytes: values, scales and side tables.
Adding a codec is a subclass with ``encode``/``decode`` and a ``register`` call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch


@dataclass
class Payload:
    data: torch.Tensor  # quantised values, [rows, cols] (cols padded to whole groups)
    scale: torch.Tensor  # [rows, groups] (empty for scale-free codecs)
    shape: Tuple[int, ...]
    dtype: torch.dtype
    extra: Tuple[torch.Tensor, ...] = ()  # side tables (outlier channels and their values)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale) + tuple(self.extra))

    def finite(self) -> bool:
        """False for tensors with inf/NaN (additive -inf attention masks): they stay exact (and
        equal masks stay shared across layers). Scaled codecs see it in their scales. On the
        meta device there are no values: a payload is sized as a finite one."""
        if self.data.is_meta:
            return True
        return bool(torch.isfinite(self.scale if self.scale.numel() else self.data).all())


@dataclass
class RowSplit:
    """Token-granular L of one saved tensor: the rows ``kept`` lists (high-exposure tokens)
    exact, the ``rest`` compressed; rows are the tensor's leading dimensions (tokens). Index
    tensors, not a boolean mask, so neither side needs a device sync (boolean indexing does);
    they are the unit's, shared by its tensors (``Step.keep_rows``)."""

    kept: torch.Tensor  # int64 [kept rows]
    rest_rows: torch.Tensor  # int64 [other rows]
    exact: torch.Tensor  # [kept rows, cols]
    rest: Optional[Payload]  # the other rows, compressed (None: every row kept)
    codec: "Codec"
    shape: Tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.exact.numel() * self.exact.element_size() + (self.rest.nbytes if self.rest else 0)

    def finite(self) -> bool:
        return self.rest is None or self.rest.finite()

    @classmethod
    def encode(
        cls, codec: "Codec", x: torch.Tensor, kept: torch.Tensor, rest_rows: torch.Tensor, keep_sign: bool = False
    ) -> "RowSplit":
        rows = x.detach().reshape(-1, x.shape[-1])
        rest = codec.encode(rows.index_select(0, rest_rows), keep_sign) if rest_rows.numel() else None
        return cls(kept, rest_rows, rows.index_select(0, kept), rest, codec, tuple(x.shape), x.dtype)

    def decode(self) -> torch.Tensor:
        n = self.kept.numel() + self.rest_rows.numel()
        out = torch.empty((n, self.shape[-1]), dtype=self.dtype, device=self.exact.device)
        out.index_copy_(0, self.kept, self.exact)
        if self.rest is not None:
            out.index_copy_(0, self.rest_rows, self.codec.decode(self.rest).reshape(-1, self.shape[-1]).to(self.dtype))
        return out.reshape(self.shape)


PAYLOADS = (Payload, RowSplit)  # what an L entry may hold instead of a tensor


def has_rows(x: torch.Tensor, rows: int) -> bool:
    """Whether ``x`` is laid out as ``rows`` token rows (its leading dimensions) of features."""
    return x.dim() >= 2 and x.shape[:-1].numel() == rows


def decode(codec: "Codec", p) -> torch.Tensor:
    """A payload back to a tensor: a ``RowSplit`` decodes itself, a ``Payload`` by ``codec``."""
    return p.decode() if isinstance(p, RowSplit) else codec.decode(p)


class Codec:
    """``encode(x, keep_sign)``: with ``keep_sign`` no nonzero value of ``x`` decodes to zero or
    to the other sign (for the activations of ``rules.SIGN_READING_ACTIVATIONS``)."""

    name = "base"

    def encode(self, x: torch.Tensor, keep_sign: bool = False) -> Payload:
        raise NotImplementedError

    def decode(self, p: Payload) -> torch.Tensor:
        raise NotImplementedError


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.detach().reshape(-1, x.shape[-1]) if x.dim() > 0 else x.detach().reshape(1, 1)


def _absmax(rows: torch.Tensor) -> torch.Tensor:
    # max(amax, -amin): two fast reductions, no |x| temporary (aminmax is slower on CPU)
    return torch.maximum(rows.amax(dim=-1, keepdim=True), rows.amin(dim=-1, keepdim=True).neg_())


class AbsmaxCodec(Codec):
    """Absmax scaling into a narrow dtype, ``q = x / s``, ``s = amax|group| / qmax``, with one
    scale per row (``group=None``) or per row and group of ``group`` channels (the last
    group is zero-padded; the padding is stored and counted)."""

    def __init__(self, name: str, qdtype: torch.dtype, qmax: float, rounding: bool, group: Optional[int] = None):
        self.name, self.qdtype, self.qmax, self.rounding, self.group = name, qdtype, qmax, rounding, group

    def encode(self, x: torch.Tensor, keep_sign: bool = False) -> Payload:
        rows = _rows(x)
        group = self._group(rows.shape[1])
        if group is not None:
            pad = -rows.shape[1] % group
            if pad:
                rows = torch.nn.functional.pad(rows, (0, pad))
            rows = rows.reshape(rows.shape[0], -1, group)
        scale = _absmax(rows).float().clamp_(min=1e-30) / self.qmax
        q = rows * scale.reciprocal()  # |q| <= qmax by construction: rounding cannot overflow
        if self.rounding and keep_sign:  # below half a quantum: one quantum of the value's sign, not zero
            r = q.round()
            q = torch.where(r.eq(0) & q.ne(0), q.sign(), r)
        elif self.rounding:
            q = q.round_()
        elif keep_sign:  # a float8 cast flushes values below its subnormals to zero: lift them to its smallest normal
            tiny = torch.finfo(self.qdtype).tiny
            q = torch.where(q.ne(0) & q.abs().lt(tiny), q.sign() * tiny, q)
        q = q.to(self.qdtype)
        if group is not None:
            q, scale = q.reshape(q.shape[0], -1), scale.squeeze(-1)
        return Payload(q, scale, tuple(x.shape), x.dtype)

    def _group(self, cols: int) -> Optional[int]:
        """Channels per scale for rows of ``cols``: a row narrower than a group (LoRA's rank-r
        intermediates) is one group, unpadded."""
        return None if self.group is None else min(self.group, max(1, cols))

    def decode(self, p: Payload) -> torch.Tensor:
        group = self._group(p.shape[-1] if p.shape else 1)
        data = p.data if group is None else p.data.reshape(p.data.shape[0], -1, group)
        scale = p.scale if group is None else p.scale.unsqueeze(-1)
        if data.dtype == torch.int8:  # int8 x float32 promotes in one kernel
            out = torch.mul(data, scale)
        else:
            out = data.float() * scale  # float8 does not promote
        out = out.reshape(out.shape[0], -1)
        cols = p.shape[-1] if p.shape else 1
        return out[:, :cols].to(p.dtype).reshape(p.shape)


class OutlierCodec(Codec):
    """Per-row int8 over all but the ``k`` channels of largest absmax in this tensor, which
    are kept exact in a side table (their indices and values), so the outliers no longer set
    every token's scale. Channel choice per tensor: one column reduction and a top-k."""

    def __init__(self, name: str, k: int):
        self.name, self.k = name, k
        self.inner = AbsmaxCodec(name, torch.int8, 127.0, rounding=True)

    def encode(self, x: torch.Tensor, keep_sign: bool = False) -> Payload:
        rows = _rows(x)
        k = min(self.k, rows.shape[1] - 1)
        if k <= 0:
            return self.inner.encode(x, keep_sign)
        col = torch.maximum(rows.amax(dim=0), rows.amin(dim=0).neg())
        idx = col.topk(k).indices
        kept = rows.index_select(1, idx)
        rest = rows.index_fill(1, idx, 0.0)
        p = self.inner.encode(rest, keep_sign)
        return Payload(p.data, p.scale, tuple(x.shape), x.dtype, extra=(idx.to(torch.int32), kept))

    def decode(self, p: Payload) -> torch.Tensor:
        if not p.extra:
            return self.inner.decode(p)
        idx, kept = p.extra
        out = self.inner.decode(Payload(p.data, p.scale, (p.data.shape[0], p.data.shape[1]), p.dtype))
        out.index_copy_(1, idx.long(), kept.to(out.dtype))
        return out.reshape(p.shape)


class CastCodec(Codec):
    """A copy in a narrower float dtype (``bf16``): no scales, keeps infinities."""

    def __init__(self, name: str, qdtype: torch.dtype):
        self.name, self.qdtype = name, qdtype

    def encode(self, x: torch.Tensor, keep_sign: bool = False) -> Payload:  # a float cast keeps signs
        return Payload(x.detach().to(self.qdtype), torch.empty(0), tuple(x.shape), x.dtype)

    def decode(self, p: Payload) -> torch.Tensor:
        return p.data.to(p.dtype)


CODECS: Dict[str, Codec] = {}


def register(codec: Codec) -> Codec:
    CODECS[codec.name] = codec
    return codec


register(AbsmaxCodec("int8", torch.int8, 127.0, rounding=True))
register(AbsmaxCodec("int8-g64", torch.int8, 127.0, rounding=True, group=64))
register(AbsmaxCodec("int8-g128", torch.int8, 127.0, rounding=True, group=128))
register(OutlierCodec("int8-outlier", k=8))
register(CastCodec("bf16", torch.bfloat16))
register(AbsmaxCodec("int2", torch.int8, 1.0, rounding=True))  # ternary: positive controls only
if hasattr(torch, "float8_e4m3fn"):  # fp8 needs a torch build with the float8 dtypes
    register(AbsmaxCodec("fp8-e4m3", torch.float8_e4m3fn, 448.0, rounding=False))
    register(AbsmaxCodec("fp8-e5m2", torch.float8_e5m2, 57344.0, rounding=False))
    register(AbsmaxCodec("fp8-e4m3-b32", torch.float8_e4m3fn, 448.0, rounding=False, group=32))


# The default L levels (``--hilore.codec``, the benchmark's ``--codec``; the first is the engine's):
# the best set the codec benchmark found on SmolLM2's real weights with the attention core kept
# exact (benchmarks/results/codecs-smollm2.md): group-wise int8, the cheapest codec at >= 3x
# with the lowest all-L error, and bf16, 2x at a fraction of its error, for the riskier units.
DEFAULT_CODECS = "int8-g64,bf16"


def get_codec(name: str) -> Codec:
    if name not in CODECS:
        raise ValueError(f"unknown codec {name!r}; available here: {sorted(CODECS)}")
    return CODECS[name]


def reconstruction_error(x: torch.Tensor, codec: Codec, eps: float = 1e-12) -> float:
    """``||decode(encode(x)) - x|| / (||x|| + eps)`` (the ``e_u`` of section 4)."""
    x = x.detach()
    xh = codec.decode(codec.encode(x))
    return float((xh.float() - x.float()).norm() / (x.float().norm() + eps))
