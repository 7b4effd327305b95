"""Every causal-LM architecture of the installed transformers under the recovery engine
(``tests/helpers/arch_sweep.py``): H, R and gc bitwise equal to no-gc, L's error above 0 and small, the
layers cut by structure or a clear whole-layer fallback, never a traceback; and the table in
``docs/architectures.md`` is what the sweep finds.

The whole registry takes one to two minutes on 2 cores, so the default suite checks a fixed
set (the common GRPO targets and one architecture of each structure the cut handles: post-norm,
sandwich norms, parallel attention/MLP, MoE, latent attention, state-space mixers, sliding
windows, a whole-layer fallback, a refusal); the whole sweep and the doc table are ``-m slow``."""

import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")
import arch_sweep  # noqa: E402  (tests/ is on the path: conftest.py lives there)

DOC = Path(__file__).resolve().parents[2] / "docs" / "architectures.md"
# The architectures users train with GRPO most, held to the whole acceptance: cut into units,
# exact under H/R/gc, and L's error in (0, 0.05).
NAMED = (
    "olmo2",
    "gemma3_text",
    "qwen3_moe",
    "mixtral",
    "gpt_oss",
    "phi3",
    "qwen3",
    "mistral",
    "smollm3",
    "llama",
    "qwen2",
    "deepseek_v2",
    "qwen3_next",
    "gptj",
    "falcon",
)


# One of each other structure: sandwich norms, MoE with shared experts, state-space and hybrid
# mixers, a model without HF gradient checkpointing, a prediction-head LM, a whole-layer fallback
# (hy_v4) and a refusal (dory: a layer run twice).
STRUCTURES = ("gemma2", "qwen2_moe", "mamba", "jamba", "falcon_h1", "openai-gpt", "roformer", "cohere", "hy_v4", "dory")


def _check(archs):
    out = [arch_sweep.check(a) for a in archs]
    for r in out:
        print(r["arch"], r["status"], r.get("units", ""), f"{r.get('all_l', 0):.4f}", r.get("why", "")[:100])
    return {r["arch"]: r for r in out}


@pytest.fixture(scope="module")
def rows():
    return _check(arch_sweep.registry())


@pytest.fixture(scope="module")
def common():
    return _check(NAMED + STRUCTURES)


def _none_broken(rows):
    broken = {a: r.get("why", r.get("errors")) for a, r in rows.items() if r["status"] in ("error", "inexact")}
    assert not broken, broken
    assert all(r["all_l"] > 0 for r in rows.values() if "all_l" in r)  # L acts wherever it is chosen


def test_no_structure_breaks_the_engine(common):
    _none_broken(common)
    assert common["hy_v4"]["status"] == "fallback" and common["dory"]["status"] == "refused"


@pytest.mark.slow
def test_no_architecture_that_runs_breaks_the_engine(rows):
    _none_broken(rows)
    assert sum(r["status"] == "exact" for r in rows.values()) >= 100  # most of the registry is cut and exact


def test_the_common_architectures_are_cut_exact_and_l_is_small(common):
    rows = common
    for a in NAMED:
        r = rows[a]
        assert r["status"] == "exact" and "layer" not in r["units"], (a, r)
        assert 0 < r["all_l"] < 0.05, (a, r["all_l"])
    assert rows["gpt_oss"]["attention"] == "eager"  # transformers refuses SDPA for it


def _structure(text: str):
    """The doc's rows without the all-L error column (floating-point values differ across CPUs)."""
    return [re.sub(r"\|[^|]*\|\s*$", "|", line) for line in text.splitlines() if line.startswith("| `")]


@pytest.mark.slow
def test_the_architecture_table_is_what_the_sweep_finds(rows):
    import transformers

    doc = DOC.read_text()
    if f"transformers {transformers.__version__}," not in doc.splitlines()[0]:
        pytest.skip(f"docs/architectures.md was generated with another transformers: {doc.splitlines()[0]}")
    want = arch_sweep.markdown([rows[a] for a in arch_sweep.registry()])
    assert _structure(doc) == _structure(want), "run: python tests/helpers/arch_sweep.py --write docs/architectures.md"
