"""HiLoRe's verl engine under Ulysses sequence parallelism (degree 2, two gloo ranks on this CPU).

The ranks of one SP group run verl's all-to-alls inside attention, so a unit recomputed on one
rank and stored on the other hangs both: ``tests/helpers/verl_ulysses_ranks.py`` runs the engines in two
processes under a timeout (the fixture ``verl_ranks``), and this test asserts on what they saw
(``verl/attach.py``).
"""

import pytest

pytest.importorskip("verl")
pytest.importorskip("tensordict")
import verl_cpu  # noqa: E402

LAYERS = verl_cpu.TINY["num_hidden_layers"]


def all_to_alls(actions) -> int:
    """verl's all-to-alls a HiLoRe batch runs: per micro-batch and layer 4 in forward (q, k, v,
    output) and 4 in backward, plus 4 more for each attention unit recomputed (R)."""
    return sum(8 * LAYERS + 4 * sum(a == "R" for n, a in acts.items() if n.endswith("self_attn")) for acts in actions)


def test_ulysses_two_ranks_take_one_action_per_unit_and_match_verl(verl_ranks):
    """Ulysses 2 over gloo: verl's Ulysses attention runs (its gradient matches verl's without SP);
    both ranks adopt one plan and take the same actions on every micro-batch; the H/R plan's
    gradient is verl's checkpointed one bitwise, also when the ranks' own choices differ (rank 0's
    recomputes attention, so its all-to-alls run again in backward: the group takes rank 0's);
    mode hilore's is within 0.015. A micro-batch whose sized plan stores nothing runs plain layer
    checkpointing (no step, no online choice, no gather), so counts go by the micro-batches that ran one.
    The zero-advantage skip under Ulysses gives the gradient of the same engine without it."""
    print("seed", verl_ranks["seed"])  # HILORE_SEED=N reruns a printed seed
    r0, r1 = verl_ranks["ulysses"]
    kinds = ("hilore-hr", "overruled", "hilore")
    print({k: (r0[k]["actions"], r0[k]["all_to_all"], r0[k]["rel"]) for k in kinds}, "skip", r0["skip"], r1["skip"])
    assert r0["verl"]["all_to_all"] == r1["verl"]["all_to_all"] == 12 * LAYERS * 2  # HF gc: 4 more per layer
    assert r0["verl"]["no_sp_rel"] <= 1e-5
    for kind in kinds:
        a, b = r0[kind], r1[kind]
        assert a["class"] == "UlyssesMicrobatches"
        assert a["plan"] == b["plan"] and a["budget"] == b["budget"] and a["tokens"] == b["tokens"] == 32
        assert len(a["actions"]) == 2 and a["actions"] == b["actions"]  # every micro-batch, one action per unit
        assert a["all_to_all"] == b["all_to_all"] == all_to_alls(a["actions"])
        assert a["peaks"] == b["peaks"]
    for kind in ("hilore-hr", "overruled"):
        assert r0[kind]["equal"] and r1[kind]["equal"]
    assert r0["hilore-hr"]["disagreements"] == r1["hilore-hr"]["disagreements"] == 0
    ov0, ov1 = r0["overruled"], r1["overruled"]
    assert any(q != "checkpoint" for q in ov0["plan"].values())  # the planning-size plan stores something
    assert ov0["stepped"] == ov1["stepped"] and ov0["stepped"][0]  # it ran the first micro-batch's step
    assert ov0["disagreements"] == 0 and ov1["disagreements"] == sum(ov1["stepped"])  # rank 0's, every step
    assert all(acts[f"model.layers.{i}.self_attn"] == "R" for acts in ov0["actions"] for i in range(LAYERS))
    assert r0["hilore-hr"]["gathers"] == []  # H/R only: the plan's own actions, no norms
    hl0, hl1 = r0["hilore"], r1["hilore"]
    assert hl0["stepped"] == hl1["stepped"] and hl0["stepped"][0]  # the first runs the planning-size plan's step
    assert hl0["gathers"] == hl1["gathers"]
    assert len(hl0["gathers"]) == sum(hl0["stepped"])  # one gather per micro-batch that runs a step
    for n, acts in zip(hl0["gathers"], [a for a, s in zip(hl0["actions"], hl0["stepped"]) if s]):
        assert n >= 1 or all(a == "R" for a in acts.values())  # a unit not planned R tracks its norms
    assert hl0["disagreements"] == hl1["disagreements"] == 0  # the same problem on both ranks
    assert r0["hilore"]["rel"] <= 0.015 and r1["hilore"]["rel"] <= 0.015
    assert r0["gathered"] == r1["gathered"] == [[0.0, 1.0, 2.0, 10.0, 11.0, 12.0]]
    for r in (r0, r1):  # the zero-advantage skip: both ranks leave out the same two responses of four
        assert r["skip"]["rel"] <= 1e-6 and r["skip"]["microbatches"] == [1, 2] and r["skip"]["share"] == 0.5
