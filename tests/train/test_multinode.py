"""The training job on a simulated two-node Ray cluster (``ray.cluster_utils.Cluster``: two
raylets on this machine, one CPU each), one learner rank per node: placement, rendezvous at
rank 0's node address, bitwise resume, and the shared-checkpoint check (train/placement.py)."""

import pytest

from train_job import job, metrics, same_training

TWO_NODES = ["--actor.num_nodes", "2", "--actor.num_gpus_per_node", "1"]
pytestmark = (
    pytest.mark.slow
)  # three job runs on a second raylet: about 2 minutes (pytest -m slow tests/train/test_multinode.py)


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    c.add_node(num_cpus=1)
    c.wait_for_nodes()
    yield c.address
    c.shutdown()


def test_one_rank_per_node_and_two_steps_plus_resume_match_one_node(cluster, uninterrupted, tmp_path):
    """Each rank on its own node (the nodes' ids in the metrics); two steps, then --resume to the
    third, reproduce the single-node run (same world size) bit for bit in H/R mode."""
    env = {"RAY_ADDRESS": cluster}
    r = job(tmp_path, *TWO_NODES, "--max_steps", "2", env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    r = job(tmp_path, *TWO_NODES, "--max_steps", "3", "--resume", env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = metrics(tmp_path)
    assert [m["step"] for m in rows] == [1, 2, 3]
    for m in rows:
        nodes = m["learner_nodes"]
        assert set(nodes) == {"0", "1"} and nodes["0"] != nodes["1"], nodes
    same_training(rows, metrics(uninterrupted[0]), (0, 1, 2))


def test_a_checkpoint_folder_one_node_cannot_see_is_refused(cluster, tmp_path):
    r = job(tmp_path, *TWO_NODES, "--max_steps", "1", env={"RAY_ADDRESS": cluster, "HILORE_FAULT": "unshared:1"})
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    assert (
        "is not storage every learner node reaches" in r.stderr and "rank 1" in r.stderr and "Traceback" not in r.stderr
    )
    assert not (tmp_path / "metrics.jsonl").exists()
