"""OpenRLHF's ``Actor.forward`` through the chunked head (``--hilore.chunked_head``).

OpenRLHF's forward (openrlhf/models/actor.py, 0.11) runs the whole HF model, casts the full
``[tokens, vocab]`` logits to float32, divides them by the temperature, and takes the label
log-probs (and, with ``return_entropy``, every position's entropy) from them: the largest
tensors of a learner step (https://github.com/OpenRLHF/OpenRLHF/issues/1047). This replacement keeps the signature and
the outputs the PPO path reads (action log-probs ``[B, A]``, zero off the action mask;
``output.entropy`` ``[B, T-1]``) and computes them from the decoder's last hidden state with
``models.chunked_head.ChunkedTokenLogProbs``, so the full logits never exist.

The call still goes through ``actor.model``: after ``strategy.prepare`` that is the DeepSpeed
engine, whose ``forward`` hooks the outputs to run ZeRO's backward prologue (DeepSpeed 0.19:
``register_output_backward_hooks``); calling the decoder around it would skip that. So the
wrapped module's ``forward`` is swapped for the duration of the call only.

Falls back to OpenRLHF's own forward where the chunked head does not apply: no action mask
(logits wanted), ring attention, multimodal inputs, MoE auxiliary loss (``output.aux_loss``), and
logits that are not the head applied to the last hidden state (``head_is_linear``).
Packed samples use OpenRLHF's own unpad/pad helpers (they need flash-attn, as packing does).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import torch

from ..models.chunked_head import ChunkedTokenLogProbs, head_chunk_rows, head_is_linear


def _inner(model):
    """The HF (or peft) model: under a DeepSpeed engine, its ``module``."""
    return getattr(model, "module", model)


def _falls_back(actor, action_mask, ring_attn_group, allgather_logits, mm_inputs) -> bool:
    cfg = getattr(_inner(actor.model), "config", None)
    return (
        action_mask is None
        or ring_attn_group is not None
        or allgather_logits
        or bool(mm_inputs)
        or getattr(actor, "is_vlm", False)
        or bool(getattr(cfg, "output_router_logits", False))
        or not head_is_linear(_inner(actor.model))
    )


def _head_pass(actor, ids, attention_mask, position_ids, labels, entropy: bool, chunk: Optional[int]):
    """Decoder -> chunked head, run as the wrapped module's forward inside ``actor.model(...)``."""
    inner = _inner(actor.model)
    temperature = float(getattr(actor, "temperature", 1.0) or 1.0)

    def forward(input_ids, attention_mask=None, position_ids=None):
        hidden = inner.get_decoder()(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        head = inner.get_output_embeddings()
        H = hidden.shape[-1]
        rows = chunk or head_chunk_rows(hidden.device.type, head.weight.shape[0], H, head.weight.dtype)
        out = ChunkedTokenLogProbs.apply(
            hidden.reshape(-1, H), head.weight, head.bias, labels.reshape(-1), rows, 1.0 / temperature, entropy
        )
        lp, ent = out if entropy else (out, None)
        shape = input_ids.shape
        return {"log_probs": lp.view(shape), "entropy": ent.view(shape) if ent is not None else None}

    inner.forward = forward
    try:
        return actor.model(ids, attention_mask=attention_mask, position_ids=position_ids)
    finally:
        del inner.forward  # the class's forward again


def install(actor, chunk: Optional[int] = None) -> None:
    """Give ``actor`` (an OpenRLHF ``Actor``) a chunked-head ``forward``; ``chunk``: head rows
    per piece (default: ``head_chunk_rows``, the job's rule)."""
    original = actor.forward

    def forward(
        sequences,
        action_mask=None,
        attention_mask=None,
        return_output=False,
        allgather_logits=False,
        return_logprobs=False,
        ring_attn_group=None,
        packed_seq_lens=None,
        return_entropy=False,
        **mm_inputs,
    ):
        if _falls_back(actor, action_mask, ring_attn_group, allgather_logits, mm_inputs):
            return original(
                sequences,
                action_mask,
                attention_mask,
                return_output,
                allgather_logits,
                return_logprobs,
                ring_attn_group,
                packed_seq_lens,
                return_entropy,
                **mm_inputs,
            )
        batch, seqlen = sequences.shape
        if actor.packing_samples:
            from openrlhf.models.ring_attn_utils import gather_and_pad_tensor, unpad_and_slice_tensor

            ids, position_ids, labels, pad_len, indices = unpad_and_slice_tensor(sequences, attention_mask, None)
            out = _head_pass(actor, ids, None, position_ids, labels, return_entropy, chunk)
            unpack = lambda t: gather_and_pad_tensor(t, None, pad_len, indices, batch, seqlen)  # noqa: E731
        else:
            labels = torch.roll(sequences, shifts=-1, dims=1)
            position_ids = attention_mask.long().cumsum(-1) - 1
            position_ids.masked_fill_(attention_mask == 0, 1)
            out = _head_pass(actor, sequences, attention_mask, position_ids, labels, return_entropy, chunk)
            unpack = lambda t: t  # noqa: E731
        log_probs = unpack(out["log_probs"])[:, :-1]
        action_log_probs = log_probs[:, -action_mask.shape[1] :] * action_mask.float()
        if not return_output:
            return action_log_probs
        output = SimpleNamespace(logits=None, aux_loss=None)
        if return_entropy:
            output.entropy = unpack(out["entropy"])[:, :-1]
        return action_log_probs, output

    actor.forward = forward
