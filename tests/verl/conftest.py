"""The two-rank verl cases (``tests/helpers/verl_ranks.py``), run once for the three test files
that assert on them: starting the ranks and importing verl cost more than a case."""

import os

import pytest
import torch


@pytest.fixture(scope="session")
def verl_ranks(tmp_path_factory):
    """``{"seed": seed, case: [rank 0's results, rank 1's]}`` for the lockstep, skip and Ulysses
    cases, on one tiny model (``HILORE_SEED=N`` reruns a printed seed)."""
    pytest.importorskip("verl")
    pytest.importorskip("tensordict")
    import verl_cpu

    seed = int(os.environ.get("HILORE_SEED") or torch.seed() % 2**31)
    cases = ("lockstep", "skip", "ulysses")
    ranks = verl_cpu.two_ranks(cases, tmp_path_factory.mktemp("verl_ranks"), seed, timeout=1200, hang_s=600)
    return {"seed": seed, **ranks}
