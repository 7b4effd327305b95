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

It applies only where the logits are that linear map of the decoder's last hidden state.
Architectures that scale, soft-cap or transform the logits (Gemma 2's ``final_logit_softcapping``,
Cohere's ``logit_scale``, Granite's ``logits_scaling``, BERT-style prediction heads) are not, so
``head_is_linear`` checks it once per model on a few tokens, and the callers fall back to the
model's own logits where it fails.
"""
from __future__ import annotations

import sys
import weakref
from typing import Optional

import torch
import torch.nn.functional as F

_LINEAR_HEAD: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()


def head_is_linear(model) -> bool:
    """Whether ``model``'s logits are ``get_output_embeddings()`` applied to ``get_decoder()``'s
    last hidden state, checked on 8 tokens in eval mode without grad (so no dropout, no RNG),
    once per model. A model without those accessors, or one whose check raises, is not."""
    try:
        key = model.get_output_embeddings()
        if key in _LINEAR_HEAD:
            return _LINEAR_HEAD[key]
        was = model.training
        ids = (torch.arange(8, device=key.weight.device) % model.config.vocab_size)[None]
        try:
            model.eval()
            with torch.no_grad():
                logits = model(input_ids=ids, use_cache=False).logits.float()
                z = key(model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state).float()
        finally:
            model.train(was)
        ok = z.shape == logits.shape and bool((z - logits).abs().max() <= 1e-5 * z.abs().max().clamp_min(1e-30))
    except Exception:  # noqa: BLE001  no decoder/head split to use: the model's own logits
        return False
    if not ok:
        print(f"[hilore] {type(model).__name__}'s logits are not its head applied to the decoder's last hidden "
              "state (logit scaling, soft-capping or a prediction head): using its own logits, not the chunked head",
              file=sys.stderr)
    _LINEAR_HEAD[key] = ok
    return ok


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
    the decoder and a chunked head (``model`` is an HF causal LM, peft-wrapped or not); through
    the model's own logits where ``head_is_linear`` fails."""
    if not head_is_linear(model):
        from .logprobs import token_log_probs

        logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
        return token_log_probs(logits[:, :-1], input_ids[:, 1:])
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    hidden = decoder(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
    B, T, H = hidden.shape
    labels = input_ids[:, 1:].reshape(-1)
    chunk = chunk or default_chunk(head.weight.shape[0])
    lp = ChunkedTokenLogProbs.apply(hidden[:, :-1].reshape(-1, H), head.weight, head.bias, labels, chunk)
    return lp.view(B, T - 1)
