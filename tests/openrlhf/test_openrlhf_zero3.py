"""The OpenRLHF drop-in under DeepSpeed ZeRO-3 on two gloo ranks (``openrlhf_zero3_ranks.py``):
OpenRLHF 0.11.2's real ``init_model_from_pretrained`` (the model partitioned at load) and three
real ``fit`` calls, once as OpenRLHF runs them with its gradient checkpointing and once under
``HiLoRePolicyModelActor``, which plans at its first ``fit`` with both ranks in lockstep."""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from hilore_actor.models import build_model, tiny_config
    from hilore_actor.models.source import load_tokenizer

    d = tmp_path_factory.mktemp("zero3") / "model"
    build_model(tiny_config("qwen2", hidden_size=64, num_layers=2, vocab_size=128), seed=0).save_pretrained(d)
    load_tokenizer("tiny:qwen2").save_pretrained(d)  # OpenRLHF loads one; the experiences are token ids
    return d


def test_zero3_drop_in_hr_gradients_equal_openrlhf_gc_on_two_ranks(model_dir, tmp_path):
    """Per optimizer step (two microbatches each), the whole gradient under the drop-in (its
    own H/R plan, then an alternating H/R map, then an all-R plan on rank 0 alone) is bitwise
    OpenRLHF's with its gradient checkpointing, on both ranks; both ranks adopted one budget and
    one plan; where one rank's plan stores nothing, every rank recomputes everything with it
    (the same collectives), not only that rank."""
    pytest.importorskip("openrlhf")
    out = tmp_path / "ranks.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "openrlhf_zero3_ranks.py"), str(model_dir), str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0 and out.is_file(), proc.stdout[-3000:] + proc.stderr[-5000:]
    ranks = json.loads(out.read_text())["ranks"]
    for r in ranks:
        print(r["rel_err"], r["hilore"]["plan"]["counts"], r["hilore"]["actions"])
        assert r["openrlhf-gc"]["n_steps"] == r["hilore"]["n_steps"] == 3
        assert r["bitwise"] == [True, True, True], r["rel_err"]
        assert all(g > 0 for g in r["grad_norm"])
        assert all(set(a) <= {"H", "R"} for a in r["hilore"]["actions"])
        assert r["hilore"]["actions"][1] == ["H", "R"]  # the alternating map ran both
        assert r["hilore"]["actions"][2] == ["R"]  # rank 0's all-R plan, on both ranks
    assert ranks[0]["hilore"]["plan"] == ranks[1]["hilore"]["plan"]
