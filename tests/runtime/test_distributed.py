"""The engine inside DeepSpeed ZeRO-2/3 engines on 2 CPU ranks (gloo): H/R gradients equal no-gc."""

import os

import pytest
from torchrun import torchrun

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers")


def test_zero3_l_never_compresses_a_gathered_weight(tmp_path):
    """ZeRO-3 puts gathered full weights on the modules while they run and releases them after:
    under all-L, and under an exact forward moved to L after it (the online chooser's path), L
    compresses activations only, never such a weight, and the gradient stays within 0.05 of
    no-gc's."""
    res = torchrun("ds_worker.py", "3", "fp32", "no-gc,all-l,h-to-l", cwd=tmp_path)
    for m in ("all-l", "h-to-l"):
        spied = res[m + ":spied"]
        assert spied["weights"] == [] and spied["activations"] > 0, (m, spied)
        assert 0 < res[m + ":rel"] < 0.05, (m, res[m + ":rel"])


@pytest.mark.parametrize("stage,dtype", [(3, "fp32"), (3, "bf16"), (2, "fp32")])
def test_zero_engine_gradients_match_no_gc(stage, dtype, tmp_path):
    res = torchrun("ds_worker.py", str(stage), dtype, cwd=tmp_path)
    assert res["units"][:2] == ["model.layers.0.self_attn", "model.layers.0.mlp"]
    assert res["n_grads"] > 0 and res["grad_norm"] > 0
    assert res["all-r"] and res["all-h"] and res["mixed"], res
