"""Two FSDP2 ranks over gloo on this CPU, verl's engine and HiLoRe's, for ``tests/verl``.

``python tests/helpers/verl_ranks.py MODEL_DIR SEED OUT.json CASE...`` spawns two processes (one rank
each, verl 0.9.1's real engine on the CPU platform of ``verl_cpu.py``), runs the cases one after the
other on them (one process start and one import of verl for all: they cost more than a case) and
writes what each rank saw, by case:

- ``lockstep``: ``verl_two_ranks.py``, planning in lockstep (``tests/verl/test_verl.py``);
- ``skip``: ``verl_skip_ranks.py``, the zero-advantage skip (``tests/verl/test_verl_skip.py``);
- ``ulysses``: ``verl_ulysses_ranks.py``, Ulysses degree 2 (``tests/verl/test_verl_ulysses.py``); last,
  as its stand-ins and meter stay for the rest of the process.

A case in which one rank skipped a collective hangs both: the ranks dump their stacks and exit
(``verl_cpu.start_rank``), and the test's timeout ends the rest.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import verl_cpu  # noqa: E402
from gloo_ranks import spawn_two, write_ranks  # noqa: E402


def rank_main(rank: int, world: int, port: int, path: str, seed: int, out: str, *cases: str) -> None:
    import verl_skip_ranks
    import verl_two_ranks
    import verl_ulysses_ranks

    assert "ulysses" not in cases[:-1], "the Ulysses case runs last"
    verl_cpu.start_rank(rank, world, port)
    run = {
        "lockstep": verl_two_ranks.lockstep,
        "skip": verl_skip_ranks.skip_runs,
        "ulysses": verl_ulysses_ranks.ulysses_runs,
    }
    write_ranks({case: run[case](rank, path, seed) for case in cases}, out, world)


if __name__ == "__main__":
    spawn_two(rank_main, sys.argv[1], int(sys.argv[2]), *sys.argv[3:])
