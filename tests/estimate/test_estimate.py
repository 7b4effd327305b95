"""``python -m hilore_actor.estimate``: the fields a user reads, ``--json`` for tools, and bad
input in one line with exit code 2; the plan's peak as the knapsack predicted it and as the
meta device runs it."""

import json

import pytest

from hilore_actor.estimate.__main__ import main

ASKED = ["--model", "qwen2.5-7b", "--tokens", "16384", "--device", "h100", "--budget", "1.10"]


@pytest.fixture(scope="module")
def estimated():
    """The README's example, estimated once for the tests below."""
    from hilore_actor.estimate import Setting, estimate

    return estimate(Setting(model="qwen2.5-7b", tokens=16384, device="h100", budget="1.10"))


@pytest.fixture
def answer(estimated, monkeypatch, capsys):
    """The command's ``--json`` output for the example (its estimate: ``estimated``)."""
    import hilore_actor.estimate.__main__ as cli

    monkeypatch.setattr(cli, "estimate", lambda setting: estimated)
    assert main([*ASKED, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_json_holds_what_the_text_prints(answer):
    e = answer
    assert e["setting"]["model"] == "qwen2.5-7b" and e["device"]["name"].startswith("H100")
    # Qwen2.5-7B's published size and LoRA 16 on its 7 linear layers per layer (28 layers)
    assert round(e["parameters"] / 1e9, 2) == 7.66
    h, i, kv = 3584, 18944, 512
    per_layer = 16 * ((h + h) + (h + kv) * 2 + (h + h) + (h + i) * 2 + (i + h))
    assert e["trainable"] == 28 * per_layer
    assert e["resident_bytes"] < e["gc_peak_bytes"] < e["budget_bytes"] < e["nogc_peak_bytes"]
    assert e["budget_bytes"] == int(1.10 * e["gc_peak_bytes"]) and e["gc_fits"]
    assert e["gc_update_seconds"] > e["forward_seconds"] > 0 and e["assumptions"]
    for name, plan in e["plans"].items():
        assert sum(plan["counts"].values()) == 56 and plan["update_seconds"] <= e["gc_update_seconds"]
        # the knapsack's peak (gc's + the kept units' bytes as held alone) within B, and the plan run on the
        # meta device within 3% of it (an H unit's bytes held alone count a layer input its replay would share;
        # an L unit's encode adds a transient the knapsack does not count)
        assert plan["predicted_peak_bytes"] <= e["budget_bytes"], name
        assert plan["meta_peak_bytes"] == pytest.approx(plan["predicted_peak_bytes"], rel=0.03), name


def test_the_text_names_the_fields(estimated, monkeypatch, capsys):
    import hilore_actor.estimate.__main__ as cli

    monkeypatch.setattr(cli, "estimate", lambda setting: estimated)
    assert main(ASKED) == 0
    text = capsys.readouterr().out
    for field in ("resident", "gc peak", "no-gc peak", "room above gc", "exact plan (H/R)", "over gc", "offloaded"):
        assert field in text, field


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "qwen9"], "--model qwen9: not a named config"),
        (["--model", "qwen2.5-7b", "--device", "tpu"], "unknown device 'tpu'; presets: h100, h200, a100, l40s, local"),
        (["--model", "qwen2.5-7b", "--budget", "1GiB"], "--budget 1GiB: below the 14."),
        (["--model", "qwen2.5-7b", "--budget", "0.9"], "--budget 0.9: a ratio below 1"),
    ],
)
def test_bad_input_is_one_line(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.strip().count("\n") == 0, err
