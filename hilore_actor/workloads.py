"""Replayed GRPO microbatches: realistic learner inputs without a rollout engine.

Groups of ``group_size`` responses share a prompt; about ``prompt_frac`` of the tokens are
prompt (masked); response lengths vary; rewards are Bernoulli per group with some groups all
equal (zero advantage for every token); old log-probs are the current ones perturbed so a
realistic share of tokens is clipped; the reference is perturbed less. Sequences are packed
into rows of exactly ``tokens`` tokens. Everything is seeded.
"""

from __future__ import annotations

from typing import List

import torch

from .grpo.advantages import group_advantages
from .grpo.microbatch import Microbatch
from .models.logprobs import sequence_log_probs

DEFAULT_LOSS = dict(clip_eps_low=0.2, clip_eps_high=0.2, kl_coef=0.001, kl_estimator="k3", loss_agg_mode="token-mean")


def _pack_row(gen, tokens: int, vocab: int, group_size: int, prompt_frac: float, mean_len: int, zero_var_prob: float):
    ids, pos, mask, adv = [], [], [], []
    used = 0
    while used < tokens:
        prompt_len = max(2, int(mean_len * prompt_frac))
        prompt = torch.randint(3, vocab, (prompt_len,), generator=gen)
        rewards = (torch.rand(group_size, generator=gen) < 0.5).float()
        if torch.rand((), generator=gen) < zero_var_prob:
            rewards.fill_(float(rewards[0]))  # a group the policy gradient ignores
        a = group_advantages(rewards, group_size)
        for j in range(group_size):
            if used >= tokens:
                break
            resp_len = max(2, int(mean_len * (1 - prompt_frac) * float(0.4 + 1.2 * torch.rand((), generator=gen))))
            seq = torch.cat([prompt, torch.randint(3, vocab, (resp_len,), generator=gen)])[: tokens - used]
            n = len(seq)
            ids.append(seq)
            pos.append(torch.arange(n))
            # per next-token position: predict seq[t+1]; response positions are prompt_len-1 .. n-2;
            # the last position of a sequence would predict the next sequence: never trained
            m = torch.zeros(n)
            m[prompt_len - 1 : n - 1] = 1.0
            mask.append(m)
            adv.append(torch.full((n,), float(a[j])))
            used += n
    cat = lambda xs: torch.cat(xs)[None]
    return cat(ids), cat(pos), cat(mask)[:, :-1], cat(adv)[:, :-1]


@torch.no_grad()
def replayed_microbatches(
    model,
    n: int,
    tokens: int,
    *,
    group_size: int = 8,
    prompt_frac: float = 0.2,
    mean_len: int = 128,
    zero_var_prob: float = 0.3,
    clip_noise: float = 0.15,
    ref_noise: float = 0.05,
    seed: int = 0,
    loss_options=None,
) -> List[Microbatch]:
    """``n`` packed microbatches of ``tokens`` tokens each for ``model`` (see module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out = []
    for _ in range(n):
        ids, pos, mask, adv = _pack_row(gen, tokens, vocab, group_size, prompt_frac, mean_len, zero_var_prob)
        ids, pos = ids.to(device), pos.to(device)
        cur = sequence_log_probs(model, ids, position_ids=pos).float().cpu()
        old = cur + clip_noise * torch.randn(cur.shape, generator=gen)
        ref = cur + ref_noise * torch.randn(cur.shape, generator=gen)
        out.append(
            Microbatch(
                ids,
                pos,
                old.to(device),
                ref.to(device),
                adv.to(device),
                mask.to(device),
                loss_options=dict(loss_options or DEFAULT_LOSS),
            )
        )
    model.train(was_training)
    return out
