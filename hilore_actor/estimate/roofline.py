"""Time from FLOPs: the stated model behind the estimate's speed figures.

Each unit's forward is counted in FLOPs from its shapes: every ``nn.Linear`` inside it
(peft's LoRA A and B included) costs ``2 T in out``; attention's core costs FlashAttention-2's
count, ``4 s^2 h d`` per sequence of ``s`` tokens forward, halved for causal attention, and 2.5
times that backward (FA2's five matmuls against two). A linear's backward costs its forward
once for the input gradient and once more where its weight trains. Time is FLOPs over the
device's dense bf16 peak times ``efficiency`` (one number for every matmul, printed beside every
figure). Elementwise work (norms, activations, rotary, the loss), the optimizer step and
communication are left out: they are the same under every plan, so they dilute a plan's gain
over gc but do not change which plan wins.

- R recomputes a unit in backward: its forward once more. H removes that; L removes it and adds
  its codec, which is memory-bound: encode reads the exact bundle and writes the copy, decode
  reads the copy and writes the bundle back, at the device's memory bandwidth.
- The update under gc is every unit's forward, backward and recompute, plus the head; under a
  plan, less what its H and L units remove.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

import torch

GiB = 2**30


@dataclass(frozen=True)
class Device:
    name: str
    memory_bytes: int  # the capacity torch reports (torch.cuda.mem_get_info's total)
    bf16_flops: float  # dense bf16 tensor-core peak, FLOP/s
    memory_bandwidth: float  # device memory, bytes/s
    host_bandwidth: float  # device <-> host, bytes/s, one direction, as achieved over the link


# Vendor data sheets' dense (no sparsity) bf16 peaks and memory bandwidths; host links as achieved
# over PCIe (Gen5 x16 ~55 GB/s, Gen4 x16 ~25 GB/s). ``local`` is measured (``local_device``).
DEVICES: Dict[str, Device] = {
    "h100": Device("H100-80GB SXM", int(79.2 * GiB), 989e12, 3.35e12, 55e9),
    "h200": Device("H200 SXM", int(139.8 * GiB), 989e12, 4.8e12, 55e9),
    "a100": Device("A100-80GB SXM", int(79.2 * GiB), 312e12, 2.04e12, 25e9),
    "l40s": Device("L40S 48GB (the paper's GPU)", int(44.5 * GiB), 362e12, 0.864e12, 25e9),
}
ALIASES = {"h100-80gb": "h100", "a100-80gb": "a100", "h200-141gb": "h200", "l40s-48gb": "l40s"}


def local_device(seconds: float = 0.5) -> Device:
    """This machine, measured: float32 matmul FLOP/s on its threads (the CPU learner runs
    float32) and a large copy's bandwidth; host and device memory are one."""
    import time

    import psutil

    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        reps += 1
    flops = 2 * n**3 * reps / (time.perf_counter() - t0)
    x = torch.empty(64 * 2**20 // 4)
    y = torch.empty_like(x)
    y.copy_(x)
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds / 2:
        y.copy_(x)
        reps += 1
    bandwidth = 2 * x.numel() * 4 * reps / (time.perf_counter() - t0)
    return Device("local (this machine, measured)", int(psutil.virtual_memory().total), flops, bandwidth, bandwidth)


def device(name: str) -> Device:
    """A preset by name (``KeyError`` names them), or ``local``, measured."""
    key = ALIASES.get(name.lower(), name.lower())
    if key == "local":
        return local_device()
    if key not in DEVICES:
        raise KeyError(f"unknown device {name!r}; presets: {', '.join(DEVICES)}, local")
    return DEVICES[key]


def _linears(modules) -> list:
    seen, out = set(), []
    for m in modules:
        for sub in m.modules():
            if isinstance(sub, torch.nn.Linear) and id(sub) not in seen:
                seen.add(id(sub))
                out.append(sub)
    return out


@dataclass
class UnitFlops:
    forward: float
    backward: float


def unit_flops(spec, tokens: int, sequences: int, config) -> UnitFlops:
    """Forward and backward FLOPs of one recovery unit (``recovery.units.UnitSpec``) over
    ``tokens`` tokens in ``sequences`` equal causal sequences."""
    fwd = bwd = 0.0
    for lin in _linears(spec.modules):
        f = 2.0 * tokens * lin.in_features * lin.out_features
        fwd += f
        bwd += f * (2 if lin.weight.requires_grad else 1)
    if spec.attention is not None:
        heads = config.num_attention_heads
        dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        s = tokens / max(1, sequences)
        core = sequences * 4.0 * s * s * heads * dim / 2  # causal
        fwd += core
        bwd += 2.5 * core
    return UnitFlops(fwd, bwd)


def head_flops(tokens: int, hidden: int, vocab: int, trained: bool, chunked: bool) -> UnitFlops:
    """The LM head: forward ``2 T H V``; backward the input gradient (and the weight's when it
    trains), plus, chunked, the logits recomputed per chunk."""
    f = 2.0 * tokens * hidden * vocab
    return UnitFlops(f, f * ((2 if trained else 1) + (1 if chunked else 0)))


def seconds(flops: float, dev: Device, efficiency: float) -> float:
    return flops / (dev.bf16_flops * efficiency)


def codec_seconds(exact_bytes: float, copy_bytes: float, dev: Device) -> float:
    """L's encode and decode: the exact bundle read and written once, the copy written and read once."""
    return 2.0 * (exact_bytes + copy_bytes) / dev.memory_bandwidth
