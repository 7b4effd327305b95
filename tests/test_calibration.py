"""Susceptibility fit, persistence, and a calibration run on a tiny model."""
import json

import pytest
import torch

from hilore_actor.allocation import Calibration, Runner, calibrate, fit_kappa
from hilore_actor.models import LoraSpec, build_model, tiny_config
from hilore_actor.workloads import replayed_microbatches


def test_kappa_is_least_squares_through_origin():
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    x = torch.rand(30, generator=gen, dtype=torch.float64)
    y = 2.5 * x + 0.01 * torch.randn(30, generator=gen, dtype=torch.float64)
    samples = [{"group": "g", "exposure": float(xi), "recon": 1.0, "grad_err": float(yi)} for xi, yi in zip(x, y)]
    ref = float(torch.linalg.lstsq(x[:, None], y[:, None]).solution)
    assert fit_kappa(samples)["g"] == pytest.approx(ref, rel=1e-9)


def test_calibration_run_save_load(tmp_path):
    model = build_model(tiny_config("llama", hidden_size=64, num_layers=2, vocab_size=256), lora=LoraSpec(4, 8))
    model.train()
    mbs = replayed_microbatches(model, 2, 256, seed=torch.seed() % 2**31)
    cal = calibrate(Runner(model), mbs)
    assert set(cal.e_bar) == set(cal.groups) and len(cal.samples) == 2 * 4
    assert all(0 < e < 0.1 for e in cal.e_bar.values())
    assert all(k >= 0 and k == k for k in cal.kappa.values())
    name = next(iter(cal.e_bar))
    assert cal.risk(name, 0.0) == 0.0 and cal.static_risk(name) >= 0
    path = tmp_path / "run" / "calibration.json"
    cal.save(path)
    again = Calibration.load(path)
    assert again.kappa == cal.kappa and again.e_bar == cal.e_bar
    path.write_text(json.dumps({"nope": 1}))
    with pytest.raises(ValueError, match="not a hilore calibration file"):
        Calibration.load(path)
