"""Two gloo ranks through OpenRLHF 0.11.2's real actor path on the CPU, for ``test_openrlhf_zero3.py``.

``python openrlhf_ranks.py MODEL_DIR OUT.json CASE...`` runs the cases one after the other on one
pair of ranks (one process start and one import of the stack for all: they cost more than a case)
and writes each rank's results by case:

- ``drop-in``: the drop-in against OpenRLHF's gradient checkpointing under ZeRO-3
  (``openrlhf_zero3_ranks.py``);
- ``skip:STAGE:SETTINGS:BATCHINGS``: the zero-advantage skip's settings under a ZeRO stage
  (``openrlhf_skip_ranks.py``).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from gloo_ranks import spawn_two, write_ranks  # noqa: E402


def rank_main(rank, world, port, model_dir, out, *cases):
    from openrlhf_skip_ranks import skip_runs
    from openrlhf_zero3_ranks import drop_in, start_rank

    start_rank(rank, world, port)
    seen = {}
    for case in cases:
        if case == "drop-in":
            seen[case] = drop_in(rank, model_dir)
        else:
            _, stage, settings, batchings = case.split(":")
            seen[case] = skip_runs(rank, model_dir, int(stage), settings, batchings)
    write_ranks(seen, out, world)


if __name__ == "__main__":
    spawn_two(rank_main, *sys.argv[1:])
