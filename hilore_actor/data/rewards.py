"""Verifiable rewards: answer extraction and math-verify comparison."""

from __future__ import annotations

import re
from typing import Optional

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def extract_answer(response: str) -> Optional[str]:
    """The final answer a response commits to: the last ``<answer>..</answer>``, else the last
    ``\\boxed{..}``, else the last non-empty line. ``None`` for an empty response."""
    for pattern in (_ANSWER_TAG, _BOXED):
        found = pattern.findall(response)
        if found:
            return found[-1].strip()
    lines = [ln.strip() for ln in response.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else None


_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def math_verify_reward(response: str, answer: str) -> float:
    """1.0 when math-verify judges the response's extracted answer equal to ``answer``. A
    numeric gold answer needs a number: math-verify evaluates what it parses, so restating
    the question ("To calculate -43 - 45, ...") would otherwise verify as -88, a reward a
    policy learns to farm within tens of GRPO steps."""
    import math_verify

    extracted = extract_answer(response)
    if extracted is None:
        return 0.0
    gold = math_verify.parse(answer if "$" in answer or "\\" in answer else f"${answer}$")
    pred = math_verify.parse(extracted)
    if not gold or not pred:
        return float(extracted.strip() == answer.strip())
    if _NUMBER.fullmatch(answer.strip()) and not _NUMBER.fullmatch(str(pred[-1]).strip().rstrip(".").replace(",", "")):
        return 0.0
    return float(math_verify.verify(gold, pred))
