"""A user's own reward (``data/reward_function.py``): both conventions, the checks made before
anything starts, and an exception inside the function naming the function and the sample."""

import json

import pytest

from hilore_actor.data import file_task
from hilore_actor.data.reward_function import RewardError, RewardFunctionError, load_reward_function


@pytest.fixture
def task(tmp_path):
    p = tmp_path / "d.jsonl"
    rows = [
        {"question": "1+1", "solution": 2, "data_source": "arith"},
        {"question": [{"role": "user", "content": "2+2"}], "solution": "4", "extra_info": {"id": 7}},
    ]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return file_task(p, "question", "solution")


def write(tmp_path, body, name="r.py"):
    f = tmp_path / name
    f.write_text(body)
    return str(f)


def test_per_response_gets_what_its_parameter_names_ask_for(tmp_path, task):
    seen = tmp_path / "seen.json"
    f = write(
        tmp_path,
        f"""
import json
calls = []
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    calls.append([data_source, solution_str, ground_truth, extra_info])
    json.dump(calls, open({str(seen)!r}, "w"))
    return {{"score": len(solution_str) / 10}}
""",
    )
    fn = load_reward_function(f)
    assert not fn.batched
    assert task.__class__(task.name, task.examples, fn).score_all(["abc", "abcdef"], task.examples) == [0.3, 0.6]
    calls = json.loads(seen.read_text())
    assert calls[0] == [
        "arith",
        "abc",
        2,
        {"question": "1+1", "solution": 2, "data_source": "arith"},
    ]  # label as JSON has it
    assert calls[1][0] == task.name and calls[1][3] == {"id": 7}  # no data_source field: the dataset; extra_info field


def test_batched_openrlhf_convention_gets_rendered_prompts_and_queries(tmp_path, task):
    f = write(
        tmp_path,
        """
import torch
def reward_func(queries, prompts, labels):
    assert all(q.startswith(p) for q, p in zip(queries, prompts))
    return {"rewards": torch.tensor([float(str(l) in q) for q, l in zip(queries, labels)])}
""",
    )
    fn = load_reward_function(f)
    assert fn.batched and fn.needs_text
    out = fn.score_all(["it is 2", "five"], task.examples, ["<p>1+1", "<p>2+2"], ["<p>1+1it is 2", "<p>2+2five"])
    assert out == [1.0, 0.0]


def test_module_and_explicit_name(tmp_path, task, monkeypatch):
    write(tmp_path, "def my_score(response, answer):\n    return float(response == str(answer))\n", "myrewards.py")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = load_reward_function("myrewards", "my_score")
    assert fn(" 2", task.examples[0]) == 0.0 and fn("2", task.examples[0]) == 1.0


@pytest.mark.parametrize(
    "body, name, message",
    [
        (None, None, "file not found"),
        ("import no_such_module_here\n", None, "importing it raised ModuleNotFoundError"),
        ("def other(x):\n    return 1\n", None, "no function compute_score or reward_func (it defines other"),
        (
            "def compute_score(solution_str, foo):\n    return 1\n",
            None,
            "parameters ['foo'] are not ones it can be given",
        ),
        ("def f(solution_str, labels):\n    return 1\n", "f", "mixes per-response"),
        ("def compute_score():\n    return 1\n", None, "takes none of the known parameters"),
    ],
)
def test_mistakes_are_one_line(tmp_path, body, name, message):
    path = write(tmp_path, body) if body is not None else str(tmp_path / "missing.py")
    with pytest.raises(RewardFunctionError) as e:
        load_reward_function(path, name)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_an_exception_or_a_bad_value_names_the_function_and_the_sample(tmp_path, task):
    fn = load_reward_function(write(tmp_path, "def compute_score(solution_str):\n    return 1 / len(solution_str)\n"))
    with pytest.raises(
        RewardError, match=r"compute_score \(.*r\.py\) raised ZeroDivisionError: .*/d\.jsonl:2, response ''"
    ):
        fn.score_all(["ok", ""], task.examples)
    fn = load_reward_function(write(tmp_path, "def compute_score(solution_str):\n    return 'high'\n", "s.py"))
    with pytest.raises(RewardError, match="returned 'high', not a finite number"):
        fn("x", task.examples[0])
    fn = load_reward_function(write(tmp_path, "def reward_func(queries):\n    return [1.0]\n", "b.py"))
    with pytest.raises(RewardError, match="expected 2 finite numbers"):
        fn.score_all(["a", "b"], task.examples)


@pytest.fixture
def servers():
    from reward_server import reward_servers  # tests/helpers

    with reward_servers(2) as (urls, state):
        yield urls, state


def test_a_remote_reward_gets_openrlhfs_request_shared_over_its_servers(task, servers):
    from hilore_actor.data.reward_function import RemoteReward

    urls, state = servers
    fn = RemoteReward(urls)
    examples = [task.examples[0], task.examples[1], task.examples[0]]
    prompts, responses = ["P0", "P1", "P0"], ["r", "rr", "rrr"]
    queries = [p + r for p, r in zip(prompts, responses)]
    assert fn.score_all(responses, examples, prompts, queries) == [len(q) / 100 for q in queries]
    order = {int(u.rsplit(":", 1)[1].split("/")[0]): i for i, u in enumerate(urls)}
    got = sorted(
        state["bodies"], key=lambda b: order[b[0]]
    )  # the first server takes the first two, the second the last
    assert [b for _, b in got] == [
        {"query": queries[:2], "prompts": prompts[:2], "labels": [2, "4"]},
        {"query": queries[2:], "prompts": prompts[2:], "labels": [2]},
    ]
    state["reply"] = {"scores": [0.5]}  # OpenRLHF reads 'scores' too; one number for two responses is wrong
    with pytest.raises(RewardError, match=r"returned \[0.5\] for 2 responses: expected 2 finite numbers"):
        RemoteReward(urls[:1]).score_all(responses[:2], examples[:2], prompts[:2], queries[:2])


def test_a_remote_reward_that_does_not_answer_is_one_error(task):
    import socket

    from hilore_actor.data.reward_function import RemoteReward

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/"
    with pytest.raises(RewardError, match=r"the reward server http://127.0.0.1:\d+/ did not answer 2 requests"):
        RemoteReward([url], tries=2, wait=0.0).score_all(["r"], task.examples[:1], ["p"], ["pr"])
