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


def _old_weights(norms, mask):
    """``token_weights`` as it was: the all-masked and all-zero cases branched on the host."""
    norms = norms[..., : mask.shape[-1]].to(mask.device, torch.float64)
    m = mask.to(torch.float64)
    total, count = (norms * m).sum(), m.sum()
    if count == 0 or total == 0:
        return torch.zeros_like(m)
    return norms * m * (count / total)


def _scores(seed, units=6):
    gen = torch.Generator().manual_seed(seed)
    B, T = 2, 33
    omega = torch.randn(B, T, generator=gen)
    mask = (torch.rand(B, T, generator=gen) > 0.3).float()
    norms = {f"u{i}": torch.rand(B, T + 1, generator=gen) * 3 for i in range(units)}
    norms["u0"] = torch.zeros(B, T + 1)  # every valid norm 0: exposure 0
    kept = {n: torch.rand(B, T + 1, generator=gen) > 0.5 for n in list(norms)[1:4]}
    return omega, norms, mask, kept


def test_one_transfer_gives_the_per_unit_scores_bitwise(fresh_seed):
    """All units' exposures (and token L's rest exposures) read in one transfer are, bit for bit,
    the per-unit computation with its host-side branch (the old path), also with nothing valid."""
    from hilore_actor.allocation.exposure import exposures_and_rest, rest_exposures

    print("seed", fresh_seed)
    omega, norms, mask, kept = _scores(fresh_seed)
    for m in (mask, torch.zeros_like(mask)):
        E, rest = exposures_and_rest(omega, norms, m, kept)
        w = omega.to(torch.float64).abs()
        assert E == {n: float((_old_weights(v, m) * w).sum()) for n, v in norms.items()}
        old_rest = {
            n: float((_old_weights(norms[n], m) * w * ~k.reshape(norms[n].shape)[..., : m.shape[-1]]).sum())
            for n, k in kept.items()
        }
        assert rest == old_rest and rest_exposures(omega, norms, m, kept) == old_rest
        assert exposures(omega, norms, m) == E and E["u0"] == 0.0
        assert all(unit_exposure(omega, v, m) == E[n] for n, v in norms.items())


class _HostReads:
    """Counts device-to-host reads: the Tensor methods that wait for the device, and
    ``torch.cuda.synchronize`` (a stand-in: no CUDA here)."""

    METHODS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")

    def __init__(self, monkeypatch):
        self.calls = []
        for name in self.METHODS:
            real = getattr(torch.Tensor, name)

            def counted(t, *a, _real=real, _name=name, **k):
                self.calls.append(_name)
                return _real(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, counted)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: self.calls.append("synchronize"))


def test_the_online_choice_reads_the_device_once_per_microbatch(fresh_seed, monkeypatch):
    """The planner's online chooser (omega -> exposure of every unit -> risks -> knapsack) with
    token L on: one host read per microbatch, whatever the number of units (it was two host
    branches and a ``float`` per unit, and one more per token-L unit)."""
    from types import SimpleNamespace

    from hilore_actor.allocation import Calibration, Planner, Runner, ShapePlan, UnitCosts
    from hilore_actor.models import LoraSpec, build_model, tiny_config

    print("seed", fresh_seed)
    model = build_model(tiny_config("llama", hidden_size=64, num_layers=2, vocab_size=128), lora=LoraSpec(4, 8))
    runner = Runner(model)
    names = runner.engine.unit_names
    omega, _, mask, _ = _scores(fresh_seed)
    gen = torch.Generator().manual_seed(fresh_seed + 1)
    norms = {n: torch.rand(2, 34, generator=gen) + 0.5 for n in names}
    kept = {n: torch.rand(2, 34, generator=gen) > 0.7 for n in names}
    cal = Calibration(
        "int8-g64", {"g": 1e-3}, dict.fromkeys(names, 0.05), dict.fromkeys(names, 1.0), dict.fromkeys(names, "g")
    )
    planner = Planner(runner, 10**9, cal, Planner.Config(token_rows=(0.25,), loo=False), log=lambda *_: None)
    assert planner.token_wise and planner.shares
    costs = UnitCosts(
        "s",
        1.0,
        0,
        dtau={n: {"H": 0.01, "L": 0.008} for n in names},
        dm={n: {"H": 4000, "L": 1200} for n in names},
        tokens=66,
        options=["H", "L"],
    )
    sp = ShapePlan("s", costs, dict.fromkeys(names, "compressed"), 4000 * len(names) / 2, 0.01, 0.01)
    choose = planner.chooser_for(sp)
    step = SimpleNamespace(token_norms=lambda: norms, kept_rows=lambda: kept)
    reads = _HostReads(monkeypatch)
    for i in range(3):
        before = len(reads.calls)
        actions = choose(step, SimpleNamespace(omega=omega * (i + 1), mask=mask))
        assert set(actions) == set(names)
        print(i, reads.calls[before:], actions)
        assert reads.calls[before:] == ["tolist"]
