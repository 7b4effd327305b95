"""Per-token log-probabilities of given tokens, the ``s_t`` of Eq. 1."""

from __future__ import annotations

from typing import Optional

import torch


def token_log_probs(logits: torch.Tensor, labels: torch.Tensor, chunk_rows: int = 1024) -> torch.Tensor:
    """``log softmax(logits)[labels]`` per position, in float32, computed ``chunk_rows`` rows at
    a time so the full float32 ``[N, vocab]`` log-softmax is never materialised at once (it
    would dominate the peak; OpenRLHF casts the whole logits tensor to fp32)."""
    flat = logits.reshape(-1, logits.shape[-1])
    lab = labels.reshape(-1)
    out = []
    for i in range(0, flat.shape[0], chunk_rows):
        rows = flat[i : i + chunk_rows].float()
        picked = rows.gather(-1, lab[i : i + chunk_rows, None]).squeeze(-1)
        out.append(picked - torch.logsumexp(rows, dim=-1))
    return torch.cat(out).view(labels.shape)


@torch.no_grad()
def token_entropy(logits: torch.Tensor, chunk_rows: int = 256) -> torch.Tensor:
    """Per-position entropy of ``softmax(logits)`` in float32, without a graph (a logged
    statistic), ``chunk_rows`` rows at a time so no full-vocabulary float32 copy is made."""
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    for i in range(0, flat.shape[0], chunk_rows):
        logp = torch.log_softmax(flat[i : i + chunk_rows].float(), dim=-1)
        out[i : i + chunk_rows] = -(logp.exp() * logp).sum(-1)
    return out.view(logits.shape[:-1])


def sequence_log_probs(
    model, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None, attention_mask=None
) -> torch.Tensor:
    """``[B, L-1]`` log-probs of ``input_ids[:, 1:]`` given their prefixes (packed rows: pass
    ``position_ids`` that restart at 0 for each sequence)."""
    out = model(
        input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=False, return_dict=True
    )
    return output_log_probs(out, input_ids)


def output_log_probs(out, input_ids: torch.Tensor) -> torch.Tensor:
    """``[B, L-1]`` log-probs of ``input_ids[:, 1:]`` from a model's output: from its logits, or,
    where a fused head returns log-probs and no logits (verl's ``use_fused_kernels``:
    ``CausalLMOutputForPPO.log_probs``, element t the log-prob of token t + 1, the last one of a
    wrapped-around label), from those."""
    if getattr(out, "logits", None) is None and getattr(out, "log_probs", None) is not None:
        return out.log_probs[:, :-1].float()
    return token_log_probs(out.logits[:, :-1], input_ids[:, 1:])
