"""learner/lockstep.py on 2 CPU ranks (gloo, FSDP2): rank 0 leads, rank 1 replays every pass."""

import torch
from gloo_ranks import run_ranks
from torchrun import torchrun


def test_followers_replay_every_pass_and_gradients_are_whole(tmp_path):
    """Passes with a fixed action map, an online chooser (its choice reaches the follower) and
    gradients (gathered whole on every rank: they equal the unsharded model's); the follower
    leaves with rank 0's state. A missed pass would hang both ranks in a collective."""
    seed = torch.seed() % 2**31
    print("seed", seed)
    leader, follower = torchrun("lockstep_worker.py", str(seed), cwd=tmp_path, timeout=300)
    assert leader["units"] >= 4 and leader["grads_equal"] == [True] * 4 and leader["peak_watched"]
    assert follower["followed"] == 5 and follower["fixed_actions"] and follower["chooser_actions"]
    assert follower["state"]["budget"] == 123 and len(follower["state"]["plan"]) == leader["units"]


def test_zero3_ranks_agree_on_one_action_per_unit(tmp_path):
    """Where the ranks' actions differ a unit is R on both (always allowed, never more
    memory); where they agree it keeps its action."""
    out = tmp_path / "ranks.json"
    ranks = run_ranks("agree_ranks.py", out, out=out, timeout=120)
    assert ranks[0]["agreed"] == ranks[1]["agreed"] == {"a": "H", "b": "R", "c": "R", "d": "P"}
