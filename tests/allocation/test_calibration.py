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


def test_levels_merge_save_load_and_check(tmp_path):
    """Two L levels on one tiny model; each rank's share merges into Eq. 10 over all samples
    (the same as calibrating on all microbatches at once); files hold several levels and are
    refused for codecs they were not calibrated with."""
    from hilore_actor.allocation.calibration import calibrate_levels, check_levels, load_levels, merge, save_levels

    seed = torch.seed() % 2**31
    print("seed", seed)
    model = build_model(
        tiny_config("qwen2", hidden_size=64, num_layers=2, vocab_size=256), lora=LoraSpec(4, 8), seed=seed
    )
    model.train()
    mbs = replayed_microbatches(model, 3, 128, seed=seed)
    runner = Runner(model)
    whole = calibrate_levels(runner, mbs, ("L", "L:bf16"))
    assert (
        whole["L"].codec == runner.engine.codec.name == "int8-g64" and whole["L:bf16"].codec == "bf16"
    )  # the default's first
    assert all(whole["L:bf16"].e_bar[n] < whole["L"].e_bar[n] for n in whole["L"].e_bar)  # bf16 reconstructs better
    parts = [calibrate(runner, mbs[:2]), calibrate(runner, mbs[2:])]
    merged = merge(parts)
    assert merged.kappa == pytest.approx(whole["L"].kappa, rel=1e-9) and merged.e_bar == pytest.approx(whole["L"].e_bar)
    path = tmp_path / "levels.json"
    save_levels(whole, path)
    again = load_levels(path)
    assert set(again) == {"L", "L:bf16"} and again["L:bf16"].kappa == whole["L:bf16"].kappa
    check_levels(again, "int8-g64,bf16", path)
    for codecs in ("bf16,int8-g64", "int8-g64", "int8,bf16", "int8-g64,fp8-e4m3"):
        with pytest.raises(ValueError, match="calibrate again"):
            check_levels(again, codecs, path)
    save_levels({"L": whole["L"]}, path)  # one level: the single-calibration format
    assert Calibration.load(path).kappa == whole["L"].kappa and set(load_levels(path)) == {"L"}
