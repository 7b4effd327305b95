"""HF group sampling: one batched, left-padded call decodes each prompt as the model does on
that prompt alone (padding changes nothing but the batch shape), in group-contiguous order;
sampling is reproducible from its seed."""

import torch

from hilore_actor.models.source import load_policy
from hilore_actor.rollout.hf_generate import generate_groups

PROMPTS = ["Say a vowel.", "What is 2 + 3? Answer with the number only, please.", "Hi"]  # different lengths


def test_batched_greedy_is_greedy_for_each_unpadded_prompt():
    """Every token a batched, left-padded greedy call picks is (to float rounding) the argmax
    of the same model run on that row alone, without padding."""
    seed = torch.seed() % 2**31
    print("seed", seed)
    model, tok = load_policy("tiny:qwen2", seed=seed)
    r = generate_groups(model, tok, PROMPTS, 2, max_new_tokens=8, greedy=True, batched=True)
    assert r.prompt_lens[0] == r.prompt_lens[1] != r.prompt_lens[2]  # group-contiguous, prompts differ
    with torch.no_grad():
        for i, (p, n) in enumerate(zip(r.prompt_lens, r.response_lens)):
            row = r.sequences[i, : p + n][None]
            logits = model(input_ids=row).logits[0, p - 1 : p + n - 1]
            picked = logits.gather(1, row[0, p:][:, None])[:, 0]
            assert torch.all(picked >= logits.max(dim=1).values - 1e-4), i
    one = generate_groups(model, tok, PROMPTS, 2, max_new_tokens=8, greedy=True)
    assert one.prompt_lens == r.prompt_lens


def test_batched_sampling_is_reproducible_from_its_seed():
    model, tok = load_policy("tiny:llama", seed=torch.seed() % 2**31)
    a = generate_groups(model, tok, PROMPTS, 4, max_new_tokens=12, seed=7, batched=True)
    b = generate_groups(model, tok, PROMPTS, 4, max_new_tokens=12, seed=7, batched=True)
    c = generate_groups(model, tok, PROMPTS, 4, max_new_tokens=12, seed=8, batched=True)
    assert torch.equal(a.sequences, b.sequences) and a.texts == b.texts
    assert not torch.equal(a.sequences, c.sequences)
    assert len(a.texts) == 12 and a.sequences.shape[0] == 12
