"""Where the learner ranks run, how they find each other, and where they checkpoint.

- A placement group with one bundle per rank (``{"GPU": 1, "CPU": 1}`` on CUDA, ``{"CPU": 1}``
  on CPU), packed (as OpenRLHF places its actor group): a node with M free GPUs takes M ranks,
  so ``--actor.num_nodes N --actor.num_gpus_per_node M`` lands on N nodes of M GPUs (with
  ``N = 1``, strictly on one node). Rank r runs in bundle r. The group must be placeable
  within ``READY_S`` seconds, else one message (more ranks than the cluster has GPUs, say).
- The process group meets at rank 0's node: its address and a free port there, found by a
  task placed in bundle 0 (``127.0.0.1`` while every rank is on one node).
- Checkpoints are written by every rank into one folder, so with several nodes it must be
  storage every node reaches: ``check_shared`` has every rank write a probe file there and
  read everyone else's, and stops the job with one message if one cannot.
- On the Ray instance the job started itself (one node, the driver's), neither task runs: the
  port is drawn by the driver and the folder is the driver's own. Each task would start a Ray
  worker process first (seconds on a small machine, before any learner starts).

``HILORE_FAULT=unshared:<rank>``: that rank's probe goes to a folder of its own, as on a node
whose disk is not shared (the test of ``check_shared``).
"""

from __future__ import annotations

import os
import tempfile
import uuid
from typing import List, Tuple

from ..learner.fault_injection import injected

READY_S = 300
PROBE_DIR = ".probe"


def _rendezvous_address(one_node: bool) -> Tuple[str, int]:
    """(address, free port) on the node this runs on."""
    from ..runtime.distributed import free_port

    if one_node:
        return "127.0.0.1", free_port()
    import ray

    addr = ray.util.get_node_ip_address()
    return addr, free_port(addr)


def learner_placement(
    ray, world: int, num_nodes: int, cuda: bool, local_ray: bool = False
) -> Tuple[object, List[dict], str, int]:
    """(placement group, per rank the actor options placing it, rendezvous address, port);
    ``local_ray``: Ray is the job's own single-node instance, so the driver draws the port."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = {"GPU": 1, "CPU": 1} if cuda else {"CPU": 1}
    # one node: all on it for sure (the rendezvous is 127.0.0.1); several: packed, M per node
    pg = placement_group([dict(bundle) for _ in range(world)], strategy="STRICT_PACK" if num_nodes == 1 else "PACK")
    ready, _ = ray.wait([pg.ready()], timeout=READY_S)
    if not ready:
        ray.util.remove_placement_group(pg)
        raise RuntimeError(
            f"the cluster could not place {world} learner ranks of {bundle} each within {READY_S} s "
            f"(--actor.num_nodes {num_nodes} x --actor.num_gpus_per_node {world // num_nodes}); "
            f"cluster resources: {ray.cluster_resources()}"
        )
    place = [
        dict(
            num_cpus=bundle["CPU"],
            num_gpus=bundle.get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r),
        )
        for r in range(world)
    ]
    if local_ray:
        return pg, place, *_rendezvous_address(True)
    addr, port = ray.get(
        ray.remote(_rendezvous_address)
        .options(num_cpus=0, scheduling_strategy=place[0]["scheduling_strategy"])
        .remote(num_nodes == 1)
    )
    return pg, place, addr, port


def write_probe(root: str, token: str, rank: int) -> str:
    """Rank ``rank``'s probe file under ``root`` (see the module docstring); returns its folder."""
    folder = os.path.join(root, PROBE_DIR)
    if injected("unshared", rank):
        folder = tempfile.mkdtemp(prefix="hilore-node-local-")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"{token}.{rank}"), "w") as f:
        f.write(token)
    return folder


def unseen_probes(root: str, token: str, world: int, rank: int) -> List[int]:
    """The ranks whose probe files rank ``rank`` cannot read under ``root``."""
    folder = os.path.join(root, PROBE_DIR)
    if injected("unshared", rank):
        return [r for r in range(world) if r != rank]
    missing = []
    for r in range(world):
        try:
            with open(os.path.join(folder, f"{token}.{r}")) as f:
                ok = f.read() == token
        except OSError:
            ok = False
        if not ok:
            missing.append(r)
    return missing


def node_id(rank: int = 0) -> str:
    """The Ray node this runs on (``rank``: unused, as every per-rank task takes it)."""
    import ray

    return ray.get_runtime_context().get_node_id()


def check_shared(ray, place: List[dict], root: str, **options) -> None:
    """Before the learners start: a task in each rank's bundle writes a probe under ``root``,
    then each reads all of them; ``RuntimeError`` naming the ranks that cannot see each
    other's files. ``options``: more Ray options for the tasks (the job's runtime env)."""
    import shutil

    token, world = uuid.uuid4().hex, len(place)

    def on_each(fn, *args):  # fn(*args, rank) in rank's bundle, for every rank
        return ray.get(
            [
                ray.remote(fn)
                .options(num_cpus=0, scheduling_strategy=p["scheduling_strategy"], **options)
                .remote(*args, r)
                for r, p in enumerate(place)
            ]
        )

    on_each(write_probe, root, token)
    unseen = dict(enumerate(on_each(unseen_probes, root, token, world)))
    nodes = on_each(node_id)
    shutil.rmtree(os.path.join(root, PROBE_DIR), ignore_errors=True)
    blind = {r: m for r, m in unseen.items() if m}
    if blind:
        who = "; ".join(f"rank {r} (node {nodes[r][:8]}) does not see the files of ranks {m}" for r, m in blind.items())
        raise RuntimeError(
            f"the checkpoint folder {root} is not storage every learner node reaches ({who}): set "
            "--ckpt.path (or --save_path) to a shared file system mounted at the same path on every node"
        )
