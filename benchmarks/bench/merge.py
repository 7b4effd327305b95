"""Combine benchmark pieces into one result: long runs (``cpu-real``: hours on 2 cores) split
by method, each piece its own process, each timing its methods interleaved with its own gc.

``python -m benchmarks.bench.merge PIECE.json [PIECE.json ...] --json OUT --plot OUT --markdown OUT``

Pieces combine only when they measured the same thing: same workload, inputs, head, budget
base and scope, and the same B (its base run's peak, which is deterministic for the same
inputs); anything else is an error. Of a real workload's inputs, the rollout pool's size and
mean reward (``POOL_KEYS``) are not compared: the pool grows with the calibration rows a run
builds after its measured ones (none when it reuses a calibration file), while the measured
rows are the pool's first tokens, from per-group seeds, and are described by the other keys.
Speeds stay paired with the gc of their own piece (as a compiled peer's phase is), so they
remain comparable; each record keeps the name of its piece.
A method measured in several pieces keeps the record of the last piece given (a re-run piece
replaces the rows it re-measured, e.g. after a change made them stale) and says so on stderr;
gc keeps its first record (every piece has its own).

``--pool``: the pieces are repeats of one run, split so that each fits a sitting (the powered
runs: tens of repeats). A method's records are pooled instead: its times, the gc and gc-aa
times paired with them, and the speeds recomputed over all pairs. Each pair still comes from
one repeat of one piece, so pooling keeps every ratio paired. Each piece plans HiLoRe afresh,
so the pooled speed includes the planning's variation: every piece's plan is kept
(``plans_by_piece``) and ``plans_differ`` says whether they differ.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Tuple

from . import outputs
from .records import add_gap_recovered

MUST_MATCH = (
    "workload",
    "head",
    "budget_from",
    "budget_scope",
    "budget_base_bytes",
    "budget_offset_bytes",
    "codec",
    "updates",
    "inputs",
    "torch",
    "device",
)
POOL_KEYS = ("groups", "mean_reward")  # rollout_pool's size: see the module docstring


def _compared(key: str, value):
    """``value`` as the merge compares it: a real workload's inputs without the pool's size."""
    if key == "inputs" and isinstance(value, dict):
        return {k: v for k, v in value.items() if k not in POOL_KEYS}
    return value


def merge(pieces: List[Tuple[str, Dict]]) -> Tuple[Dict, List[Dict]]:
    """(header, records) of the combined result; ``pieces``: (name, parsed JSON)."""
    if not pieces:
        raise ValueError("nothing to merge")
    first_name, first = pieces[0]
    for name, d in pieces[1:]:
        for k in MUST_MATCH:
            if _compared(k, d.get(k)) != _compared(k, first.get(k)):
                raise ValueError(f"{name} and {first_name} differ in {k!r}: {d.get(k)!r} vs {first.get(k)!r}")
    chosen: Dict[Tuple, Dict] = {}
    for name, d in pieces:
        for r in d["records"]:
            key = (r["method"], r.get("budget_ratio"))
            if key in chosen:
                if r["method"] == "gc":
                    continue
                print(
                    f"[merge] {r['method']} @ {r.get('budget_ratio')} is in {chosen[key]['piece']} and {name}; "
                    f"kept {name}",
                    file=sys.stderr,
                )
            chosen[key] = dict(r, piece=name)
    records = list(chosen.values())
    for r in records:
        r.pop("gap_recovered", None)
    add_gap_recovered(records)
    header = {k: v for k, v in first.items() if k != "records"}
    header["budgets"] = sorted({b for _, d in pieces for b in d["budgets"]})
    header["pieces"] = [
        {
            "name": n,
            "command": d["command"],
            "git_commit": d.get("git_commit"),
            "repeats": d["repeats"],
            "phases": d.get("phases"),
        }
        for n, d in pieces
    ]
    header.pop("phases", None)  # each piece keeps its own
    header["command"] = " ; ".join(d["command"] for _, d in pieces)
    return header, records


POOLED = ("update_seconds_all", "paired_gc_seconds_all", "paired_aa_seconds_all", "cpu_seconds_all")


def pool(pieces: List[Tuple[str, Dict]]) -> Tuple[Dict, List[Dict]]:
    """(header, records) of pieces that are repeats of one run (``--pool``)."""
    from .records import aa_summary_of
    from .stats import bimodal, speed_summary

    header, records = merge(pieces[:1])
    merge(pieces)  # the same checks of what was measured
    by_key = {(r["method"], r.get("budget_ratio")): r for r in records}
    for name, d in pieces[1:]:
        for r in d["records"]:
            base = by_key.get((r["method"], r.get("budget_ratio")))
            if base is None or r.get("unavailable") or base.get("unavailable"):
                raise ValueError(f"{name}: {r['method']} @ {r.get('budget_ratio')} is not a timed row of every piece")
            if "plan" in r:
                base.setdefault("plans_by_piece", [base["plan"]]).append(r["plan"])
            for k in POOLED:
                base[k] = list(base.get(k) or []) + list(r.get(k) or [])
    for r in records:
        if r.get("unavailable"):
            continue
        if "plans_by_piece" in r:
            r["plans_differ"] = any(p != r["plans_by_piece"][0] for p in r["plans_by_piece"])
        r.update(speed_summary(r["paired_gc_seconds_all"], r["update_seconds_all"]), **aa_summary_of(r))
        r["bimodal_times"] = bimodal(r["update_seconds_all"])
        r["piece"] = " + ".join(n for n, _ in pieces)
    for r in records:
        r.pop("gap_recovered", None)
    add_gap_recovered(records)
    header["pieces"] = [
        {
            "name": n,
            "command": d["command"],
            "git_commit": d.get("git_commit"),
            "repeats": d["repeats"],
            "phases": d.get("phases"),
        }
        for n, d in pieces
    ]
    header["repeats"] = sum(d["repeats"] for _, d in pieces)
    header["pooled"] = True
    return header, records


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench.merge", description=__doc__.splitlines()[0])
    p.add_argument("pieces", nargs="+", help="result JSON files of one workload, head, budget base and scope")
    p.add_argument("--json", required=True)
    p.add_argument("--plot", default=None)
    p.add_argument("--markdown", default=None)
    p.add_argument(
        "--pool", action="store_true", help="the pieces are repeats of one run: pool each method's paired times"
    )
    args = p.parse_args(argv)
    try:
        pieces = [(Path(x).name, json.loads(Path(x).read_text())) for x in args.pieces]
        header, records = (pool if args.pool else merge)(pieces)
    except (OSError, json.JSONDecodeError, KeyError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    outputs.write_json(args.json, header, records)
    if args.markdown:
        Path(args.markdown).write_text(outputs.markdown(records, header))
    if args.plot:
        outputs.plot(
            args.plot,
            records,
            header["budgets"],
            f"{header['workload']['name']}: throughput vs peak ({header['budget_scope']} scope), relative to gc",
        )
    print(outputs.table(records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
