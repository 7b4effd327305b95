"""The repository says what the code does and why, never where in the development process it
came from: no tracker numbers ("issue 12", "stop 30", "item 9") and no working-period words in
the package, the docs, the README, the results page, the scripts or the tests."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORDS = re.compile(r"\b(?:issues?|stops?|items?|turns?)[ -]#?\d+|\bsession\b|\bthis turn\b", re.IGNORECASE)
ALLOWED = [re.compile(r'scope="session"'), re.compile(r"request\.session\.")]  # pytest's own fixture scope and API
SCANNED = [
    "hilore_actor/**/*.py",
    "docs/**/*.md",
    "README.md",
    "benchmarks/RESULTS.md",
    "benchmarks/*.sh",
    "benchmarks/*.py",
    "benchmarks/results/**/*.md",
    "scripts/*",
    "examples/*",
    "ray_jobs/*",
    "patches/*",
    "tests/**/*.py",
    "setup.py",
    ".ci/*",
]


def hits(text: str):
    """(line number, line) for every process word of ``text`` not allowed."""
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        rest = line
        for ok in ALLOWED:
            rest = ok.sub("", rest)
        if WORDS.search(rest):
            out.append((i, line.strip()))
    return out


def test_the_pattern_catches_process_words_and_spares_plain_words():
    for bad in ("see issue 12", "Issue 14's aims", "(stop 30)", "item-9 run", "this session", "the turn 3 fix"):
        assert hits(bad), bad
    for ok in (
        '@pytest.fixture(scope="session")',
        "request.session.items",
        "issues/1047 on GitHub",
        "the last item",
        "stops the job",
        "turns gradient checkpointing off",
        "start_new_session",
    ):
        assert not hits(ok), ok


def test_no_process_words_in_the_repository():
    me = Path(__file__).resolve()
    found = []
    for pattern in SCANNED:
        for f in sorted(ROOT.glob(pattern)):
            if f.is_file() and f.resolve() != me:
                found += [f"{f.relative_to(ROOT)}:{i}: {line[:120]}" for i, line in hits(f.read_text(errors="replace"))]
    assert not found, "development-process words:\n" + "\n".join(found)
