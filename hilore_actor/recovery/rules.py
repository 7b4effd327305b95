"""Which saved tensors L keeps exact: the one table; and which op outputs a partial
unit (P) keeps at each P level (``partial_saves``).

L compresses a unit's saved tensors, except the kinds below. Measured per kind on SmolLM2-135M
with its real weights (``benchmarks/results/codecs-smollm2.md``, kinds as in
``benchmarks/bench/saved_kinds.py``; relative error of one update's gradient when only that kind is
compressed in every layer): the rotated queries alone move it by 1.3% in bf16 and 7.3% in
int8, the keys by 1.3% / 7.0%, the softmax log-sum-exp by 1.5% / 3.3%, while the
projections' inputs stay at or below 0.13% in int8. Errors in queries and keys shift the
attention logits, and errors in the log-sum-exp rescale whole rows of attention
probabilities: both act multiplicatively on the attention gradient. So the attention core's
saved tensors stay exact.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

MIN_COMPRESS_NUMEL = 1024

KEEP_EXACT: Dict[str, str] = {
    "not float": "integer and boolean tensors (indices, boolean masks, RNG offsets) have no scale to take",
    "small": f"fewer than {MIN_COMPRESS_NUMEL} elements (norm statistics, LoRA scalars): nothing worth saving",
    "not finite": "inf/NaN values (additive -inf attention masks): no scale represents them, and equal masks "
    "stay shared across layers",
    "attention core": "whatever the attention module saves outside its projections: the rotated queries and "
    "keys, the values, the kernel's output and its softmax log-sum-exp (sdpa, flash or eager "
    "alike), the rotary tables",
}


def exact_reason(t: torch.Tensor, in_attention_core: bool = False) -> Optional[str]:
    """The ``KEEP_EXACT`` rule that keeps ``t`` exact under L, or None when L may compress it
    (``not finite`` is found by the codec's encode: ``Payload.finite``)."""
    if not t.is_floating_point():
        return "not float"
    if t.numel() < MIN_COMPRESS_NUMEL:
        return "small"
    if in_attention_core:
        return "attention core"
    return None


# Activations whose backward reads a sign or threshold from what they saved (ReLU's
# ``result > 0``; xIELU's ``x > 0`` and ``min(x, eps)``; Hardtanh's clip bounds at +-1 sit far
# from zero but share the form). Round-to-nearest int8 turns every value below half a
# quantum into zero, which flips those comparisons for the smallest activations and drops
# their gradient: on tiny random OPT (ReLU) and Apertus (xIELU) all-L's gradient error was
# above 5% for that alone (tests/recovery/test_rules.py compares both roundings). Inside these modules
# L's codecs keep the sign (``Codec.encode(keep_sign=True)``: a nonzero value decodes to at
# least one quantum of its sign); elsewhere they round to nearest, because sign-keeping moves
# each value below half a quantum by up to a whole one, which costs error where nothing reads
# the sign (SiLU and GELU MLPs).
SIGN_READING_ACTIVATIONS = (
    "ReLU",
    "ReLU6",
    "LeakyReLU",
    "PReLU",
    "RReLU",
    "Threshold",
    "Hardtanh",
    "Hardswish",
    "Hardsigmoid",
    "ReLUSquaredActivation",
    "XIELUActivation",
)


def reads_sign(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an activation whose backward reads a sign from its saved tensors."""
    return type(module).__name__ in SIGN_READING_ACTIVATIONS


ATTENTION_KERNELS = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)
# Other libraries' attention kernels, ``namespace::op``: what transformers' flash_attention_2 path
# (verl and OpenRLHF with remove-padding / packing: ``flash_attn_varlen_func``) and FA3 run.
# flash-attn 2.8.3 (flash_attn/flash_attn_interface.py) registers its forward kernels with
# ``torch.library.custom_op``; each returns (out, softmax_lse, S_dmask, rng_state), and its
# autograd Functions save q, k, v, out, softmax_lse (, cu_seqlens) and rng_state for backward.
# FA3 (hopper/flash_api.cpp) defines ``flash_attn_3::fwd`` -> (out, softmax_lse, out_accum,
# softmax_lse_accum). Selective checkpointing keeps an op's whole output tuple, so the replayed
# call returns the same out, log-sum-exp and RNG state, and q, k, v come from the projections'
# replay. Looked up when a partial unit runs: an op not registered then (the package not
# installed or not yet imported) is skipped.
LIBRARY_ATTENTION_KERNELS = (
    "flash_attn::_flash_attn_forward",
    "flash_attn::_flash_attn_varlen_forward",
    "flash_attn_3::fwd",
)
# What each P level keeps (the action "P:core", plan "partial:core"; "P": the default level).
PARTIAL_LEVELS: Dict[Optional[str], str] = {
    None: "the outputs of the unit's matmuls and attention kernels",
    "core": "the attention kernel's outputs alone (attention units): on a packed 2048-token microbatch the "
    "masked kernel takes about three times its unit's four projections on CPU, and keeps about a "
    "quarter of their bytes (SmolLM2: 4.6 of 17 MiB)",
}


def partial_saves(level: Optional[str] = None):
    """The ops whose outputs a partial unit (P) keeps (``PARTIAL_LEVELS``): the matmuls and
    attention kernels (torch's and ``library_kernels``), where a unit's recompute time is, or
    (``"core"``) the attention kernels alone; everything else (norms, activations, rotary,
    casts, and under ``core`` the projections) is recomputed from them, as torch's selective
    activation checkpointing does."""
    if level not in PARTIAL_LEVELS:
        raise ValueError(f"unknown P level {level!r}; levels: {sorted(k for k in PARTIAL_LEVELS if k)} or none")
    aten = torch.ops.aten
    names = ATTENTION_KERNELS + (() if level == "core" else ("mm", "addmm", "bmm", "baddbmm"))
    return {getattr(aten, n).default for n in names if hasattr(aten, n)} | library_kernels()


def library_kernels(names=None) -> set:
    """Every overload of the ``LIBRARY_ATTENTION_KERNELS`` (or ``names``) registered now."""
    out = set()
    for qualified in LIBRARY_ATTENTION_KERNELS if names is None else names:
        namespace, _, name = qualified.partition("::")
        try:
            packet = getattr(getattr(torch.ops, namespace), name)
        except (AttributeError, RuntimeError):
            continue
        out.update(getattr(packet, o) for o in packet.overloads())
    return out


CHEAP_MATMUL = 8  # a matmul whose inner size is below 1/8 of its output width is recomputed under P


def _matmul_operands(op, args):
    """(a, b) of ``a @ b`` for mm, bmm, addmm and baddbmm (None for other ops)."""
    aten = torch.ops.aten
    if op in (aten.mm.default, aten.bmm.default):
        return args[0], args[1]
    if op in (aten.addmm.default, aten.baddbmm.default):
        return args[1], args[2]
    return None


def partial_policy(level: Optional[str] = None):
    """A selective-checkpoint policy saving ``partial_saves(level)``, except matmuls that are
    cheap per output byte: a LoRA up-projection (inner size r, output the layer's width)
    costs little to recompute and would keep as many bytes as the base projection."""
    from torch.utils.checkpoint import CheckpointPolicy

    saves = partial_saves(level)

    def policy(ctx, op, *args, **kwargs):
        if op not in saves:
            return CheckpointPolicy.PREFER_RECOMPUTE
        ab = _matmul_operands(op, args)
        if ab is not None and ab[0].shape[-1] * CHEAP_MATMUL < ab[1].shape[-1]:
            return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE

    return policy
