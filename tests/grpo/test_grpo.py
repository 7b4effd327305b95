"""omega (analytic) against autograd's dL/d log_probs, and advantages against a reference."""

import itertools
import math

import pytest
import torch

from hilore_actor.grpo import group_advantages, policy_loss, token_coefficients

B, T = 6, 9
EPS = 0.2
DUAL = 2.5  # exp is 1-ulp accurate, not correctly rounded: _hit_exactly walks s to each target


def _hit_exactly(s, old, idx, target):
    """Walk ``s[idx]`` ulp by ulp until this platform's elementwise exp of ``s - old`` (same
    shape, same kernel as the loss) gives exactly ``target``; ``exp(log(x)) == x`` holds on
    some CPUs only. Near 1 +- EPS and DUAL one ulp of ``s`` moves exp by under one ulp."""
    start = s[idx].item()
    for _ in range(400):
        r = (s - old).exp()[idx].item()
        if r == target:
            return
        toward = -math.inf if r > target else math.inf
        s[idx] = math.nextafter(s[idx].item(), toward)
    raise AssertionError(f"no s near {start} gives exp == {target!r} on this platform")


def make_inputs(gen, kind):
    """Fresh random float64 inputs that hit the edge cases the issue lists."""
    s = torch.randn(B, T, generator=gen, dtype=torch.float64) - 2.0
    old = s + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    ref = s + 0.5 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    adv = torch.randn(B, generator=gen, dtype=torch.float64)
    adv[1] = 0.0  # zero advantage
    mask = (torch.rand(B, T, generator=gen) > 0.2).double()
    mask[2] = 0.0  # fully masked row
    if kind == "boundary":
        # ratio exactly 1+eps / 1-eps (old = 0 makes s - old exact), for A > 0 and A < 0
        for row, a in ((0, 1.0), (3, -1.0)):
            adv[row] = a
            old[row, :4] = 0.0
            for col, target in enumerate((1 + EPS, 1 - EPS, 1 + EPS, 1 - EPS)):
                s[row, col] = math.log(target)
                _hit_exactly(s, old, (row, col), target)
        s[3, 4], old[3, 4] = math.log(DUAL), 0.0  # ratio == DUAL: clip1 ties with dual_clip * A
        _hit_exactly(s, old, (3, 4), DUAL)
        ratio = (s - old).exp()
        assert (ratio == 1 + EPS).sum() >= 4 and (ratio == 1 - EPS).sum() >= 4 and ratio[3, 4] == DUAL
    elif kind == "far":
        old[0] = s[0] - 30.0  # log-ratio beyond the +-20 clamp
        old[3] = s[3] + 3.0
        old[4] = s[4] - 3.0
        ref[5] = s[5] + 15.0  # k3 log-ratio clamp and KL value clamp bind
    return s, old, ref, adv, mask


CASES = [
    c
    for c in itertools.product(
        ["random", "boundary", "far"],
        [(0.2, None), (0.2, 0.28)],
        [None, DUAL],
        [0.0, 0.05],
        ["k1", "k2", "k3"],
        ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"],
    )
    if c[3] != 0.0 or c[4] == "k3"  # without KL the estimator is unused: one estimator suffices
]


@pytest.mark.parametrize("kind,clip,dual,beta,est,agg", CASES)
def test_omega_matches_autograd(kind, clip, dual, beta, est, agg, fresh_seed):
    print(f"seed {fresh_seed}")
    gen = torch.Generator().manual_seed(fresh_seed)
    s, old, ref, adv, mask = make_inputs(gen, kind)
    opts = dict(
        clip_eps_low=clip[0], clip_eps_high=clip[1], dual_clip=dual, kl_coef=beta, kl_estimator=est, loss_agg_mode=agg
    )
    s_leaf = s.clone().requires_grad_(True)
    loss, stats = policy_loss(s_leaf, old, adv, mask, ref, **opts)
    (grad,) = torch.autograd.grad(loss, s_leaf)
    omega = token_coefficients(s, old, adv, mask, ref, **opts)
    assert omega.dtype == torch.float64 and not omega.requires_grad
    rel = (omega - grad).norm() / grad.norm().clamp(min=1e-300)
    assert rel < 1e-6, f"relative error {rel}"
    assert torch.all((omega == 0) == (grad == 0)), "omega must be zero exactly where autograd's is"
    assert torch.all(omega[mask == 0] == 0)
    assert torch.all(omega[2] == 0)  # fully masked row
    if beta == 0.0:
        assert torch.all(omega[1] == 0)  # zero advantage, no KL: no update
    assert 0.0 <= stats["clip_fraction"] <= 1.0


