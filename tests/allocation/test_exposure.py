"""Exposure (Eq. 7) against a direct loop."""

import torch

from hilore_actor.allocation.exposure import exposures, token_weights, unit_exposure


def test_weights_mean_one_on_mask_zero_elsewhere():
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    norms = torch.rand(2, 11, generator=gen) + 0.1
    mask = (torch.rand(2, 10, generator=gen) > 0.3).float()
    a = token_weights(norms, mask)
    assert torch.all(a[mask == 0] == 0)
    assert abs(float(a[mask == 1].mean()) - 1.0) < 1e-12


def test_exposure_matches_loop_and_ignores_masked_boundaries():
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    B, T = 1, 40
    norms = torch.rand(B, T + 1, generator=gen) + 0.5
    omega = torch.randn(B, T, generator=gen, dtype=torch.float64)
    mask = torch.ones(B, T)
    mask[0, :5] = 0  # prompt of sequence 1
    mask[0, 19] = 0  # last position of sequence 1 predicts sequence 2's first token
    mask[0, 20:24] = 0  # prompt of sequence 2
    valid = [(0, t) for t in range(T) if mask[0, t] == 1]
    mean = sum(float(norms[b, t]) for b, t in valid) / len(valid)
    expected = sum(float(norms[b, t]) / mean * abs(float(omega[b, t])) for b, t in valid)
    assert abs(unit_exposure(omega, norms, mask) - expected) < 1e-9 * expected
    omega2 = omega.clone()
    omega2[0, 19] = 1e6  # a masked position cannot move the exposure
    assert abs(unit_exposure(omega2, norms, mask) - expected) < 1e-9 * expected


def test_zero_coefficients_give_zero_exposure():
    norms = torch.rand(1, 9) + 1
    mask = torch.ones(1, 8)
    assert unit_exposure(torch.zeros(1, 8), norms, mask) == 0.0
    assert exposures(torch.zeros(1, 8), {"u": norms}, mask) == {"u": 0.0}
    assert unit_exposure(torch.ones(1, 8), norms, torch.zeros(1, 8)) == 0.0
