"""Two FSDP2 ranks over gloo: HiLoRe's verl engine with the zero-advantage skip on and off (the
case ``skip`` of ``verl_ranks.py``; a rank that ran fewer micro-batches than the other would hang
both in FSDP's collectives; ``tests/verl/test_verl_skip.py`` asserts on what the ranks saw).

Per rank: one engine in mode hilore-hr with the skip on, one with it off (same weights), and on
each the same three mini-batches of 8 responses, verl's ``ppo_loss`` without KL or entropy:

- ``fixed``: micro-batches of 2; rank 0's advantages all 0, rank 1 keeps 3 of 8 (so rank 1
  runs 3 kept and 1 pad, rank 0 four pads: two micro-batches each);
- ``dynamic``: the same responses under verl's dynamic batch size, at most 1.5 responses' tokens
  per micro-batch (rank 1's three kept need three micro-batches, not the ceil(3 / 1.5) = 2 of
  verl's first guess, so rank 0 runs three pads);
- ``nothing``: every advantage 0 on both ranks (one micro-batch of pads each).

For each: the whole (reduced) LoRA gradient, which parameters have one, the micro-batch count
and the skip's metrics; then three optimizer steps (``train_batch``, AdamW) on the three and the
final LoRA weights.
"""

import os

import torch

import verl_cpu

B, P, R = 8, 8, 24
KEPT = {"fixed": {0: [], 1: [1, 4, 6]}, "dynamic": {0: [], 1: [1, 4, 6]}, "nothing": {0: [], 1: []}}


def batch(kind: str, rank: int, seed: int, vocab: int):
    from verl.utils import tensordict_utils as tu

    from hilore_actor.verl import verify

    td = verify.grpo_batch(seed + 100 + rank, vocab=vocab, B=B, P=P, R=R, full=True)
    zero = [i for i in range(B) if i not in KEPT[kind][rank]]
    td["advantages"][zero] = 0.0
    if kind == "dynamic":
        tu.assign_non_tensor(td, use_dynamic_bsz=True, max_token_len_per_gpu=3 * (P + R) // 2)
    return td


def lora(engine) -> torch.Tensor:
    return torch.cat(
        [
            (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten().float().cpu()
            for p in engine.module.parameters()
            if p.requires_grad
        ]
    )


def skip_runs(rank: int, path: str, seed: int) -> dict:
    from hilore_actor.verl import verify
    from hilore_actor.verl.settings import CONFIG_ENV

    vocab = verl_cpu.TINY["vocab_size"]
    loss_fn = verify.ppo_loss_fn(batch_size=B)
    seen = {}
    results = {}
    for setting in ("off", "on"):
        try:
            engine = verify.build_engine(
                "hilore-hr",
                path,
                seed,
                settings={**verl_cpu.SETTINGS, "skip_zero_advantage": setting},
                job=verl_cpu.JOB,
            )
        finally:
            os.environ.pop(CONFIG_ENV, None)
        for kind in KEPT:
            td = batch(kind, rank, seed, vocab)
            g = verify.batch_gradient(engine, td, loss_fn)
            mb = engine.hilore
            results[setting, kind] = g
            seen[f"{setting}/{kind}"] = {
                "grad_numel": g.numel(),
                "norm": float(g.norm()),
                "microbatches": len(mb.batch_peaks),
                "skip": mb.skip,
            }
        with engine.train_mode():  # then three optimizer steps (AdamW) on the same mini-batches
            before = lora(engine)
            for kind in KEPT:
                engine.train_batch(batch(kind, rank, seed, vocab), loss_fn)
            results[setting, "weights"] = lora(engine)
        seen[f"{setting}/moved"] = float((results[setting, "weights"] - before).norm() / before.norm())
    for kind in (*KEPT, "weights"):
        on, off = results["on", kind], results["off", kind]
        seen[kind] = {
            "rel": float((on - off).norm() / off.norm()) if off.norm() > 0 else float(on.norm()),
            "equal": bool(torch.equal(on, off)),
        }
    return seen
