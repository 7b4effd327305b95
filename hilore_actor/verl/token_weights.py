"""omega (Eq. 4) from verl's own loss, in the layout of the model's input.

verl's ``prepare_model_outputs`` returns the log-probs (and entropy) as jagged nested tensors
over every token of every packed sequence (element t is log p(token t+1): its labels are the
rolled inputs), and its loss slices the responses out of their flat values
(``verl.workers.utils.padding.no_padding_2_padding``). ``differentiable`` picks them out, and
``flat_gradient`` turns ``torch.autograd.grad(loss, them)`` into d loss / d log-prob per flat
token, whatever ``loss_agg_mode``, KL or entropy term the recipe configured. ``flat_mask`` marks
the positions that loss reads, with the same slicing; ``to_input_layout`` places flat values
where the model saw those tokens: ``[1, nnz]`` packed (remove-padding) or ``[bsz, max_len]``
left-aligned (padded), the layout of the units' token norms (Eq. 7).

Imports torch only; the verl helper is imported where used.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

KEYS = ("log_probs", "entropy")


def differentiable(model_output: Dict) -> Dict[str, torch.Tensor]:
    """``model_output[k]`` for k in ``KEYS`` (when present and differentiable) replaced by its
    flat values, returned per key: verl's slicing takes a flat ``(total_nnz,)`` tensor as it
    takes a nested one, and a gradient w.r.t. a flat tensor is a plain one. (A crash inside
    verl's micro-batch scope comes from the CPU meter's profiler stopping there, not from a
    nested graph: ``fsdp_engine.py``.)"""
    held = {}
    for k in KEYS:
        t = model_output.get(k)
        if isinstance(t, torch.Tensor) and t.requires_grad:
            held[k] = model_output[k] = t.values() if t.is_nested else t
    return held


def flat_gradient(grad: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """A gradient w.r.t. a (nested) output as a plain flat float32 tensor, copied (it outlives
    the micro-batch's graph in ``Microbatches.weights``)."""
    if grad is None:
        n = like.values().shape[0] if like.is_nested else like.numel()
        return torch.zeros(n, device=like.device)
    return (grad.values() if grad.is_nested else grad.reshape(-1)).detach().float().clone()


def flat_mask(data, nnz: int) -> torch.Tensor:
    """1.0 at the flat positions whose log-prob verl's loss reads (a response token under
    ``response_mask``), else 0: the slicing of ``no_padding_2_padding``, applied to positions."""
    from verl.workers.utils.padding import no_padding_2_padding

    where = no_padding_2_padding(torch.arange(1, nnz + 1, dtype=torch.float64), data)  # 0 = padding
    resp = data["response_mask"]
    resp = resp.to_padded_tensor(0) if resp.is_nested else resp
    resp = resp[:, : where.shape[1]].to(torch.float64)
    keep = (where > 0) & (resp.to(where.device) > 0)
    mask = torch.zeros(nnz, dtype=torch.float64)
    mask[(where[keep] - 1).long().cpu()] = 1.0
    return mask


def to_input_layout(
    flat: torch.Tensor, offsets: torch.Tensor, packed: bool, width: Optional[int] = None
) -> torch.Tensor:
    """``flat`` [nnz] as the model's input saw the tokens: ``[1, nnz]`` when packed, else
    ``[bsz, width]`` with sequence i at row i from column 0 (zeros after it)."""
    if packed:
        return flat.reshape(1, -1)
    offsets = offsets.to("cpu", torch.long)
    lens = offsets.diff()
    width = int(width if width is not None else lens.max())
    out = flat.new_zeros(len(lens), width)
    for i, (a, n) in enumerate(zip(offsets[:-1].tolist(), lens.tolist())):
        out[i, :n] = flat[a : a + n]
    return out
