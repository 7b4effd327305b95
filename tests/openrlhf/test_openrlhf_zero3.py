"""The OpenRLHF drop-in under DeepSpeed ZeRO-3 on two gloo ranks (``openrlhf_zero3_ranks.py``):
OpenRLHF 0.11.2's real ``init_model_from_pretrained`` (the model partitioned at load) and three
real ``fit`` calls, once as OpenRLHF runs them with its gradient checkpointing and once under
``HiLoRePolicyModelActor``, which plans at its first ``fit`` with both ranks in lockstep. And the
zero-advantage skip on against off under ZeRO-2 and ZeRO-3 (``openrlhf_skip_ranks.py``). One pair
of ranks runs the three cases (``openrlhf_ranks.py``): starting them and importing the stack costs more than a case."""

import math

import pytest
from gloo_ranks import run_ranks  # tests/helpers


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from hilore_actor.models import build_model, tiny_config
    from hilore_actor.models.source import load_tokenizer

    d = tmp_path_factory.mktemp("zero3") / "model"
    build_model(tiny_config("qwen2", hidden_size=64, num_layers=2, vocab_size=128), seed=0).save_pretrained(d)
    load_tokenizer("tiny:qwen2").save_pretrained(d)  # OpenRLHF loads one; the experiences are token ids
    return d


# dynamic batching under ZeRO-3 only: under ZeRO-1/2 with its gas 1 DeepSpeed keeps only a step's last
# micro-batch's gradient (skip.py), so the skip stays off there (test_openrlhf.py: its blockers)
SKIP_RUNS = {2: "fixed", 3: "fixed,dynamic"}


@pytest.fixture(scope="module")
def ranks(model_dir, tmp_path_factory):
    """Each case's results on the two ranks: the drop-in, then the skip under ZeRO-2 and ZeRO-3."""
    pytest.importorskip("openrlhf")
    tmp = tmp_path_factory.mktemp("openrlhf_ranks")
    out = tmp / "ranks.json"
    env = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    cases = ["drop-in", *(f"skip:{stage}:off,on:{b}" for stage, b in SKIP_RUNS.items())]
    ranks = run_ranks("openrlhf_ranks.py", model_dir, out, *cases, out=out, timeout=1200, cwd=tmp, env=env)
    return {case: [r[case] for r in ranks] for case in cases}


def test_zero3_drop_in_hr_gradients_equal_openrlhf_gc_on_two_ranks(ranks):
    """Per optimizer step (two microbatches each), the whole gradient under the drop-in (its
    own H/R plan, then an alternating H/R map, then an all-R plan on rank 0 alone) is bitwise
    OpenRLHF's with its gradient checkpointing, on both ranks; both ranks adopted one budget and
    one plan; where one rank's plan stores nothing, every rank recomputes everything with it
    (the same collectives), not only that rank."""
    ranks = ranks["drop-in"]
    for r in ranks:
        print(r["rel_err"], r["hilore"]["plan"]["counts"], r["hilore"]["actions"])
        assert r["openrlhf-gc"]["n_steps"] == r["hilore"]["n_steps"] == 3
        assert r["bitwise"] == [True, True, True], r["rel_err"]
        assert all(g > 0 for g in r["grad_norm"])
        assert all(set(a) <= {"H", "R"} for a in r["hilore"]["actions"])
        assert r["hilore"]["actions"][1] == ["H", "R"]  # the alternating map ran both
        assert r["hilore"]["actions"][2] == ["R"]  # rank 0's all-R plan, on both ranks
    assert ranks[0]["hilore"]["plan"] == ranks[1]["hilore"]["plan"]


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_advantage_skip_keeps_every_update_on_two_ranks(ranks, stage):
    """``--hilore.skip_zero_advantage`` on against off through OpenRLHF 0.11.2's real trainer
    (``openrlhf_skip_ranks.py``: ZeRO ``stage``, no KL loss, float32, fixed micro-batches and, under
    ZeRO-3, dynamic ones; three ``fit`` calls of one optimizer step each, advantages 0 for half of
    each rank's samples, then all of rank 0's, then all): per step the whole gradient and after
    every ``fit`` the weights agree within 1e-6 (the last step's gradient is 0 and AdamW still
    moves the weights, on its momentum); with the skip each ``fit`` runs 1, 2, 1 micro-batches per
    rank instead of 2 (rank 0 two pads in the second, one pad per rank in the third), DeepSpeed
    steps once per ``fit`` and the accumulation boundary is handed back; the ``fit`` reports the
    zero-advantage shares and the pads, and its sample means cover the trained samples."""
    ranks = ranks[f"skip:{stage}:off,on:{SKIP_RUNS[stage]}"]
    for rank, r in enumerate(ranks):
        for batching in SKIP_RUNS[stage].split(","):
            off, on = r[f"{batching}-off"], r[f"{batching}-on"]
            print(stage, batching, rank, on["grad_rel_err"], on["weight_rel_err"], on["micro"])
            assert not off["skip"] and on["skip"]
            assert off["n_steps"] == on["n_steps"] == 3
            assert all(e < 1e-6 for e in on["grad_rel_err"] + on["weight_rel_err"]), (on["grad_rel_err"], on)
            assert on["grad_norm"][0] > 0 and on["grad_norm"][1] > 0 and on["grad_norm"][2] == 0
            assert on["moved"][2] > 0 and off["moved"][2] > 0  # the all-zero step still moved AdamW
            assert off["micro"] == [2, 2, 2] and on["micro"] == [1, 2, 1]
            assert on["reset"] == [True, True, True]
            status = on["status"]
            assert [s["hilore_zero_adv_share"] for s in status] == [0.5, 0.5, 1.0]
            assert 0 < status[0]["hilore_zero_adv_token_share"] < 1 and status[2]["hilore_zero_adv_token_share"] == 1
            assert [s["hilore_pad_microbatches"] for s in status] == [0, 2, 2]
            assert all(set(s) == {"response_length"} for s in off["status"])
    for batching in SKIP_RUNS[stage].split(","):  # ppo_train's sample means: the trained samples', pads not counted
        for i in range(2):  # (the third fit trains only pads: they are its samples)
            tokens, count = (sum(r[f"{batching}-on"]["trained"][i][j] for r in ranks) for j in range(2))
            assert math.isclose(ranks[0][f"{batching}-on"]["status"][i]["response_length"], tokens / count)
