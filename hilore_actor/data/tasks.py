"""Prompt/answer tasks with verifiable rewards: reasoning-gym generators and JSONL files.

A ``Task`` is a list of ``Example`` s plus a scorer ``score(response, example) -> float``.
Spec strings select one: ``rg:basic_arithmetic`` (any reasoning-gym dataset name, seeded and
offline) or a user's file as OpenRLHF and verl users have it: JSON lines or a JSON array
(``{"prompt": ..., "answer": ...}`` per row) or verl's parquet (a chat-list ``prompt``,
``reward_model.ground_truth``, ``data_source``, ``extra_info``), its fields named by key or dotted path.
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


FILE_TYPES = (".jsonl", ".json", ".parquet")  # a user's dataset file: OpenRLHF's JSON(L), verl's parquet
MISSING = object()  # a field a row does not have


def field_value(row: Dict[str, Any], key: str):
    """``row[key]``, or the dotted path ``key`` through nested objects (verl's
    ``reward_model.ground_truth``); ``MISSING`` where neither exists. A key holding a dot is
    read as it is first, so a flat column named ``a.b`` still wins."""
    if key in row:
        return row[key]
    node: Any = row
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return MISSING
        node = node[part]
    return node


def field_paths(row: Dict[str, Any], prefix: str = "", depth: int = 2) -> List[str]:
    """The keys a ``--data.*_key`` can name in ``row``: top-level keys and dotted paths into
    nested objects (two levels), for the missing-field message."""
    out = []
    for k, v in row.items():
        out.append(prefix + k)
        if isinstance(v, dict) and depth > 1:
            out += field_paths(v, f"{prefix}{k}.", depth - 1)
    return out


def _json_rows(p: Path):
    """(where, row) per line of a JSONL file, or per element of a ``.json`` file holding one
    array of objects (a ``.json`` file of one object per line is read as JSONL, as HF datasets does)."""
    data = p.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        start = data.rfind(b"\n", 0, e.start) + 1
        raise DatasetError(f"{p}:{line}: not valid UTF-8 (byte {e.start - start + 1} of the line)") from None
    if p.suffix == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{p}:{e.lineno}: malformed JSON ({e.msg} at column {e.colno})") from None
        for i, row in enumerate(rows):
            yield f"{p}[{i}]", row
        return
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{p}:{lineno}: malformed JSON ({e.msg} at column {e.colno})") from None
        yield f"{p}:{lineno}", row


def _parquet_rows(p: Path):
    """(where, row) per row of a parquet file (verl's data files), nested columns as dicts and lists."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(f"{p}: reading parquet needs pyarrow (pip install pyarrow)") from None
    try:
        table = pq.read_table(p)
    except Exception as e:  # pyarrow's ArrowInvalid and OSError on a file that is not parquet
        raise DatasetError(f"{p}: not a readable parquet file ({type(e).__name__}: {e})") from None
    for i, row in enumerate(table.to_pylist()):
        yield f"{p}[row {i}]", row


def file_task(path, prompt_key: str = "prompt", answer_key: str = "answer", instruction: str = "") -> Task:
    """Examples from a user's file (``FILE_TYPES``: JSON lines, a JSON array, parquet), the prompt
    in ``prompt_key`` and the reference answer in ``answer_key`` (each a field or a dotted path),
    scored with math-verify against the answer. Each example keeps its whole row in
    ``metadata["row"]`` (a user's reward function gets its ``data_source`` and ``extra_info``)."""
    p = Path(path)
    if not p.is_file():
        raise DatasetError(f"{p}: dataset file not found")
    if p.suffix not in FILE_TYPES:
        raise DatasetError(
            f"{p}: unsupported file type {p.suffix or '(none)'!r}; a dataset file is {', '.join(FILE_TYPES)}"
        )
    examples = []
    for where, row in _parquet_rows(p) if p.suffix == ".parquet" else _json_rows(p):
        if not isinstance(row, dict):
            raise DatasetError(f"{where}: expected a JSON object, got {type(row).__name__}")
        values = {k: field_value(row, k) for k in (prompt_key, answer_key)}
        missing = [k for k, v in values.items() if v is MISSING]
        if missing:
            raise DatasetError(
                f"{where}: missing field(s) {missing}; found {field_paths(row)} (choose the fields "
                "with --data.input_key and --data.label_key; a dotted path reads a nested one)"
            )
        if values[answer_key] is None:
            raise DatasetError(f"{where}: the answer field {answer_key!r} is null")
        prompt = _prompt(values[prompt_key], where, instruction)
        examples.append(
            Example(
                prompt=prompt,
                answer=str(values[answer_key]),
                metadata={"source": where, "dataset": str(p), "row": row, "label": values[answer_key]},
            )
        )
    if not examples:
        raise DatasetError(f"{p}: empty dataset (no rows)")
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
    """``rg:<name>`` for reasoning-gym, ``toy:vowels``, else a dataset file (``file_task``: its
    fields ``prompt_key`` and ``answer_key``). ``instruction`` is appended to every prompt
    (default: ask for an ``<answer>`` tag on reasoning-gym, nothing on a file)."""
    if spec.startswith("rg:"):
        instr = ANSWER_FORMAT if instruction is None else instruction
        return reasoning_gym_task(spec[3:], size=size, seed=seed, instruction=instr, **(options or {}))
    if spec == "toy:vowels":
        return vowels_task(size=size, seed=seed)
    if Path(spec).suffix in FILE_TYPES or Path(spec).exists():
        return file_task(spec, prompt_key, answer_key, instruction=instruction or "")
    raise DatasetError(
        f"unknown task {spec!r}: use rg:<reasoning-gym name> (e.g. rg:basic_arithmetic), toy:vowels or a "
        f"dataset file ({', '.join(FILE_TYPES)})"
    )
