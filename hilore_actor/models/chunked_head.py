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
        # the head's own row count, not model.config: a DeepSpeed engine's config is DeepSpeed's
        ids = (torch.arange(8, device=key.weight.device) % key.weight.shape[0])[None]
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
        print(
            f"[hilore] {type(model).__name__}'s logits are not its head applied to the decoder's last hidden "
            "state (logit scaling, soft-capping or a prediction head): using its own logits, not the chunked head",
            file=sys.stderr,
        )
    _LINEAR_HEAD[key] = ok
    return ok


def record_linear_head(model, linear: bool) -> None:
    """``head_is_linear``'s verdict for ``model`` given instead of checked: for a model on the
    meta device, which has no values to compare, from a twin of its class checked on real numbers
    (``hilore_actor.estimate``)."""
    _LINEAR_HEAD[model.get_output_embeddings()] = bool(linear)


def default_chunk(vocab: int, target_bytes: int = 32 * 2**20) -> int:
    """The CPU rule: ``target_bytes`` of float32 logits per chunk (55 rows at V = 151936)."""
    return max(16, target_bytes // (4 * vocab))


# CUDA: every chunk streams the whole [V, H] head from HBM. On an H100 (~3.35 TB/s, ~990 dense bf16
# TFLOP/s) the matmul turns compute-bound at ~990/3.35 * 2 bytes / 2 = ~296 rows; 1024 rows (~3.5x
# that) keeps the head read to a fraction of the chunk's FLOPs whatever the achieved bandwidth.
# A smaller vocabulary gets more rows, up to 256 MiB of float32 logits (2048 rows at V = 32768).
CUDA_MIN_ROWS = 1024
CUDA_LOGITS_BYTES = 256 * 2**20
ROOM_SHARE = 8  # with a known room, the head's temporaries take at most 1/8 of it


def chunk_row_bytes(vocab: int, hidden: int, dtype: torch.dtype) -> int:
    """Bound on the live bytes one chunk row adds in ``ChunkedTokenLogProbs``: float32 logits,
    their softmax and (a trained head) the float32 gradient, the matmul's output and the
    gradient in ``dtype``, and float32 hidden-size rows."""
    return vocab * (12 + 2 * torch.empty(0, dtype=dtype).element_size()) + 8 * hidden


def head_chunk_rows(
    device_type: str, vocab: int, hidden: int, dtype: torch.dtype, room_bytes: Optional[int] = None
) -> int:
    """Head rows per chunk, the one rule for the job, the benchmark and the OpenRLHF drop-in.
    CPU (and any non-CUDA device): ``default_chunk``, as the committed CPU results ran.
    CUDA: ``CUDA_MIN_ROWS``, or more where ``CUDA_LOGITS_BYTES`` of float32 logits hold more
    (a multiple of 128), so the head is read a few times per microbatch rather than ~75 times;
    ``room_bytes`` (B's room, where the caller knows it) caps the chunk's temporaries at
    1/``ROOM_SHARE`` of it, down to the CPU floor of 16 rows."""
    if device_type != "cuda":
        return default_chunk(vocab)
    rows = max(CUDA_MIN_ROWS, CUDA_LOGITS_BYTES // (4 * vocab) // 128 * 128)
    if room_bytes is not None:
        rows = min(rows, max(16, room_bytes // ROOM_SHARE // chunk_row_bytes(vocab, hidden, dtype)))
    return rows


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
            z = F.linear(hidden[i : i + chunk], weight, bias).float()
            if scale != 1.0:
                z.mul_(scale)
            lse[i : i + chunk] = torch.logsumexp(z, dim=-1)
            out[i : i + chunk] = z.gather(-1, labels[i : i + chunk, None]).squeeze(-1) - lse[i : i + chunk]
            if entropy:  # -sum p log p: every term <= 0, no cancellation (lse - E_p[z] loses ~|z| eps)
                logp = z.sub_(lse[i : i + chunk, None])  # in place, as p: two chunk-sized floats, not four
                ent[i : i + chunk] = -logp.exp().mul_(logp).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, labels, lse, ent)
        ctx.chunk, ctx.scale, ctx.entropy = chunk, scale, entropy
        # an output the loss does not use gets no gradient (None, not zeros): entropy computed for
        # logging only then costs nothing in backward
        ctx.set_materialize_grads(False)
        return (out, ent) if entropy else out

    @staticmethod
    def backward(ctx, grad, grad_ent=None):
        hidden, weight, bias, labels, lse, ent = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        gh = torch.empty_like(hidden) if need_h else None
        acc = torch.promote_types(weight.dtype, torch.float32)  # float32 sums (float64 for a float64 head)
        gw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        gb = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        c, scale = ctx.chunk, ctx.scale
        if grad is None:  # only the entropy reaches the loss
            grad = torch.zeros_like(lse)
        for i in range(0, hidden.shape[0], c):
            h = hidden[i : i + c]
            g = grad[i : i + c].float()
            z = F.linear(h, weight, bias).float()
            if scale != 1.0:
                z.mul_(scale)
            p = None
            if ctx.entropy and grad_ent is not None:
                mean_z = (lse[i : i + c] - ent[i : i + c])[:, None]  # E_p[z]
                p = (z - lse[i : i + c, None]).exp_()
                dz = z.sub_(mean_z).mul_(p).mul_(-grad_ent[i : i + c].float()[:, None])  # -g_H p (z - E_p[z])
                dz.sub_(p.mul_(g[:, None]))
            else:
                dz = z.sub_(lse[i : i + c, None]).exp_().mul_(-g[:, None])  # -g p
            dz.scatter_add_(-1, labels[i : i + c, None], g[:, None])  # + g onehot
            if scale != 1.0:
                dz.mul_(scale)
            gl = dz.to(hidden.dtype)
            if need_b:
                gb += dz.sum(0)  # float32 already: no [chunk, V] copy (the same sum as before for float32)
            z = dz = p = None  # the float32 logits' room goes to the weight gradient's tile
            if need_h:
                gh[i : i + c] = gl @ weight
            if need_w:
                _add_weight_grad(gw, gl, h)
        return (
            gh,
            (gw.to(weight.dtype) if need_w else None),
            (gb.to(bias.dtype) if need_b else None),
            None,
            None,
            None,
            None,
        )


def _add_weight_grad(acc: torch.Tensor, gl: torch.Tensor, h: torch.Tensor) -> None:
    """``acc += gl.T @ h``: a chunk's head-weight gradient ``[V, H]`` from its logit gradient
    ``gl [rows, V]`` and hidden rows ``h [rows, H]`` (the head's dtype) into the float32
    accumulator (float64 for a float64 head), called after the chunk's float32 logits are freed.
    A head in ``acc``'s dtype: one ``addmm_``, as before (float32 bitwise unchanged). bfloat16:
    the GEMM in bfloat16 (tensor cores; float32 sums inside it, each product element rounded once
    to bfloat16), ``tile`` head rows at a time so a tile's product takes at most the freed
    logits' bytes, each added into ``acc`` in float32: no float32 copy of ``gl``. float16 (a
    chunk's product could pass its 65504): in float32, the copy of ``gl`` in the freed room."""
    if gl.dtype == acc.dtype:
        acc.addmm_(gl.t(), h)
    elif gl.dtype != torch.bfloat16:
        acc.addmm_(gl.t().float(), h.float())
    else:
        rows, vocab = gl.shape
        tile = max(1, min(vocab, rows * vocab * 4 // (h.shape[1] * gl.element_size())))
        for j in range(0, vocab, tile):
            acc[j : j + tile].add_(gl[:, j : j + tile].t() @ h)


def chunked_token_log_probs(
    model,
    input_ids: torch.Tensor,
    position_ids: Optional[torch.Tensor] = None,
    chunk: Optional[int] = None,
    entropy: bool = False,
):
    """``[B, T-1]`` log-probs of ``input_ids[:, 1:]``, like ``sequence_log_probs`` but through
    the decoder and a chunked head (``model`` is an HF causal LM, peft-wrapped or not); through
    the model's own logits where ``head_is_linear`` fails. ``entropy``: also each position's
    entropy, detached (for logging: it adds no backward work), as ``(log_probs, entropy)``."""
    if not head_is_linear(model):
        from .logprobs import token_entropy, token_log_probs

        logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
        lp = token_log_probs(logits[:, :-1], input_ids[:, 1:])
        return (lp, token_entropy(logits[:, :-1])) if entropy else lp
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    hidden = decoder(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
    B, T, H = hidden.shape
    labels = input_ids[:, 1:].reshape(-1)
    chunk = chunk or head_chunk_rows(hidden.device.type, head.weight.shape[0], H, head.weight.dtype)
    out = ChunkedTokenLogProbs.apply(hidden[:, :-1].reshape(-1, H), head.weight, head.bias, labels, chunk, 1.0, entropy)
    if entropy:
        return out[0].view(B, T - 1), out[1].detach().view(B, T - 1)
    return out.view(B, T - 1)
