"""A verifiable math reward for OpenRLHF recipes (``--reward.remote_url examples/openrlhf_math_reward.py``):
OpenRLHF calls ``reward_func(queries, prompts, labels)`` with decoded prompt+response texts.
The score is math-verify's equivalence of the response's final answer with the label."""
import torch

from hilore_actor.data.rewards import math_verify_reward


def reward_func(queries, prompts, labels):
    scores = []
    for query, prompt, label in zip(queries, prompts, labels):
        response = query[len(prompt):] if query.startswith(prompt) else query
        scores.append(float(math_verify_reward(response, str(label))))
    scores = torch.tensor(scores, dtype=torch.float32)
    return {"rewards": scores, "scores": scores, "extra_logs": {"accuracy": scores}}
