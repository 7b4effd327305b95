"""Group sampling with HF ``generate``: G responses per prompt, chat template applied."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Union

import torch


@dataclass
class Rollout:
    """Sampled sequences, right-padded: ``sequences[i] = prompt_i + response_i + pad``."""

    sequences: torch.Tensor  # [B, L] token ids
    prompt_lens: List[int]
    response_lens: List[int]
    texts: List[str]  # decoded responses
    group_size: int


def apply_chat(tokenizer, prompt: Union[str, List[Dict[str, str]]], template: bool = True) -> List[int]:
    """A prompt's token ids: a string as one user message, or a list of chat messages, through
    the tokenizer's chat template (``--data.apply_chat_template``; a tokenizer without one
    takes the string as it is); ``template=False``: the string's own tokens."""
    if isinstance(prompt, list):
        return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]
    if template and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
    return tokenizer(prompt)["input_ids"]


@torch.no_grad()
def generate_groups(
    model,
    tokenizer,
    prompts: Sequence[str],
    group_size: int,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    seed: int = 0,
    top_p: float = 1.0,
    batched: bool = False,
    greedy: bool = False,
    chat_template: bool = True,
    progress: Optional[Callable[[int, int], None]] = None,
) -> Rollout:
    """Sample ``group_size`` responses for every prompt (group-contiguous order).

    ``batched``: one ``generate`` call for all prompts, left-padded (with their attention
    mask, so padding changes nothing but the batch shape): the same distribution as one call
    per prompt, several times faster on a CPU. Off, one call per prompt: the sampler the
    committed ``cpu-real`` benchmark inputs were made with, kept so they stay reproducible.
    ``greedy``: argmax decoding (held-out evaluation; tests), one response per prompt per group slot.
    ``progress(tokens, max_new_tokens)``: told as decoding goes (at most twice a second; it samples nothing)."""
    torch.manual_seed(seed)
    was_training = model.training
    model.eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    sampling = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=temperature, top_p=top_p)
    device = next(model.parameters()).device
    chats = [apply_chat(tokenizer, p, chat_template) for p in prompts]
    batches = [chats] if batched else [[c] for c in chats]
    seqs, prompt_lens, resp_lens, texts = [], [], [], []
    for batch in batches:
        # greedy decoding takes one sequence per input row (generate refuses num_return_sequences > 1 there)
        rows = [c for c in batch for _ in range(group_size)] if greedy else batch
        width = max(len(c) for c in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, c in enumerate(rows):  # left padding: every prompt ends where generation starts
            ids[i, width - len(c) :] = torch.tensor(c)
            mask[i, width - len(c) :] = 1
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new_tokens,
            num_return_sequences=1 if greedy else group_size,
            pad_token_id=pad,
            stopping_criteria=_told(progress, width, max_new_tokens) if progress else None,
            **sampling,
        ).cpu()
        for j, row in enumerate(out):  # rows are group-contiguous: prompt j // group_size
            prompt = torch.tensor(batch[j // group_size])
            resp = row[width:]
            eos = (resp == tokenizer.eos_token_id).nonzero()
            n = int(eos[0]) + 1 if len(eos) else int((resp != pad).sum())  # keep the EOS token
            seqs.append(torch.cat([prompt, resp[:n]]))
            prompt_lens.append(len(prompt))
            resp_lens.append(n)
            texts.append(tokenizer.decode(resp[:n], skip_special_tokens=True))
    model.train(was_training)
    L = max(len(s) for s in seqs)
    padded = torch.full((len(seqs), L), pad, dtype=torch.long)
    for i, s in enumerate(seqs):
        padded[i, : len(s)] = s
    return Rollout(padded, prompt_lens, resp_lens, texts, group_size)


def _told(progress: Callable[[int, int], None], width: int, max_new_tokens: int):
    """A stopping criterion that stops nothing: it tells ``progress`` how many tokens are decoded."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Told(StoppingCriteria):
        last = 0.0

        def __call__(self, input_ids, scores, **kwargs):
            now = time.perf_counter()
            if now - self.last >= 0.5:
                self.last = now
                progress(input_ids.shape[1] - width, max_new_tokens)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([Told()])
