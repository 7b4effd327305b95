"""Diagnostics: rank statistics against brute force; the command runs on a tiny model."""

import itertools
import json
import random

import pytest

from benchmarks.diagnostics.analysis import auroc, spearman, top_recall
from benchmarks.diagnostics.cli import main


def test_auroc_is_pairwise_probability():
    rng = random.Random(random.randrange(2**31))
    scores = [rng.choice([0.1, 0.2, rng.random()]) for _ in range(25)]
    labels = [rng.random() < 0.3 for _ in range(25)]
    labels[0], labels[1] = True, False
    pos = [s for s, lab in zip(scores, labels) if lab]
    neg = [s for s, lab in zip(scores, labels) if not lab]
    pairs = [(1.0 if p > n else 0.5 if p == n else 0.0) for p, n in itertools.product(pos, neg)]
    assert auroc(scores, labels) == pytest.approx(sum(pairs) / len(pairs))


def test_spearman_and_recall_simple_cases():
    x = [random.random() for _ in range(20)]
    assert spearman(x, [2 * v + 1 for v in x]) == pytest.approx(1.0)
    assert spearman(x, [-v for v in x]) == pytest.approx(-1.0)
    assert top_recall(x, x) == 1.0


def test_command_writes_report(tmp_path, capsys):
    out = tmp_path / "diag.json"
    rc = main(
        [
            "--hidden",
            "64",
            "--layers",
            "2",
            "--vocab",
            "512",
            "--tokens",
            "256",
            "--calib",
            "2",
            "--heldout",
            "2",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    assert 0 <= report["coefficients"]["zero_pg_coefficient_fraction"] <= 1
    assert set(report["predictors"]) == {"advantage_only", "complete_exposure", "psi"}
    assert report["n_samples"] == 2 * 4
    assert "top 10% of tokens carry" in capsys.readouterr().out


def test_command_bad_model_path(tmp_path, capsys):
    assert main(["--model-config", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.slow
def test_command_on_smollm2_real_rollouts(tmp_path, capsys):
    out = tmp_path / "diag.json"
    rc = main(
        [
            "--model",
            "smollm2",
            "--tokens",
            "96",
            "--calib",
            "1",
            "--heldout",
            "1",
            "--group-size",
            "2",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["model"] == "smollm2" and report["inputs"]["task"] == "rg:basic_arithmetic"
    assert report["n_samples"] == 61  # SmolLM2's 30 layers x (attention, MLP) + the head unit, one held-out microbatch
