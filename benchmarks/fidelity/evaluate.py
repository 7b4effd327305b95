"""Held-out evaluation of a study's final policies: greedy accuracy, and the KL between paired
policies.

Held-out problems come from the task with a seed no run trains with, minus every problem any
run's training task holds (the job draws its prompts from ``load_task(size=max_samples,
seed=train seed)``), so none was seen in training. A policy is the base model (the spec and
seed its run loaded it with) with the run's final LoRA adapter merged in.

KL(p || q) between two final policies is measured where p samples: on p's greedy responses to
the held-out prompts, the full-vocabulary KL of the next-token distributions, averaged over
response tokens. Two runs that trained identically give exactly 0. The study takes p = an
arm's policy (or the base model) and q = gc's of the same seed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

HELDOUT_SEED = 1_000_003  # no run trains with it


def heldout_examples(
    n: int, train_seeds: Sequence[int], train_size: int, task_spec: str, options: Dict, instruction: Optional[str]
) -> Tuple[List, object]:
    """``n`` problems of the task that no run's training task holds, and the task they come
    from (its ``score`` verifies their answers)."""
    from hilore_actor.data import load_task

    seen = set()
    for s in train_seeds:
        seen.update(
            e.prompt
            for e in load_task(task_spec, size=train_size, seed=s, options=options, instruction=instruction).examples
        )
    pool = load_task(task_spec, size=4 * n + len(seen), seed=HELDOUT_SEED, options=options, instruction=instruction)
    fresh, picked = set(), []
    for e in pool.examples:
        if e.prompt not in seen and e.prompt not in fresh:
            fresh.add(e.prompt)
            picked.append(e)
        if len(picked) == n:
            return picked, pool
    raise ValueError(
        f"the task has fewer than {n} held-out problems outside the {len(seen)} training ones (a dataset file "
        "gives every seed the same problems: the study needs a generated task, e.g. rg:<name>)"
    )


def load_final_policy(model_spec: str, seed: int, final_dir: Optional[Path]):
    """The base model the run loaded (same spec and seed) with its final adapter merged; the
    base model alone when ``final_dir`` is None."""
    import peft

    from hilore_actor.models.source import load_policy

    model, tok = load_policy(model_spec, dtype=torch.float32, lora=None, seed=seed)
    if final_dir is not None:
        model = peft.PeftModel.from_pretrained(model, str(final_dir)).merge_and_unload()
    return model.eval(), tok


def exact_share(scores: Sequence[float]) -> float:
    """Accuracy: the share of problems the verifier scores 1 (it gives wrong numbers small
    partial credit, which a mean score would count)."""
    return sum(s >= 1.0 for s in scores) / len(scores)


def greedy_accuracy(
    model, tok, pool, examples, max_new_tokens: int, batch: int = 64, chat_template: bool = True, log=print
) -> Dict:
    """Greedy responses to ``examples``, scored by the task's verifier (``pool.score``), the
    prompts rendered as the job renders them (``--data.apply_chat_template``)."""
    from hilore_actor.rollout.hf_generate import generate_groups

    scores, texts, seqs, prompt_lens = [], [], [], []
    for i in range(0, len(examples), batch):
        chunk = examples[i : i + batch]
        prompts = [e.prompt for e in chunk]
        r = generate_groups(
            model, tok, prompts, 1, max_new_tokens, batched=True, greedy=True, chat_template=chat_template
        )
        for j, (t, e) in enumerate(zip(r.texts, chunk)):
            scores.append(pool.score(t, e))
            texts.append(t)
            n = r.prompt_lens[j] + r.response_lens[j]
            seqs.append(r.sequences[j, :n].tolist())
            prompt_lens.append(r.prompt_lens[j])
        log(f"[fidelity]   {len(scores)}/{len(examples)} held-out problems, accuracy so far {exact_share(scores):.3f}")
    return {
        "accuracy": exact_share(scores),
        "mean_score": sum(scores) / len(scores),
        "n": len(scores),
        "scores": scores,
        "texts": texts,
        "sequences": seqs,
        "prompt_lens": prompt_lens,
    }


@torch.no_grad()
def response_kl(
    p_model, q_model, sequences: List[List[int]], prompt_lens: List[int], pad: int, batch: int = 16
) -> Dict:
    """Mean and per-sequence KL(p || q) over the response tokens of ``sequences`` (p's own)."""
    per_seq: List[float] = []
    total, count = 0.0, 0
    for i in range(0, len(sequences), batch):
        rows, plens = sequences[i : i + batch], prompt_lens[i : i + batch]
        width = max(len(s) for s in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for k, s in enumerate(rows):
            ids[k, : len(s)] = torch.tensor(s)
            mask[k, : len(s)] = 1
        lp = torch.log_softmax(p_model(input_ids=ids, attention_mask=mask).logits.float(), -1)
        lq = torch.log_softmax(q_model(input_ids=ids, attention_mask=mask).logits.float(), -1)
        kl = (lp.exp() * (lp - lq)).sum(-1)  # [B, L]: KL of the distribution predicting token t + 1
        for k, s in enumerate(rows):
            part = kl[k, plens[k] - 1 : len(s) - 1]  # the positions that predict the response tokens
            per_seq.append(float(part.mean()) if part.numel() else 0.0)
            total += float(part.double().sum())
            count += part.numel()
    return {"kl_mean_per_token": total / max(count, 1), "per_sequence": per_seq, "tokens": count}


def save(path: Path, data: Dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)
