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
    """``apply(hidden [N, H], weight [V, H], bias, labels [N], chunk, scale=1.0, entropy=False)``:
    the log-prob of each label under ``softmax(scale * (hidden @ weight.T + bias))`` (``scale``:
    1 / the sampling temperature), and with ``entropy`` also each row's entropy
    ``H = lse - sum(p z)``, both float32 ``[N]``. Backward per chunk, from the saved ``lse``
    (and ``H``): dz = g_logp (onehot - p) - g_H p (z - E_p[z]), E_p[z] = lse - H."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk: int, scale: float = 1.0, entropy: bool = False):
        n = hidden.shape[0]
        out = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        ent = torch.empty(n if entropy else 0, dtype=torch.float32, device=hidden.device)
        for i in range(0, n, chunk):
            z = F.linear(hidden[i:i + chunk], weight, bias).float()
            if scale != 1.0:
                z.mul_(scale)
            lse[i:i + chunk] = torch.logsumexp(z, dim=-1)
            out[i:i + chunk] = z.gather(-1, labels[i:i + chunk, None]).squeeze(-1) - lse[i:i + chunk]
            if entropy:  # -sum p log p: every term <= 0, no cancellation (lse - E_p[z] loses ~|z| eps)
                logp = z - lse[i:i + chunk, None]
                ent[i:i + chunk] = -(logp.exp() * logp).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, labels, lse, ent)
        ctx.chunk, ctx.scale, ctx.entropy = chunk, scale, entropy
        return (out, ent) if entropy else out

    @staticmethod
    def backward(ctx, grad, grad_ent=None):
        hidden, weight, bias, labels, lse, ent = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        gh = torch.empty_like(hidden) if need_h else None
        gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        gb = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        c, scale = ctx.chunk, ctx.scale
        for i in range(0, hidden.shape[0], c):
            h = hidden[i:i + c]
            g = grad[i:i + c].float()
            z = F.linear(h, weight, bias).float()
            if scale != 1.0:
                z.mul_(scale)
            if ctx.entropy and grad_ent is not None:
                mean_z = (lse[i:i + c] - ent[i:i + c])[:, None]  # E_p[z]
                p = (z - lse[i:i + c, None]).exp_()
                dz = z.sub_(mean_z).mul_(p).mul_(-grad_ent[i:i + c].float()[:, None])  # -g_H p (z - E_p[z])
                dz.sub_(p.mul_(g[:, None]))
            else:
                dz = z.sub_(lse[i:i + c, None]).exp_().mul_(-g[:, None])  # -g p
            dz.scatter_add_(-1, labels[i:i + c, None], g[:, None])  # + g onehot
            if scale != 1.0:
                dz.mul_(scale)
            gl = dz.to(hidden.dtype)
            if need_h:
                gh[i:i + c] = gl @ weight
            if need_w:
                gw.addmm_(gl.t().float(), h.float())
            if need_b:
                gb += gl.float().sum(0)
        return (gh, (gw.to(weight.dtype) if need_w else None), (gb.to(bias.dtype) if need_b else None),
                None, None, None, None)


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
