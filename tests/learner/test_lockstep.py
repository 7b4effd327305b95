"""learner/lockstep.py on 2 CPU ranks (gloo, FSDP2): rank 0 leads, rank 1 replays every pass."""

import json
import os
import subprocess
import sys

import torch
from torchrun import torchrun

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers")


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
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers", "agree_ranks.py"),
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    ranks = json.loads(out.read_text())["ranks"]
    assert ranks[0]["agreed"] == ranks[1]["agreed"] == {"a": "H", "b": "R", "c": "R", "d": "P"}
