"""Tasks and rewards: reasoning-gym, JSONL, math-verify, clear errors on bad files."""

import json

import pytest

from hilore_actor.data import DatasetError, extract_answer, jsonl_task, load_task, math_verify_reward


def test_reasoning_gym_arithmetic_is_seeded_and_scored():
    a = load_task("rg:basic_arithmetic", size=8, seed=3)
    b = load_task("rg:basic_arithmetic", size=8, seed=3)
    assert [e.prompt for e in a.examples] == [e.prompt for e in b.examples]
    ex = a.examples[0]
    assert a.score(f"thinking...\n<answer>{ex.answer}</answer>", ex) == 1.0
    assert a.score("<answer>not a number</answer>", ex) == 0.0
    assert a.score("", ex) == 0.0


def test_knights_and_knaves():
    task = load_task("rg:knights_knaves", size=2, seed=0)
    ex = task.examples[0]
    assert task.score(f"<answer>{ex.answer}</answer>", ex) == 1.0


def test_unknown_reasoning_gym_name():
    with pytest.raises(DatasetError, match="no_such_task"):
        load_task("rg:no_such_task")


def test_jsonl_roundtrip_and_math_verify(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps({"prompt": f"{i}+1=?", "answer": str(i + 1)}) for i in range(3)) + "\n\n")
    task = jsonl_task(p)
    assert len(task) == 3
    assert task.score("The answer is \\boxed{2}", task.examples[1]) == 1.0
    assert task.score("<answer>3</answer>", task.examples[1]) == 0.0
    assert math_verify_reward("<answer>0.5</answer>", "1/2") == 1.0


@pytest.mark.parametrize(
    "content,match",
    [
        ('{"prompt": "a", "answer": "1"}\n{"prompt": "b", answer: 2}\n', r"d.jsonl:2: malformed JSON"),
        ('{"prompt": "a"}\n', r"d.jsonl:1: missing field\(s\) \['answer'\]"),
        ("[1, 2]\n", r"d.jsonl:1: expected a JSON object"),
        ("\n\n", "empty dataset"),
    ],
)
def test_bad_jsonl_names_file_and_line(tmp_path, content, match):
    p = tmp_path / "d.jsonl"
    p.write_text(content)
    with pytest.raises(DatasetError, match=match):
        jsonl_task(p)


def test_missing_file_and_unknown_spec(tmp_path):
    with pytest.raises(DatasetError, match="not found"):
        load_task(str(tmp_path / "x.jsonl"))
    with pytest.raises(DatasetError, match="unknown task"):
        load_task("gsm8k")


def test_extract_answer_precedence():
    assert extract_answer("a <answer>1</answer> b <answer> 2 </answer>") == "2"
    assert extract_answer("so \\boxed{7}") == "7"
    assert extract_answer("line1\n\n 42 \n") == "42"
    assert extract_answer("   ") is None


def test_toy_vowels_reward_against_a_direct_count():
    import random

    task = load_task("toy:vowels", size=8, seed=3)
    assert len(task) == 8 and task.examples == load_task("toy:vowels", size=8, seed=3).examples
    rng = random.Random()
    for _ in range(50):
        text = "".join(rng.choice("abcdefghiou XYZ12!é") for _ in range(rng.randrange(0, 30)))
        letters = [c for c in text.lower() if c in "abcdefghijklmnopqrstuvwxyz"]
        want = sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0
        assert task.score(text, task.examples[0]) == want


def test_restating_the_question_earns_no_reward():
    """math-verify evaluates the expression it parses: a response that restates the question
    ("To calculate -43 - 45, ...") must not verify as the answer -88 (GRPO learned to farm it);
    a stated number still does, with or without words around it."""
    from hilore_actor.data.rewards import math_verify_reward

    assert math_verify_reward("To calculate -43 - 45, we need to perform the subtraction operation.", "-88") == 0.0
    assert math_verify_reward("To calculate -69 + 90, we need to add.", "21") == 0.0
    assert (
        math_verify_reward("The answer is -88.", "-88") == 1.0
        and math_verify_reward("<answer>21</answer>", "21") == 1.0
    )
    opts = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "operators": ["+", "-"]}
    task = load_task("rg:basic_arithmetic", size=20, seed=5, options=opts, instruction=" Answer with the number only.")
    for ex in task.examples:
        question = ex.prompt.split("Calculate ")[1].split(". Answer")[0]
        assert task.score(f"To calculate {question}, we need to perform the operation.", ex) == 0.0, ex.prompt
        assert task.score(f"The result is {ex.answer}.", ex) == 1.0
