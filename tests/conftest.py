"""Shared helpers: fresh random packed microbatches and a GRPO loss over them."""
import pytest
import torch

from hilore_actor.grpo import policy_loss
from hilore_actor.models.logprobs import token_log_probs


def packed_microbatch(total: int, vocab: int, n_seqs: int = 3, seed=None):
    """One packed row of ``n_seqs`` sequences of random lengths: (input_ids, position_ids)."""
    gen = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    cuts = sorted(torch.randperm(total - 2, generator=gen)[: n_seqs - 1].add(1).tolist())
    lens = [b - a for a, b in zip([0] + cuts, cuts + [total])]
    ids = torch.randint(3, vocab, (1, total), generator=gen)
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    return ids, pos


def grpo_loss(model, ids, pos, seed=0):
    """Forward + the GRPO loss with random advantages, old/ref log-probs and a prompt mask."""
    gen = torch.Generator().manual_seed(seed)
    out = model(input_ids=ids, position_ids=pos, use_cache=False)
    logp = token_log_probs(out.logits[:, :-1], ids[:, 1:])
    old = logp.detach() + 0.1 * torch.randn(logp.shape, generator=gen)
    ref = logp.detach() + 0.1 * torch.randn(logp.shape, generator=gen)
    mask = (torch.rand(logp.shape, generator=gen) > 0.2).float()
    adv = torch.randn(logp.shape, generator=gen)
    loss, _ = policy_loss(logp, old, adv, mask, ref, kl_coef=0.01)
    return loss


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def rel_err(g, ref):
    num = torch.cat([(g[n] - ref[n]).flatten() for n in ref]).norm()
    return float(num / torch.cat([ref[n].flatten() for n in ref]).norm())


@pytest.fixture
def fresh_seed():
    return torch.seed() % 2**31
