"""Group sampling with HF ``generate``: G responses per prompt, chat template applied."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import torch


@dataclass
class Rollout:
    """Sampled sequences, right-padded: ``sequences[i] = prompt_i + response_i + pad``."""

    sequences: torch.Tensor  # [B, L] token ids
    prompt_lens: List[int]
    response_lens: List[int]
    texts: List[str]  # decoded responses
    group_size: int


def apply_chat(tokenizer, prompt: str) -> List[int]:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    return tokenizer(prompt)["input_ids"]


@torch.no_grad()
def generate_groups(
    model, tokenizer, prompts: Sequence[str], group_size: int, max_new_tokens: int = 64, temperature: float = 1.0, seed: int = 0,
    top_p: float = 1.0,
) -> Rollout:
    """Sample ``group_size`` responses for every prompt (group-contiguous order)."""
    torch.manual_seed(seed)
    was_training = model.training
    model.eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    seqs, prompt_lens, resp_lens, texts = [], [], [], []
    for prompt in prompts:
        ids = torch.tensor([apply_chat(tokenizer, prompt)])
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=temperature, top_p=top_p,
            max_new_tokens=max_new_tokens, num_return_sequences=group_size, pad_token_id=pad,
        )
        for row in out:
            resp = row[ids.shape[1]:]
            eos = (resp == tokenizer.eos_token_id).nonzero()
            n = int(eos[0]) + 1 if len(eos) else int((resp != pad).sum())  # keep the EOS token
            seqs.append(row[: ids.shape[1] + n])
            prompt_lens.append(ids.shape[1])
            resp_lens.append(n)
            texts.append(tokenizer.decode(resp[:n], skip_special_tokens=True))
    model.train(was_training)
    L = max(len(s) for s in seqs)
    padded = torch.full((len(seqs), L), pad, dtype=torch.long)
    for i, s in enumerate(seqs):
        padded[i, : len(s)] = s
    return Rollout(padded, prompt_lens, resp_lens, texts, group_size)
