"""The engine inside DeepSpeed ZeRO-2/3 engines on 2 CPU ranks (gloo): H/R gradients equal no-gc.
One pair of ranks runs every configuration (``ds_worker.py``); each test reads its own."""

import pytest
from torchrun import torchrun

L_METHODS = "3:fp32:no-gc,all-l,h-to-l"
ENGINES = [(3, "fp32"), (3, "bf16"), (2, "fp32")]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return torchrun("ds_worker.py", L_METHODS, *(f"{s}:{d}" for s, d in ENGINES), cwd=tmp_path_factory.mktemp("ds"))


def test_zero3_l_never_compresses_a_gathered_weight(ranks):
    """ZeRO-3 puts gathered full weights on the modules while they run and releases them after:
    under all-L, and under an exact forward moved to L after it (the online chooser's path), L
    compresses activations only, never such a weight, and the gradient stays within 0.05 of
    no-gc's."""
    res = ranks[L_METHODS]
    for m in ("all-l", "h-to-l"):
        spied = res[m + ":spied"]
        assert spied["weights"] == [] and spied["activations"] > 0, (m, spied)
        assert 0 < res[m + ":rel"] < 0.05, (m, res[m + ":rel"])


@pytest.mark.parametrize("stage,dtype", ENGINES)
def test_zero_engine_gradients_match_no_gc(stage, dtype, ranks):
    res = ranks[f"{stage}:{dtype}"]
    assert res["units"][:2] == ["model.layers.0.self_attn", "model.layers.0.mlp"]
    assert res["n_grads"] > 0 and res["grad_norm"] > 0
    assert res["all-r"] and res["all-h"] and res["mixed"], res
