"""Learner microbatches from real text: the benchmark's real-model workload (``cpu-real``) and
the risk diagnostics on SmolLM2 (``python -m benchmarks.diagnostics --model smollm2``).

Random token ids on a real model give activations that real text never produces, so the
error of L measured on them means little. Here the inputs are what a GRPO learner sees:

1. prompts from a reasoning-gym task, ``group_size`` responses each sampled from the model
   itself (seeded per group, so the pool can grow deterministically), scored by the task's
   verifier; generated once and cached next to the model cache (``$HILORE_CACHE/bench``);
2. group advantages (``grpo.advantages``), sequences packed back to back into rows of
   exactly ``tokens`` tokens (a row's last sequence is cut at the row's end);
3. old log-probs from the policy *before* one real AdamW step on the first row's GRPO loss,
   reference log-probs from the model with its adapters off, so the ratio and the clipping
   in the measured updates are real.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, List, Tuple

import torch

from hilore_actor.grpo.advantages import group_advantages
from hilore_actor.grpo.microbatch import Microbatch, microbatch_loss
from hilore_actor.models.logprobs import sequence_log_probs

TASK = "rg:basic_arithmetic"
TASK_OPTIONS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "operators": ["+", "-"]}
INSTRUCTION = " Think step by step, then put only the final answer inside <answer></answer>."


def _cache_file(seed: int, max_new_tokens: int, group_size: int) -> Path:
    """One file per (seed, length limit, group size); the benchmark's groups of 8 keep the
    name they were cached under."""
    from hilore_actor.models.smollm2 import cache_root

    g = "" if group_size == 8 else f"-g{group_size}"
    return cache_root() / "bench" / f"cpu-real-rollouts-seed{seed}-new{max_new_tokens}{g}.json"


def rollout_pool(
    model, tokenizer, n_tokens: int, group_size: int, seed: int, max_new_tokens: int = 160, log=print
) -> List[Dict]:
    """Groups ``{"prompt_len", "sequences", "rewards"}`` holding at least ``n_tokens`` tokens,
    read from the cache and extended (then rewritten atomically) when it holds too few."""
    from hilore_actor.data.tasks import load_task
    from hilore_actor.rollout.hf_generate import generate_groups

    path = _cache_file(seed, max_new_tokens, group_size)
    groups = json.loads(path.read_text()) if path.is_file() else []
    if any(len(g["sequences"]) != group_size for g in groups):
        raise ValueError(f"{path} holds groups of another size than {group_size}; delete it to regenerate")
    have = sum(len(s) for g in groups for s in g["sequences"])
    if have >= n_tokens:
        return groups
    task = load_task(TASK, size=512, seed=seed, options=TASK_OPTIONS, instruction=INSTRUCTION)
    while have < n_tokens:
        i = len(groups)
        ex = task.examples[i % len(task)]
        ro = generate_groups(
            model, tokenizer, [ex.prompt], group_size, max_new_tokens=max_new_tokens, seed=seed * 10007 + i
        )
        seqs = [ro.sequences[j, : ro.prompt_lens[j] + ro.response_lens[j]].tolist() for j in range(group_size)]
        rewards = [task.score(t, ex) for t in ro.texts]
        groups.append({"prompt_len": ro.prompt_lens[0], "sequences": seqs, "rewards": rewards})
        have += sum(len(s) for s in seqs)
        log(f"[rollouts] real rollouts: group {i + 1}, {have}/{n_tokens} tokens, rewards {rewards}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(groups))
    tmp.replace(path)
    return groups


def pack_rows(groups: List[Dict], sizes: List[int], group_size: int) -> List[Dict[str, torch.Tensor]]:
    """Rows of exactly ``sizes[i]`` tokens from the groups' sequences, in order."""
    seqs: List[Tuple[List[int], int, float]] = []
    for g in groups:
        adv = group_advantages(torch.tensor(g["rewards"]), group_size)
        seqs += [(s, g["prompt_len"], float(a)) for s, a in zip(g["sequences"], adv)]
    rows, k = [], 0
    for size in sizes:
        ids, pos, mask, advs = [], [], [], []
        while len(ids) < size:
            if k >= len(seqs):
                raise ValueError(f"the rollout pool ran out after {len(rows)} rows; generate more tokens")
            s, p, a = seqs[k]
            k += 1
            n = min(len(s), size - len(ids))  # a row's last sequence is cut at the row's end
            m = [0.0] * n
            for t in range(p - 1, n - 1):  # position t predicts token t + 1 (grpo.microbatch)
                m[t] = 1.0
            ids += s[:n]
            pos += list(range(n))
            mask += m
            advs += [a] * n
        rows.append(
            {
                "input_ids": torch.tensor([ids]),
                "position_ids": torch.tensor([pos]),
                "action_mask": torch.tensor([mask[:-1]]),
                "advantages": torch.tensor([advs[:-1]]),
            }
        )
    return rows


def real_microbatches(
    model,
    tokenizer,
    sizes: List[int],
    group_size: int,
    seed: int,
    loss_options: Dict,
    step_lr: float = 1e-3,
    n_described: int | None = None,
    log=print,
) -> Tuple[List[Microbatch], Dict]:
    """Microbatches of ``sizes`` tokens (see module docstring) and their provenance. The
    model's trainable parameters end one AdamW step away from the old policy.

    The provenance statistics describe the first ``n_described`` rows (default: all): the
    measured and development rows, which come first. Runs that build different numbers of
    calibration rows after them then describe the same inputs, so their pieces can merge;
    ``groups`` and ``mean_reward`` describe the whole pool, whose size depends on those
    calibration rows, so the merge leaves them out (``bench.merge.POOL_KEYS``)."""
    pool = rollout_pool(model, tokenizer, int(sum(sizes) * 1.1), group_size, seed, log=log)
    rows = pack_rows(pool, sizes, group_size)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    mbs = []
    with torch.no_grad():
        for r in rows:
            ids, pos = r["input_ids"].to(device), r["position_ids"].to(device)
            old = sequence_log_probs(model, ids, position_ids=pos).float()
            with model.disable_adapter():
                ref = sequence_log_probs(model, ids, position_ids=pos).float()
            mbs.append(
                Microbatch(
                    ids,
                    pos,
                    old,
                    ref,
                    r["advantages"].to(device),
                    r["action_mask"].to(device),
                    loss_options=dict(loss_options),
                )
            )
    model.train(was_training)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=step_lr)
    microbatch_loss(model, mbs[0]).loss.backward()
    opt.step()
    for p in params:
        p.grad = None
    described = mbs[: n_described or len(mbs)]
    with torch.no_grad():
        out = microbatch_loss(model, described[-1])
    rewards = [x for g in pool for x in g["rewards"]]
    share = sum(float(m.action_mask.sum()) for m in described) / sum(m.action_mask.numel() for m in described)
    prov = {
        "task": TASK,
        "task_options": TASK_OPTIONS,
        "groups": len(pool),
        "mean_reward": sum(rewards) / len(rewards),
        "old_policy": f"one AdamW step (lr {step_lr}) before the measured updates",
        "response_token_share": float(share),
        "clip_frac_last_row": float(out.stats["clip_fraction"]),
    }
    return mbs, prov
