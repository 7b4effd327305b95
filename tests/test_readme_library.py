"""The README's "The library in short": its allocation snippet runs exactly as printed, so the
numbers it feeds ``resolve_budget`` come from the library's own calls, not from the reader."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def section_snippets(title: str):
    """The ```python blocks of the README section ``## title``, in order."""
    text = README.read_text()
    body = text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", body, flags=re.S)


def test_the_allocation_snippet_runs_as_printed():
    code = section_snippets("The library in short")[1]
    assert "gc_peak_bytes =" in code and "all_r_peak_bytes =" in code  # measured, not assumed
    namespace = {"__name__": "__main__"}
    exec(compile(code, str(README), "exec"), namespace)
    assert namespace["budget"] >= max(namespace["gc_peak_bytes"], namespace["all_r_peak_bytes"]) > 0
    h, mbs = namespace["h"], namespace["mbs"]
    assert h.plan_for(mbs[-1]).plan
    assert len(set(namespace["res"].actions.values())) >= 2  # the plan mixes actions, as the README says
    assert h.explain(h.plan_for(mbs[-1])).endswith("the rest are recomputed (R)")
