"""DeepSpeed ZeRO-3's parameter trace under plans that change per microbatch, on two gloo ranks
(``zero3_trace_ranks.py``): replays in backward stay out of the coordinator."""

import pytest
from gloo_ranks import run_ranks  # tests/helpers


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Both ``ZERO`` configurations on one pair of ranks: per configuration, per rank, what it saw."""
    tmp = tmp_path_factory.mktemp("zero3_trace")
    out = tmp / "ranks.json"
    env = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    return run_ranks("zero3_trace_ranks.py", out, "kept,tight", out=out, timeout=600, cwd=tmp, env=env)


@pytest.mark.parametrize("zero", ["kept", "tight"])
def test_zero3_trace_survives_changing_plans(zero, ranks):
    """With the R (and P) units changing every microbatch, DeepSpeed never invalidates its trace
    (it prefetches from the second step on, as without the engine); its count of available
    parameter elements is the true one at every fetch and after every step (the first step's
    offset is DeepSpeed's own: the same without the engine); gradients are no-gc's, bitwise.
    ``zero``: whether forward's weights stay gathered for backward (``zero3_trace_ranks.ZERO``)."""
    for r in (rank[zero] for rank in ranks):
        ref, got = r["no-gc"], r["hilore"]
        print(got["invalidated_at"], [(s["plan"], s["counted"], s["resident"], s["drift"]) for s in got["steps"]])
        assert ref["invalidated_at"] == [] and got["invalidated_at"] == []
        assert got["steps"] == ref["steps"]
        for s in got["steps"][1:]:
            assert s["complete"] and s["counted"] == s["resident"] and s["drift"] == [0], s
        assert all(r["bitwise"]) and len(r["bitwise"]) == len(got["steps"]) > 5


@pytest.mark.parametrize("zero", ["kept", "tight"])
def test_zero3_replay_gathers_one_collective_per_module_and_never_synchronizes(zero, ranks):
    """Each replayed module's missing weights (and each unpacked partitioned parameter) arrive in
    one collective, and the engine's gathers make no accelerator synchronize inside backward (a
    counting stand-in: DeepSpeed is told the device does not order data itself, as on CUDA, where
    its blocking per-parameter gather ends in a device-wide ``synchronize``)."""
    for r in (rank[zero]["hilore"] for rank in ranks):
        print(zero, r["collectives_per_gather"], r["syncs_in_backward"])
        assert r["syncs_in_backward"] == 0
        assert r["collectives_per_gather"] and set(r["collectives_per_gather"]) == {1}
