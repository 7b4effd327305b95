"""A user's own reward: a Python function in a file or module (``--reward.path``, ``--reward.name``).

Both conventions users already write are accepted, told apart by the parameter names:

- per response, verl's ``compute_score(data_source, solution_str, ground_truth, extra_info=None)``
  (also ``response``, ``answer``/``label``, ``prompt``); it returns a number, or a dict with ``"score"``;
- batched, OpenRLHF's ``reward_func(queries, prompts, labels)`` (or verl's batch names
  ``data_sources, solution_strs, ground_truths, extra_infos``; also ``responses``, ``answers``);
  it returns one number per response: a list, a tensor, or a dict with ``"rewards"`` or ``"scores"``.

What each name receives: ``solution_str``/``response``: the decoded response; ``ground_truth``/
``answer``/``label``: the dataset's label field, as the JSON holds it; ``prompt``: the prompt as the
dataset holds it; ``prompts``/``queries``: the prompt after the chat template, and prompt + response
(OpenRLHF's texts); ``data_source``: the row's ``data_source`` field, else the dataset's name;
``extra_info``: the row's ``extra_info`` field, else the whole row.

``load_reward_function`` checks the file, the import and the signature before anything starts
(``RewardFunctionError``, one line); an exception inside the function during a run becomes a
``RewardError`` naming the function and the sample.

A reward server (``--reward.remote_url``, OpenRLHF's remote reward model) is ``RemoteReward``:
OpenRLHF's request, ``{"query": queries, "prompts": prompts, "labels": labels}`` POSTed as JSON,
and its reply's ``"rewards"`` (else ``"scores"``), one per response.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

DEFAULT_NAMES = ("compute_score", "reward_func")  # verl's default name, then OpenRLHF's

# parameter name -> what it receives (per response); the batched names are the plurals
SINGLE = {
    "solution_str": "response",
    "response": "response",
    "ground_truth": "label",
    "answer": "label",
    "label": "label",
    "prompt": "prompt",
    "data_source": "data_source",
    "extra_info": "extra_info",
    "query": "query",
}
BATCHED = {
    "solution_strs": "response",
    "responses": "response",
    "ground_truths": "label",
    "answers": "label",
    "labels": "label",
    "prompts": "rendered_prompt",
    "queries": "query",
    "data_sources": "data_source",
    "extra_infos": "extra_info",
}


class RewardFunctionError(ValueError):
    """The reward file, module, function or signature is wrong; the message says which."""


class RewardError(RuntimeError):
    """The user's reward function raised, or returned something that is not a finite number."""


class RewardFunction:
    """A loaded reward function, called with the arguments its parameter names ask for."""

    def __init__(self, fn: Callable, where: str, batched: bool, params: Dict[str, str]):
        self.fn, self.where, self.batched, self.params = fn, where, batched, params
        self.needs_text = any(what in ("rendered_prompt", "query") for what in params.values())

    def __call__(self, response: str, example) -> float:
        return self.score_all([response], [example])[0]

    def score_all(
        self,
        responses: Sequence[str],
        examples: Sequence,
        prompts: Optional[Sequence[str]] = None,
        queries: Optional[Sequence[str]] = None,
    ) -> List[float]:
        fields = [
            _fields(r, e, None if prompts is None else prompts[i], None if queries is None else queries[i])
            for i, (r, e) in enumerate(zip(responses, examples))
        ]
        if self.batched:
            kwargs = {p: [f[what] for f in fields] for p, what in self.params.items()}
            out = self._call(kwargs, fields[0] if len(fields) == 1 else fields)
            scores = _batch_scores(out, len(fields), self)
        else:
            scores = [
                _one_score(self._call({p: f[what] for p, what in self.params.items()}, f), self, f) for f in fields
            ]
        return scores

    def _call(self, kwargs: Dict[str, Any], sample) -> Any:
        try:
            return self.fn(**kwargs)
        except Exception as e:
            raise RewardError(f"the reward function {self.where} raised {type(e).__name__}: {e}{_on(sample)}") from e


def _on(sample) -> str:
    """Which sample (a batch: which examples) the function was given."""
    if isinstance(sample, list):
        sources = list(dict.fromkeys(f["source"] for f in sample))
        more = f" and {len(sources) - 3} more" if len(sources) > 3 else ""
        return f" (on a batch of {len(sample)} responses to {', '.join(sources[:3])}{more})"
    return f" (on the sample {sample['source']}, response {sample['response'][:60]!r})"


def _fields(response: str, example, prompt_text: Optional[str], query: Optional[str]) -> Dict[str, Any]:
    row = example.metadata.get("row")
    row = row if isinstance(row, dict) else {}
    raw = example.prompt
    rendered = prompt_text if prompt_text is not None else (raw if isinstance(raw, str) else str(raw))
    label = example.metadata.get("label", example.answer)
    return {
        "response": response,
        "label": label,
        "prompt": raw,
        "rendered_prompt": rendered,
        "query": query if query is not None else rendered + response,
        "data_source": row.get("data_source", example.metadata.get("dataset")),
        "extra_info": row.get("extra_info", row),
        "source": example.metadata.get("source", "?"),
    }


def _number(v: Any) -> Optional[float]:
    if isinstance(v, dict):
        v = v.get("score", v.get("reward"))
    if hasattr(v, "item") and getattr(v, "numel", lambda: 1)() == 1:
        v = v.item()
    if isinstance(v, bool) or isinstance(v, (int, float)):
        f = float(v)
        return f if math.isfinite(f) else None
    return None


def _one_score(out: Any, fn: RewardFunction, sample: Dict) -> float:
    f = _number(out)
    if f is None:
        raise RewardError(
            f"the reward function {fn.where} returned {out!r}, not a finite number or a dict with 'score'{_on(sample)}"
        )
    return f


