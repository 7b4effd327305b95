"""The --hilore.* settings: one table, typed parsing, and errors that name the flag."""

import pytest

from hilore_actor.learner.settings import DEFAULTS, boolean, hilore_errors, hilore_settings, parse_hilore, token_rows


def test_defaults_and_typed_values():
    s = hilore_settings()
    assert s.loo is True and s.mode == DEFAULTS["mode"] and not hilore_errors(s)
    got = parse_hilore({"loo": "false", "delta": "0.02", "codec": "bf16", "budget": "6GiB"})
    assert got == {"loo": False, "delta": 0.02, "codec": "bf16", "budget": "6GiB"}
    assert token_rows(hilore_settings(token_rows="0.1, 0.25")) == (0.1, 0.25) and token_rows(s) == ()
    assert [boolean(v) for v in ("1", "True", "on", "no", "OFF", "0")] == [True, True, True, False, False, False]


@pytest.mark.parametrize(
    "raw, match",
    [
        ({"loo": "maybe"}, r"--hilore.loo 'maybe': expected true\|false"),
        ({"delta": "x"}, "--hilore.delta 'x': expected float"),
        ({"nope": "1"}, "unknown flag --hilore.nope"),
        ({"codec": "int4"}, "--hilore.codec 'int4'"),
        ({"mode": "fast"}, "--hilore.mode 'fast'"),
        ({"token_rows": "0.1,1.5"}, "--hilore.token_rows '0.1,1.5'"),
        ({"token_rows": "a"}, "--hilore.token_rows 'a'"),
        ({"compile_activation_budget": "1.5"}, r"--hilore.compile_activation_budget 1.5: a value within \[0, 1\]"),
    ],
)
def test_bad_values_name_the_flag(raw, match):
    with pytest.raises(ValueError, match=match):
        parse_hilore(raw)


def test_unknown_setting_is_refused():
    with pytest.raises(ValueError, match="unknown HiLoRe settings"):
        hilore_settings(lo=False)


def test_flags_come_from_the_config_dataclasses():
    """Every --hilore.* flag is a field of ``Settings``; the planner's take their defaults and help
    from ``Planner.Config`` (one default for each, e.g. profile repeats), and ``planner_config``
    hands the flags' values back to the planner."""
    from dataclasses import fields

    from hilore_actor.allocation import Planner
    from hilore_actor.learner.settings import HILORE_FLAGS, PLANNER_SETTINGS, Settings, planner_config

    assert [name for name, *_ in HILORE_FLAGS] == ["hilore." + f.name for f in fields(Settings)]
    config, meta = Planner.Config(), {f.name: f.metadata["help"] for f in fields(Planner.Config)}
    assert {"mode", "delta", "profile_repeats", "loo", "token_rows"} <= set(PLANNER_SETTINGS)
    for name, _, default, help_ in HILORE_FLAGS:
        key = name[len("hilore.") :]
        if key in PLANNER_SETTINGS:
            assert help_ == meta[key] and (default == getattr(config, key) or key == "token_rows"), key
    assert DEFAULTS["profile_repeats"] == config.profile_repeats == 2
    got = planner_config(hilore_settings(token_rows="0.1,0.25", loo=False), mode="hilore-hr")
    assert got == Planner.Config(mode="hilore-hr", token_rows=(0.1, 0.25), loo=False)
