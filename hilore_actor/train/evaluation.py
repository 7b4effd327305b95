"""Held-out evaluation during training (``--eval.dataset``, ``--eval.steps``, ``--eval.max_samples``).

The held-out file is read as the training data is (``train_grpo.load_prompts``: the same
instruction and chat template, the same reward, ``--reward.*`` included; its fields
``--eval.input_key``/``--eval.label_key``, by default the training ones), so
``eval/reward_mean`` is on the training reward's scale. Responses are greedy (temperature 0,
one per prompt) from the rollout workers with the weights of the step just trained: a fixed
policy's score, not a sample of it, so curves from step to step differ by the training only.
``eval/accuracy`` is the share of prompts whose reward is exactly 1 (a verifier's "correct").
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List, Tuple

from .metrics import pick_samples


def load_eval_task(cfg, load_prompts: Callable):
    """The held-out task (its first ``--eval.max_samples`` prompts) through the training data's
    loader, so a missing or malformed file fails before Ray starts; None without ``--eval.dataset``."""
    if not cfg.eval.dataset:
        return None
    keys = (cfg.eval.input_key or cfg.data.input_key, cfg.eval.label_key or cfg.data.label_key)
    task = load_prompts(cfg, cfg.eval.dataset, keys)
    task.examples = task.examples[: cfg.eval.max_samples]
    return task


def due(cfg, step: int) -> bool:
    """Whether to evaluate after (1-based) ``step``: every ``--eval.steps`` steps and after the last."""
    return step == cfg.max_steps or (cfg.eval.steps > 0 and step % cfg.eval.steps == 0)


def evaluate(job, task, cfg, step: int, rewards_of: Callable) -> Tuple[Dict, List[Dict]]:
    """Greedy responses to the held-out prompts, in batches of a training step's rollouts (the
    rollout workers' memory is sized for those), scored by ``rewards_of(out, examples)``.
    Returns the ``eval_*`` metrics and ``--logger.samples_per_step`` of the generations."""
    t = time.perf_counter()
    batch = cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt
    examples = task.examples
    texts, lengths, rewards = [], [], []
    for i in range(0, len(examples), batch):
        chunk = examples[i : i + batch]
        out = job.generate([e.prompt for e in chunk], step, greedy=True)
        rewards += [float(r) for r in rewards_of(out, chunk)]
        texts += out["texts"]
        lengths += [s[2] for s in out["seqs"]]
    m = {
        "eval_accuracy": sum(r == 1 for r in rewards) / len(rewards),
        "eval_reward_mean": statistics.fmean(rewards),
        "eval_response_length": statistics.fmean(lengths),
        "eval_prompts": len(rewards),
        "eval_seconds": time.perf_counter() - t,
    }
    return m, pick_samples(examples, texts, rewards, 1, cfg.logger.samples_per_step, split="eval")
