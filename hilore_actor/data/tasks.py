"""Prompt/answer tasks with verifiable rewards: reasoning-gym generators and JSONL files.

A ``Task`` is a list of ``Example`` s plus a scorer ``score(response, example) -> float``.
Spec strings select one: ``rg:basic_arithmetic`` (any reasoning-gym dataset name, seeded and
offline) or a path to a ``.jsonl`` file with one ``{"prompt": ..., "answer": ...}`` per line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from .rewards import extract_answer, math_verify_reward


class DatasetError(ValueError):
    """Bad task input; the message names the file and line."""


@dataclass
class Example:
    prompt: Union[str, List[Dict[str, str]]]  # a string, or chat messages for the tokenizer's template
    answer: str
    metadata: Dict[str, Any] = field(default_factory=dict)


@dataclass
class Task:
    name: str
    examples: List[Example]
    scorer: Callable[[str, Example], float]

    def score(self, response: str, example: Example) -> float:
        return float(self.scorer(response, example))

    def score_all(
        self,
        responses: Sequence[str],
        examples: Sequence[Example],
        prompts: Optional[Sequence[str]] = None,
        queries: Optional[Sequence[str]] = None,
    ) -> List[float]:
        """One reward per response. ``prompts`` (the rendered prompt texts) and ``queries``
        (prompt + response, as the policy saw them) are for a user's batched reward function
        (``data/reward_function.py``); built-in scorers read the response and the example."""
        batch = getattr(self.scorer, "score_all", None)
        if batch is not None:
            return batch(responses, examples, prompts, queries)
        return [self.score(r, e) for r, e in zip(responses, examples)]

    def __len__(self) -> int:
        return len(self.examples)


ANSWER_FORMAT = " Put only the final answer inside <answer></answer>."


def reasoning_gym_task(name: str, size: int = 256, seed: int = 0, instruction: str = ANSWER_FORMAT, **kwargs) -> Task:
    """A reasoning-gym procedural dataset, scored by the dataset's own ``score_answer``."""
    import reasoning_gym

    try:
        dataset = reasoning_gym.create_dataset(name, size=size, seed=seed, **kwargs)
    except Exception as e:  # reasoning-gym raises various types for unknown names / bad options
        raise DatasetError(f"reasoning-gym dataset {name!r} with options {kwargs}: {e}") from None
    examples, entries = [], []
    for entry in dataset:
        examples.append(
            Example(
                prompt=entry["question"] + instruction,
                answer=str(entry["answer"]),
                metadata={
                    "index": len(entries),
                    "source": f"rg:{name}[{len(entries)}]",
                    "dataset": f"rg:{name}",
                    "row": entry,
                },
            )
        )
        entries.append(entry)

    def score(response: str, ex: Example) -> float:
        """The dataset's own verifier; for math-like answers math-verify may also accept it."""
        extracted = extract_answer(response)
        if extracted is None:
            return 0.0
        own = float(dataset.score_answer(extracted, entries[ex.metadata["index"]]))
        return own if own == 1.0 else max(own, math_verify_reward(response, ex.answer))

    return Task(name=f"rg:{name}", examples=examples, scorer=score)


def _prompt(value, where: str, instruction: str):
    """A JSONL prompt: a non-empty string, or a list of chat messages (``{"role", "content"}``,
    OpenRLHF's and verl's convention) rendered later by the tokenizer's chat template. The
    instruction goes at the end of the string, or of the last user message."""
    if isinstance(value, str):
        if not value.strip():
            raise DatasetError(f"{where}: the prompt is empty")
        return value + instruction
    if (
        isinstance(value, list)
        and value
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
        )
    ):
        users = [i for i, m in enumerate(value) if m["role"] == "user"]
        if not users or not any(m["content"].strip() for m in value):
            raise DatasetError(f"{where}: the chat messages hold no user message with text")
        messages = [dict(m) for m in value]
        messages[users[-1]]["content"] += instruction
        return messages
    raise DatasetError(
        f'{where}: the prompt must be a string or a list of {{"role", "content"}} messages, got {type(value).__name__}'
    )


def jsonl_task(path, prompt_key: str = "prompt", answer_key: str = "answer", instruction: str = "") -> Task:
    """Examples from a JSONL file (prompt in ``prompt_key``, reference answer in ``answer_key``),
    scored with math-verify against the answer. Each example keeps its whole row in
    ``metadata["row"]`` (a user's reward function gets it as ``extra_info``)."""
    p = Path(path)
    if not p.is_file():
        raise DatasetError(f"{p}: dataset file not found")
    examples = []
    with p.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{p}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DatasetError(f"{where}: not valid UTF-8 (byte {e.start + 1} of the line)") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{where}: expected a JSON object, got {type(row).__name__}")
            missing = [k for k in (prompt_key, answer_key) if k not in row]
            if missing:
                raise DatasetError(
                    f"{where}: missing field(s) {missing}; found {sorted(row)} (choose the fields "
                    "with --data.input_key and --data.label_key)"
                )
            if row[answer_key] is None:
                raise DatasetError(f"{where}: the answer field {answer_key!r} is null")
            prompt = _prompt(row[prompt_key], where, instruction)
            examples.append(
                Example(
                    prompt=prompt,
                    answer=str(row[answer_key]),
                    metadata={"line": lineno, "source": where, "dataset": str(p), "row": row, "label": row[answer_key]},
                )
            )
    if not examples:
        raise DatasetError(f"{p}: empty dataset (no JSON lines)")
    return Task(name=str(p), examples=examples, scorer=lambda response, ex: math_verify_reward(response, ex.answer))


def vowels_task(size: int = 256, seed: int = 0) -> Task:
    """``toy:vowels``: reward = the share of vowels among the response's letters. A shaping
    task for tests and the ``tiny`` preset: a random model's outputs already get graded
    rewards, so groups have reward variance and the learner sees non-zero advantages."""
    import random

    rng = random.Random(seed)
    examples = [Example(prompt=f"Write words with many vowels. {rng.randrange(10**6)}", answer="") for _ in range(size)]

    def score(response: str, ex: Example) -> float:
        letters = [c for c in response.lower() if c.isalpha() and c.isascii()]
        return sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0

    return Task(name="toy:vowels", examples=examples, scorer=score)


def load_task(
    spec: str,
    size: int = 256,
    seed: int = 0,
    options: Optional[Dict[str, Any]] = None,
    instruction: Optional[str] = None,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
) -> Task:
    """``rg:<name>`` for reasoning-gym, else a JSONL path (its fields ``prompt_key`` and
    ``answer_key``). ``instruction`` is appended to every prompt (default: ask for an
    ``<answer>`` tag on reasoning-gym, nothing on JSONL)."""
    if spec.startswith("rg:"):
        instr = ANSWER_FORMAT if instruction is None else instruction
        return reasoning_gym_task(spec[3:], size=size, seed=seed, instruction=instr, **(options or {}))
    if spec == "toy:vowels":
        return vowels_task(size=size, seed=seed)
    if spec.endswith(".jsonl") or Path(spec).exists():
        return jsonl_task(spec, prompt_key, answer_key, instruction=instruction or "")
    raise DatasetError(
        f"unknown task {spec!r}: use rg:<reasoning-gym name> (e.g. rg:basic_arithmetic), toy:vowels or a .jsonl path"
    )
