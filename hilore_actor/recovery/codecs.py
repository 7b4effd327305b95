"""Low-precision codecs for the L action (HILORE.md section 3).

A codec turns one saved activation into a compact payload and back. Scales are per token:
the tensor is viewed as rows of its last dimension (hidden / head / feature channels) and each
row gets its own absmax scale, so one outlier token does not flatten the rest.

Adding a codec is a subclass with ``encode``/``decode`` and a ``register`` call.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

import torch


@dataclass
class Payload:
    data: torch.Tensor  # quantised values, [rows, cols]
    scale: torch.Tensor  # [rows, 1]
    shape: Tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()


class Codec:
    name = "base"

    def encode(self, x: torch.Tensor) -> Payload:
        raise NotImplementedError

    def decode(self, p: Payload) -> torch.Tensor:
        raise NotImplementedError


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.detach().reshape(-1, x.shape[-1]) if x.dim() > 0 else x.detach().reshape(1, 1)


class AbsmaxCodec(Codec):
    """Per-row absmax scaling into a narrow dtype: ``q = x / s``, ``s = amax|row| / qmax``."""

    def __init__(self, name: str, qdtype: torch.dtype, qmax: float, rounding: bool):
        self.name, self.qdtype, self.qmax, self.rounding = name, qdtype, qmax, rounding

    def encode(self, x: torch.Tensor) -> Payload:
        rows = _rows(x)
        # max(amax, -amin): two fast reductions, no |x| temporary (aminmax is slower on CPU)
        absmax = torch.maximum(rows.amax(dim=-1, keepdim=True), rows.amin(dim=-1, keepdim=True).neg_())
        scale = absmax.float().clamp_(min=1e-30) / self.qmax
        q = rows * scale.reciprocal()  # |q| <= qmax by construction: rounding cannot overflow
        if self.rounding:
            q = q.round_()
        return Payload(q.to(self.qdtype), scale, tuple(x.shape), x.dtype)

    def decode(self, p: Payload) -> torch.Tensor:
        if p.data.dtype == torch.int8:  # int8 x float32 promotes in one kernel
            return torch.mul(p.data, p.scale).to(p.dtype).reshape(p.shape)
        return (p.data.float() * p.scale).to(p.dtype).reshape(p.shape)  # float8 does not promote


CODECS: Dict[str, Codec] = {}


def register(codec: Codec) -> Codec:
    CODECS[codec.name] = codec
    return codec


register(AbsmaxCodec("int8", torch.int8, 127.0, rounding=True))
if hasattr(torch, "float8_e4m3fn"):  # fp8 needs a torch build with the float8 dtypes
    register(AbsmaxCodec("fp8-e4m3", torch.float8_e4m3fn, 448.0, rounding=False))
    register(AbsmaxCodec("fp8-e5m2", torch.float8_e5m2, 57344.0, rounding=False))


def get_codec(name: str) -> Codec:
    if name not in CODECS:
        raise ValueError(f"unknown codec {name!r}; available here: {sorted(CODECS)}")
    return CODECS[name]


def reconstruction_error(x: torch.Tensor, codec: Codec, eps: float = 1e-12) -> float:
    """``||decode(encode(x)) - x|| / (||x|| + eps)`` (the ``e_u`` of section 4)."""
    x = x.detach()
    xh = codec.decode(codec.encode(x))
    return float((xh.float() - x.float()).norm() / (x.float().norm() + eps))
