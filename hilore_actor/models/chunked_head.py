"""Token log-probs straight from the last hidden state, without materialising the logits.

The LM head turns ``[N, H]`` hidden states into ``[N, V]`` logits; with V in the tens of
thousands, the float32 logits, their log-softmax and their gradient are the largest tensors of
a GRPO learner step (OpenRLHF's ``Actor.forward`` casts the full logits to fp32) and set its
peak. Here the head runs ``chunk`` rows at a time: forward keeps only each token's
log-normaliser ``lse`` ([N] floats); backward recomputes a chunk's logits, forms
``softmax = exp(logits - lse)`` and the gradient ``g (onehot - softmax)`` in place, and
accumulates the hidden-state (and, when the head trains, weight) gradients. The extra cost is
one more head matmul; the memory freed becomes budget for keeping activations.
Numerically this is the same computation as the plain head in a different summation order
(differences at float rounding level, not bitwise).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def default_chunk(vocab: int, target_bytes: int = 32 * 2**20) -> int:
    return max(16, target_bytes // (4 * vocab))


class ChunkedTokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk: int):
        n = hidden.shape[0]
        out = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        for i in range(0, n, chunk):
            logits = F.linear(hidden[i:i + chunk], weight, bias).float()
            lse[i:i + chunk] = torch.logsumexp(logits, dim=-1)
            out[i:i + chunk] = logits.gather(-1, labels[i:i + chunk, None]).squeeze(-1) - lse[i:i + chunk]
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        gh = torch.empty_like(hidden) if need_h else None
        gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        gb = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        c = ctx.chunk
        for i in range(0, hidden.shape[0], c):
            h = hidden[i:i + c]
            g = grad[i:i + c].float()
            p = F.linear(h, weight, bias).float().sub_(lse[i:i + c, None]).exp_()  # softmax
            p.mul_(-g[:, None]).scatter_add_(-1, labels[i:i + c, None], g[:, None])  # g (onehot - softmax)
            gl = p.to(hidden.dtype)
            if need_h:
                gh[i:i + c] = gl @ weight
            if need_w:
                gw.addmm_(gl.t().float(), h.float())
            if need_b:
                gb += gl.float().sum(0)
        return gh, (gw.to(weight.dtype) if need_w else None), (gb.to(bias.dtype) if need_b else None), None, None


def chunked_token_log_probs(model, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                         chunk: Optional[int] = None) -> torch.Tensor:
    """``[B, T-1]`` log-probs of ``input_ids[:, 1:]``, like ``sequence_log_probs`` but through
    the decoder and a chunked head (``model`` is an HF causal LM, peft-wrapped or not)."""
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    hidden = decoder(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
    B, T, H = hidden.shape
    labels = input_ids[:, 1:].reshape(-1)
    chunk = chunk or default_chunk(head.weight.shape[0])
    lp = ChunkedTokenLogProbs.apply(hidden[:, :-1].reshape(-1, H), head.weight, head.bias, labels, chunk)
    return lp.view(B, T - 1)