def _batch_scores(out: Any, n: int, fn: RewardFunction) -> List[float]:
    if isinstance(out, dict):
        out = out.get("rewards", out.get("scores"))
    if hasattr(out, "tolist"):
        out = out.tolist()
    scores = [_number(v) for v in out] if isinstance(out, (list, tuple)) else None
    if scores is None or len(scores) != n or any(s is None for s in scores):
        raise RewardError(
            f"the reward function {fn.where} returned {str(out)[:120]} for {n} responses: expected {n} "
            "finite numbers (a list, a tensor, or a dict with 'rewards' or 'scores')"
        )
    return scores


class RemoteReward:
    """A reward server, called as OpenRLHF's ``SingleTurnAgentExecutor`` calls one: the batch is
    split evenly over ``urls`` and each part POSTed as ``{"query", "prompts", "labels"}``;
    ``tries`` attempts per part, ``wait`` seconds apart, each within ``timeout`` seconds."""

    needs_text = True  # the rendered prompts and the queries (prompt + response), as OpenRLHF sends them

    def __init__(self, urls: Sequence[str], tries: int = 5, wait: float = 1.0, timeout: float = 180.0):
        self.urls = [u.strip() for u in urls if u.strip()]
        self.tries, self.wait, self.timeout = tries, wait, timeout
        self.where = f"at {', '.join(self.urls)}"

    def __call__(self, response: str, example) -> float:
        return self.score_all([response], [example])[0]

    def score_all(self, responses, examples, prompts=None, queries=None) -> List[float]:
        from concurrent.futures import ThreadPoolExecutor

        fields = [
            _fields(r, e, None if prompts is None else prompts[i], None if queries is None else queries[i])
            for i, (r, e) in enumerate(zip(responses, examples))
        ]
        size = -(-len(fields) // len(self.urls))
        parts = [(url, fields[i * size : (i + 1) * size]) for i, url in enumerate(self.urls) if fields[i * size :]]
        with ThreadPoolExecutor(len(parts)) as pool:
            replies = list(pool.map(lambda part: self._post(*part), parts))
        return [s for (_, part), out in zip(parts, replies) for s in _batch_scores(out, len(part), self)]

    def _post(self, url: str, part: List[Dict]) -> Any:
        import json
        import time
        import urllib.error
        import urllib.request

        body = json.dumps(
            {
                "query": [f["query"] for f in part],
                "prompts": [f["rendered_prompt"] for f in part],
                "labels": [f["label"] for f in part],
            }
        ).encode()
        why = ""
        for attempt in range(self.tries):
            request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as reply:
                    return json.loads(reply.read().decode())
            except (urllib.error.URLError, OSError, ValueError) as e:  # refused, HTTP error, timeout, not JSON
                why = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
            if attempt + 1 < self.tries:
                time.sleep(self.wait)
        raise RewardError(
            f"the reward server {url} did not answer {self.tries} requests ({why})"
            f"{_on(part[0] if len(part) == 1 else part)}"
        )


def _import(path: str):
    """A ``.py`` file, else a module importable from the working directory or sys.path."""
    if path.endswith(".py") or "/" in path or Path(path).is_file():
        p = Path(path)
        if not p.is_file():
            raise RewardFunctionError(f"--reward.path {path}: file not found")
        spec = importlib.util.spec_from_file_location(f"hilore_user_reward_{abs(hash(str(p.resolve())))}", p)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            raise RewardFunctionError(f"--reward.path {path}: importing it raised {type(e).__name__}: {e}") from None
        return module
    if "" not in sys.path and "." not in sys.path:  # a module beside the command, as `python -m` finds it
        sys.path.insert(0, "")
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError as e:
        raise RewardFunctionError(f"--reward.path {path}: no such file or module ({e})") from None
    except Exception as e:
        raise RewardFunctionError(f"--reward.path {path}: importing it raised {type(e).__name__}: {e}") from None


def load_reward_function(path: str, name: Optional[str] = None) -> RewardFunction:
    """The function ``name`` (default: ``compute_score``, else ``reward_func``) of a file or
    module, with its convention read from its parameter names."""
    module = _import(path)
    names = [name] if name else list(DEFAULT_NAMES)
    found = [n for n in names if callable(getattr(module, n, None))]
    if not found:
        have = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_"))
        raise RewardFunctionError(
            f"--reward.path {path}: no function {' or '.join(names)} (it defines "
            f"{', '.join(have) or 'no function'}; name yours with --reward.name)"
        )
    fn = getattr(module, found[0])
    where = f"{found[0]} ({path})"
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise RewardFunctionError(f"--reward.path {path}: cannot read the signature of {found[0]} ({e})") from None
    params = [p for p in sig.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    known = [p.name for p in params if p.name in SINGLE or p.name in BATCHED]
    unknown = [p.name for p in params if p.name not in SINGLE and p.name not in BATCHED and p.default is p.empty]
    single = [n for n in known if n in SINGLE]
    batched = [n for n in known if n in BATCHED]
    usage = (
        "per response: compute_score(data_source, solution_str, ground_truth, extra_info=None); batched: "
        "reward_func(queries, prompts, labels)"
    )
    if unknown or (single and batched) or not known:
        why = (
            f"parameters {unknown} are not ones it can be given"
            if unknown
            else f"it mixes per-response {single} and batched {batched} parameters"
            if single and batched
            else "it takes none of the known parameters"
        )
        raise RewardFunctionError(f"--reward.path {path}: {found[0]}{sig}: {why}; write it as {usage}")
    table = BATCHED if batched else SINGLE
    return RewardFunction(fn, where, bool(batched), {n: table[n] for n in known})
