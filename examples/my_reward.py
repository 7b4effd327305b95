"""A reward of your own for the training job (``--reward.path examples/my_reward.py``).

Two conventions, told apart by the parameter names (docs/training-job.md, "Your own data and
reward"): verl's per-response ``compute_score`` (the default name) and OpenRLHF's batched
``reward_func`` (``--reward.name reward_func``). Both give 1 for the label's number, a share of
vowels for the word task, 0 otherwise."""

import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if isinstance(extra_info, dict) and extra_info.get("kind") == "words":
        letters = [c for c in solution_str.lower() if c.isalpha()]
        return sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0
    numbers = re.findall(r"-?\d+", solution_str)
    return float(bool(numbers) and numbers[-1] == str(ground_truth))


def reward_func(queries, prompts, labels):
    """OpenRLHF's convention: ``queries`` are prompt + response as the policy saw them."""
    responses = [q[len(p) :] for q, p in zip(queries, prompts)]
    return [float(str(label) in r) for r, label in zip(responses, labels)]