def test_global_denominators_split_microbatches_exactly():
    """num_tokens / num_sequences make per-microbatch losses sum to the full-batch loss."""
    gen = torch.Generator().manual_seed(7)
    s, old, ref, adv, mask = make_inputs(gen, "random")
    for agg in ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]:
        full, _ = policy_loss(s, old, adv, mask, ref, kl_coef=0.01, loss_agg_mode=agg)
        n_tok = mask.sum().item()
        n_seq = (mask.sum(-1) > 0).sum().item()
        parts = [
            policy_loss(
                s[i : i + 3],
                old[i : i + 3],
                adv[i : i + 3],
                mask[i : i + 3],
                ref[i : i + 3],
                kl_coef=0.01,
                loss_agg_mode=agg,
                num_tokens=n_tok,
                num_sequences=n_seq,
            )[0]
            for i in (0, 3)
        ]
        torch.testing.assert_close(sum(parts), full, rtol=1e-12, atol=1e-12)


def test_matches_openrlhf_formula_token_mean():
    """Reference written out as in OpenRLHF 0.11.2: -min(surr1, surr2) masked mean + beta * k3."""
    gen = torch.Generator().manual_seed(3)
    s, old, ref, adv, mask = make_inputs(gen, "random")
    a = adv[:, None].expand(B, T)
    ratio = (s - old).clamp(-20, 20).exp()
    pg = -torch.min(ratio * a, ratio.clamp(0.8, 1.2) * a)
    x = (s - ref).clamp(min=-10)
    kl = ((-x).exp() - 1 + x).clamp(-10, 10)
    expected = (pg * mask).sum() / mask.sum() + 0.1 * (kl * mask).sum() / mask.sum()
    loss, stats = policy_loss(s, old, adv, mask, ref, kl_coef=0.1)
    torch.testing.assert_close(loss, expected)
    clip_frac = ((ratio.clamp(0.8, 1.2) * a < ratio * a).double() * mask).sum() / mask.sum()
    torch.testing.assert_close(stats["clip_fraction"], clip_frac)


def test_fully_masked_batch_gives_zero_not_nan():
    s = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    loss, stats = policy_loss(s, s.detach(), torch.ones(2), torch.zeros(2, 3))
    assert loss.item() == 0.0 and not math.isnan(stats["clip_fraction"].item())


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(kl_coef=0.1), "ref_log_probs"),
        (dict(kl_estimator="k4"), "kl_estimator"),
        (dict(loss_agg_mode="mean"), "loss_agg_mode"),
        (dict(dual_clip=0.5), "dual_clip"),
        (dict(clip_eps_low=1.5), "clip range"),
    ],
)
def test_bad_options_raise_clear_errors(kwargs, match):
    s = torch.randn(2, 3)
    with pytest.raises(ValueError, match=match):
        policy_loss(s, s, torch.ones(2), **kwargs)
    with pytest.raises(ValueError, match=match):
        token_coefficients(s, s, torch.ones(2), **kwargs)


def test_shape_mismatch_is_named():
    s = torch.randn(2, 3)
    with pytest.raises(ValueError, match="old_log_probs"):
        policy_loss(s, torch.randn(2, 4), torch.ones(2))
    with pytest.raises(ValueError, match="action_mask"):
        token_coefficients(s, s, torch.ones(2), torch.ones(3, 3))


def test_group_norm_advantages_against_reference():
    gen = torch.Generator().manual_seed(11)
    r = torch.randint(0, 2, (24,), generator=gen).float()
    r[:8] = 1.0  # a zero-variance group
    adv = group_advantages(r, 8)
    g = r.view(3, 8)
    ref = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-9)).view(-1)
    torch.testing.assert_close(adv, ref)
    assert torch.all(adv[:8] == 0)
    torch.testing.assert_close(group_advantages(r, 8, "dr_grpo"), (g - g.mean(1, keepdim=True)).view(-1))
    loo = (g.sum(1, keepdim=True) - g) / 7
    torch.testing.assert_close(group_advantages(r, 8, "rloo"), (g - loo).view(-1))


