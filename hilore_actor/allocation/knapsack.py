"""The two-constraint multiple-choice knapsack of Eq. 13, solved exactly on a grid.

Each unit picks one option (R, H or L); options have a value (seconds saved), a memory cost
(bytes) and a risk cost. Costs are rounded *up* onto ``grid_memory`` x ``grid_risk`` cells
(conservative: a solution feasible on the grid is feasible in reality). Dynamic programming
over a rolling ``(K_B+1) x (K_delta+1)`` table, ``V[b, d]`` = best value with memory <= b
cells and risk <= d cells, O(U K_B K_delta) time, one byte of predecessor choice per unit and
cell for backtracking. Ties prefer lower risk, then lower memory: the answer is read at the
smallest risk level, then the smallest memory level, that reach the optimum; within a cell
options are tried R, H, L so the first best (the cheaper one) is kept.

Rounding up wastes up to a cell per chosen option (on the demo's plans, 42 stored units of
two cells each left 14% of B unused), so the grid answer is then filled by exact costs
(``_fill``): upgrades that still fit the real budgets, best value per byte first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Sequence

import numpy as np


@dataclass(frozen=True)
class Option:
    action: str  # "R" | "H" | "L"
    value: float  # seconds saved against all-R
    memory: float  # peak bytes added against all-R
    risk: float = 0.0  # calibrated gradient-distortion estimate (0 for H and R)


def grid_cost(cost: float, budget: float, cells: int) -> int:
    """Cells needed for ``cost`` on a grid of ``cells`` over ``budget``, rounded up; a cost
    above the budget (or any positive cost on a zero budget) is ``cells + 1`` (infeasible)."""
    if cost <= 0:
        return 0
    if budget <= 0 or cells <= 0:
        return cells + 1
    return math.ceil(cost / budget * cells - 1e-9)


def solve(
    items: Sequence[Sequence[Option]],
    memory_budget: float,
    risk_budget: float,
    grid_memory: int = 128,
    grid_risk: int = 128,
    fill: bool = True,
) -> List[int]:
    """Index of the chosen option for each item. Every item needs a free option (R).
    ``fill``: then upgrade by exact costs where rounding left room (``_fill``)."""
    kb = grid_memory
    kd = grid_risk if risk_budget > 0 else 0
    # values become int32 units of 2^-30 of the largest possible total: exact integer sums,
    # half the memory traffic of float64 (the table is memory-bound)
    top = sum(max(abs(o.value) for o in opts) for opts in items) or 1.0
    scale = 2**30 / top
    V = np.zeros((kb + 1, kd + 1), dtype=np.int32)
    buf = np.empty_like(V)
    nxt = np.empty_like(V)
    mask = np.empty(V.shape, dtype=bool)
    choices = np.zeros((len(items), kb + 1, kd + 1), dtype=np.uint8)
    costs = []
    for i, opts in enumerate(items):
        if not any(o.memory <= 0 and o.risk <= 0 for o in opts):
            raise ValueError(f"item {i} has no free option (R); every unit can always be recomputed")
        order = sorted(range(len(opts)), key=lambda j: (opts[j].risk, opts[j].memory))
        c = [(grid_cost(o.memory, memory_budget, kb), grid_cost(o.risk, risk_budget, kd)) for o in opts]
        costs.append(c)
        first = order[0]  # the free option with least risk and memory: R
        new = np.add(V, np.int32(round(opts[first].value * scale)), out=nxt)
        ch = choices[i]
        ch[...] = first
        for j in order[1:]:
            cb, cd = c[j]
            if cb > kb or cd > kd:
                continue
            h, w = kb + 1 - cb, kd + 1 - cd
            cand = np.add(V[:h, :w], np.int32(round(opts[j].value * scale)), out=buf[:h, :w])
            sub = new[cb:, cd:]
            better = np.greater(cand, sub, out=mask[:h, :w])
            np.copyto(sub, cand, where=better)
            np.copyto(ch[cb:, cd:], j, where=better)
        V, nxt = new, V
    best = V[kb, kd]
    d = int(np.argmax(V[kb, :] == best))  # least risk reaching the optimum
    b = int(np.argmax(V[:, d] == best))  # then least memory
    out = [0] * len(items)
    for i in range(len(items) - 1, -1, -1):
        j = int(choices[i, b, d])
        out[i] = j
        b -= costs[i][j][0]
        d -= costs[i][j][1]
    return _fill(items, out, memory_budget, risk_budget) if fill else out


def _fill(items: Sequence[Sequence[Option]], picks: List[int], memory_budget: float, risk_budget: float) -> List[int]:
    """Upgrade picks by exact (not grid) costs while they fit: each round takes the upgrade
    with the most value per extra byte (ties: least risk). Feasible stays feasible, value
    only grows."""
    picks = list(picks)
    mem = sum(items[i][j].memory for i, j in enumerate(picks))
    risk = sum(items[i][j].risk for i, j in enumerate(picks))
    while True:
        best = None
        for i, opts in enumerate(items):
            cur = opts[picks[i]]
            for j, o in enumerate(opts):
                gain, dm, dr = o.value - cur.value, o.memory - cur.memory, o.risk - cur.risk
                if gain <= 0 or mem + dm > memory_budget or risk + dr > risk_budget + 1e-15:
                    continue
                key = (gain / max(dm, 1e-9), -dr)
                if best is None or key > best[0]:
                    best = (key, i, j, dm, dr)
        if best is None:
            return picks
        _, i, j, dm, dr = best
        picks[i], mem, risk = j, mem + dm, risk + dr
