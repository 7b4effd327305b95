"""The job's rows without the responses that carry no update signal (``grpo/skip.py``).

The job's loss is a per-row token mean: DeepSpeed divides every microbatch's loss by the
configured gradient accumulation steps and averages over ranks, so an update's gradient is
``sum over its rows of grad(row loss) / (gas x world)``. Leaving a response with advantage 0
out of its row therefore keeps the gradient when the row keeps its denominator (its response
tokens before the skip, ``loss_options["num_tokens"]``), and a row left with nothing adds
nothing. The rows an update keeps are dealt so that every rank runs the same number of
microbatches (the same ZeRO collectives, the same lockstep passes); a rank short of them runs
a pad row, one skipped response, whose loss and gradient are exactly 0.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

from ..rollout.packing import pack_row


def response_tokens(seq) -> int:
    """Response tokens of a sequence ``(ids, prompt length, advantage, ...)``."""
    return len(seq[0]) - seq[1]


def skip_rows(ranks: List[List[Dict]], seqs: Sequence[Tuple]) -> Tuple[List[List[Dict]], int]:
    """``ranks`` (per rank, the step's rows in update order, each naming ``seq_index`` and
    ``update``) without the sequences whose advantage is exactly 0; returns the new rows per
    rank and how many pad rows were added.

    Per update: a row that loses nothing is kept as it is; a row that loses some sequences is
    repacked from the rest, with its original response tokens as its loss denominator; a row
    that keeps none is dropped. Every rank then runs ``k = max(1, ceil(kept rows / world))``
    rows: each keeps up to k of its own, the surplus goes to the ranks with fewer (fewest
    tokens first), and a rank still short runs pad rows (the update's shortest skipped
    sequence, ``pad`` set)."""
    world = len(ranks)
    updates = sorted({r["update"] for rows in ranks for r in rows})
    out: List[List[Dict]] = [[] for _ in range(world)]
    pads = 0
    for u in updates:
        own: List[List[Dict]] = [[] for _ in range(world)]
        skipped: List[int] = []
        for rank, rows in enumerate(ranks):
            for row in (r for r in rows if r["update"] == u):
                keep = [i for i in row["seq_index"] if seqs[i][2] != 0.0]
                skipped += [i for i in row["seq_index"] if seqs[i][2] == 0.0]
                if len(keep) == len(row["seq_index"]):
                    own[rank].append(row)
                elif keep:
                    denominator = float(sum(response_tokens(seqs[i]) for i in row["seq_index"]))
                    packed = pack_row([seqs[i] for i in keep])
                    own[rank].append(dict(packed, seq_index=keep, update=u, loss_options={"num_tokens": denominator}))
        kept = sum(len(rows) for rows in own)
        k = max(1, -(-kept // world))
        surplus = [row for rows in own for row in rows[k:]]
        placed = [rows[:k] for rows in own]
        for row in sorted(surplus, key=lambda r: -r["input_ids"].shape[1]):
            tokens = lambda rank: sum(r["input_ids"].shape[1] for r in placed[rank])  # noqa: E731
            rank = min((r for r in range(world) if len(placed[r]) < k), key=tokens)
            placed[rank].append(row)
        shortest = min(skipped, key=lambda i: len(seqs[i][0]), default=None)
        for rank in range(world):
            while len(placed[rank]) < k:
                pad = dict(pack_row([seqs[shortest]]), seq_index=[shortest], update=u, pad=True)
                placed[rank].append(pad)
                pads += 1
            out[rank] += placed[rank]
    return out, pads


def zero_advantage_shares(seqs: Sequence[Tuple]) -> Dict[str, float]:
    """The share of the step's responses, and of their tokens, whose advantage is exactly 0."""
    zero = [s for s in seqs if s[2] == 0.0]
    tokens = sum(response_tokens(s) for s in seqs)
    return {
        "zero_adv_share": len(zero) / max(1, len(seqs)),
        "zero_adv_token_share": sum(response_tokens(s) for s in zero) / max(1, tokens),
    }