@pytest.mark.parametrize("estimator", ["group_norm", "dr_grpo", "rloo"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_group_of_equal_rewards_gets_exactly_zero(estimator, dtype, fresh_seed):
    """Every group size and reward value: the formula alone leaves a rounding residue (the
    reference below, which group_norm divides by a residue-sized std); equal groups get 0."""
    print("seed", fresh_seed)
    gen = torch.Generator().manual_seed(fresh_seed)
    noisy = 0
    for g in (2, 3, 4, 6, 7, 8, 16):
        values = torch.rand(6, generator=gen, dtype=torch.float64).tolist() + [0.1, 1 / 3]
        r = torch.tensor([v for v in values for _ in range(g)] + [0.0] * (g - 1) + [1.0], dtype=dtype)
        adv = group_advantages(r, g, estimator)
        assert torch.all(adv[: len(values) * g] == 0), (g, adv)
        assert torch.all(adv[len(values) * g :] != 0)  # the one group with a spread keeps its signal
        grouped = r.view(-1, g)[:-1]
        mean = grouped.mean(1, keepdim=True)
        raw = (grouped - mean) / (grouped.std(1, keepdim=True) + 1e-9) if estimator == "group_norm" else grouped - mean
        noisy += int((raw != 0).any())
    print("groups the bare formula leaves nonzero:", noisy)


def test_partial_group_is_a_clear_error():
    with pytest.raises(ValueError, match="whole number of groups of 8"):
        group_advantages(torch.zeros(12), 8)
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        group_advantages(torch.zeros(8), 8, "gae")


def test_microbatch_prefix_is_the_first_tokens_of_every_row():
    from hilore_actor.grpo.microbatch import Microbatch

    seed = torch.seed() % 2**31
    print("seed", seed)
    g = torch.Generator().manual_seed(seed)
    B, T, t = 2, 40, 17
    per_token = [torch.randn(B, T - 1, generator=g) for _ in range(4)]
    mb = Microbatch(
        torch.randint(0, 50, (B, T), generator=g),
        torch.arange(T).repeat(B, 1),
        *per_token,
        loss_options={"kl_coef": 0.1},
    )
    p = mb.prefix(t)
    assert p.num_tokens == B * t and p.loss_options == mb.loss_options
    assert torch.equal(p.input_ids, mb.input_ids[:, :t]) and torch.equal(p.position_ids, mb.position_ids[:, :t])
    for name, full in zip(("old_log_probs", "ref_log_probs", "advantages", "action_mask"), per_token):
        assert torch.equal(getattr(p, name), full[:, : t - 1])
    with pytest.raises(ValueError, match="prefix of 41 tokens"):
        mb.prefix(T + 1)


def test_one_preparation_serves_loss_and_coefficients():
    """``microbatch_loss`` validates its inputs once; loss, stats and omega equal the separate
    ``policy_loss`` and ``token_coefficients`` calls bitwise."""
    from hilore_actor.grpo.coefficients import coefficients_from
    from hilore_actor.grpo.inputs import prepare
    from hilore_actor.grpo.loss import loss_from

    seed = torch.seed() % 2**31
    print("seed", seed)
    g = torch.Generator().manual_seed(seed)
    B, T = 3, 17
    logp = (-torch.rand(B, T, generator=g) * 3).requires_grad_()
    old, ref = (
        logp.detach() + 0.2 * torch.randn(B, T, generator=g),
        logp.detach() + 0.1 * torch.randn(B, T, generator=g),
    )
    adv, mask = torch.randn(B, generator=g), (torch.rand(B, T, generator=g) > 0.3).float()
    opts = dict(
        clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.05, kl_estimator="k3", loss_agg_mode="seq-mean-token-mean"
    )
    inp = prepare(logp, old, adv, mask, ref, **opts)
    loss, stats = loss_from(inp)
    ref_loss, ref_stats = policy_loss(logp, old, adv, mask, ref, **opts)
    assert torch.equal(loss, ref_loss) and all(torch.equal(stats[k], ref_stats[k]) for k in ref_stats)
    assert torch.equal(coefficients_from(inp), token_coefficients(logp, old, adv, mask, ref, **opts))
    assert loss.requires_grad and not coefficients_from(inp).requires_grad
    from hilore_actor.grpo import LossConfig  # one options object, or its fields as keywords: the same

    cfg = LossConfig(**opts)
    assert torch.equal(policy_loss(logp, old, adv, mask, ref, cfg)[0], ref_loss)
    assert torch.equal(token_coefficients(logp, old, adv, mask, ref, cfg, kl_coef=0.05), coefficients_from(inp))
