"""Tasks and rewards: reasoning-gym, JSONL, math-verify, clear errors on bad files."""

import json

import pytest

from hilore_actor.data import DatasetError, extract_answer, file_task, load_task, math_verify_reward


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
    task = file_task(p)
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
        file_task(p)


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


VERL_ROWS = [  # verl's GSM8K preprocessing writes rows of this shape
    {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
        "extra_info": {"split": "train", "index": i},
    }
    for i in range(3)
]


def test_a_verl_parquet_reads_as_its_rows(tmp_path):
    """The parquet's rows, read back through pyarrow, are the rows written: the chat list as the
    prompt, the nested label through its dotted path, the whole row kept for the reward."""
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    p = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(VERL_ROWS), p)
    task = file_task(p, "prompt", "reward_model.ground_truth")
    assert [e.prompt for e in task.examples] == [r["prompt"] for r in VERL_ROWS]
    assert [e.answer for e in task.examples] == [r["reward_model"]["ground_truth"] for r in VERL_ROWS]
    assert [e.metadata["row"] for e in task.examples] == VERL_ROWS
    assert task.examples[2].metadata["source"] == f"{p}[row 2]"
    with pytest.raises(
        DatasetError,
        match=r"train.parquet\[row 0\]: missing field\(s\) \['answer'\]; found \[.*"
        r"'reward_model.ground_truth'",
    ):
        file_task(p)


def test_json_array_json_lines_and_jsonl_read_alike(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(VERL_ROWS, indent=2))
    (tmp_path / "b.json").write_text("".join(json.dumps(r) + "\n" for r in VERL_ROWS))
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in VERL_ROWS))
    tasks = [file_task(tmp_path / n, "prompt", "reward_model.ground_truth") for n in ("a.json", "b.json", "c.jsonl")]
    for t in tasks:
        assert [(e.prompt, e.answer, e.metadata["row"]) for e in t.examples] == [
            (r["prompt"], r["reward_model"]["ground_truth"], r) for r in VERL_ROWS
        ]


def test_a_flat_key_with_a_dot_wins_over_the_path(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"q": "x", "a.b": "flat", "a": {"b": "nested"}}) + "\n")
    assert file_task(p, "q", "a.b").examples[0].answer == "flat"
    p.write_text(json.dumps({"q": "x", "a": {"b": "nested"}}) + "\n")
    assert file_task(p, "q", "a.b").examples[0].answer == "nested"
    with pytest.raises(DatasetError, match=r"missing field\(s\) \['a.c'\]; found \['q', 'a', 'a.b'\]"):
        file_task(p, "q", "a.c")


def test_an_unsupported_file_type_names_the_types(tmp_path):
    p = tmp_path / "d.csv"
    p.write_text("prompt,answer\n1+1,2\n")
    with pytest.raises(DatasetError, match=r"unsupported file type '.csv'; a dataset file is .jsonl, .json, .parquet"):
        load_task(str(p))
    (tmp_path / "x.parquet").write_text("not parquet")
    with pytest.raises(DatasetError, match=r"x.parquet: not a readable parquet file"):
        load_task(str(tmp_path / "x.parquet"))
