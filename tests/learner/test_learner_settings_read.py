"""Every ``--hilore.*`` setting a launcher accepts is read on that launcher's code path, or refused
there with one line: none is parsed and then silently ignored.

The check is static, over the source: per launcher, the modules it runs (its own package, and the
learner-room functions every launcher plans through), every read of a setting on the settings
namespace, as ``hcfg.budget``, ``cfg.hilore.budget`` or ``self.hilore_cfg.budget`` (an attribute
of a name ``hcfg``/``hilore_cfg`` or of an attribute ``.hilore``/``.hilore_cfg``), and
``getattr(hcfg, name)`` over a table of names (``planner_config`` over ``PLANNER_SETTINGS``).
Reads inside the flag checks (``CHECKS``: they refuse or say, they do not honour) do not count.
Chosen over recording reads during a run because one short run per launcher would take a Ray job,
OpenRLHF's trainer and verl's engine, and a run still reads only the branches its flags take; the
static check sees every branch. What it cannot see: a read in code the launcher never calls (so
the paths below name the learner room's shared modules by function) or under another name (a new
spelling fails this test as an unread setting, which is the safe way round)."""

import ast
from dataclasses import fields
from pathlib import Path

import pytest

import hilore_actor
from hilore_actor.learner import settings as settings_module
from hilore_actor.learner.settings import Settings

PKG = Path(hilore_actor.__file__).parent
SETTINGS = {f.name for f in fields(Settings)}
NAMES = {"hcfg", "hilore_cfg"}  # a name bound to the settings namespace
OWNERS = {"hilore", "hilore_cfg"}  # an attribute holding it: cfg.hilore, self.hilore_cfg
CHECKS = {"validate", "ignored_errors", "ignored_notes", "hilore_errors", "value_errors", "_calibration_errors"}
# the learner room's functions every launcher plans through: (module, functions; None: all of it)
SHARED = (("learner/plan.py", None), ("learner/settings.py", {"planner_config", "token_rows"}))
LAUNCHERS = {
    "train_grpo": ("train_grpo.py", "train"),
    "openrlhf": ("openrlhf",),
    "verl": ("verl",),
}


def _refused(launcher: str) -> set:
    """Settings a launcher refuses with one line where they are given (they have no effect there)."""
    if launcher == "verl":
        from hilore_actor.verl.settings import NO_EFFECT

        return set(NO_EFFECT)
    return set()


def _is_settings(node) -> bool:
    return (isinstance(node, ast.Name) and node.id in NAMES) or (
        isinstance(node, ast.Attribute) and node.attr in OWNERS
    )


def _reads(tree, only=None) -> set:
    """The settings read in ``tree``'s functions (``only``: those functions alone), checks left out."""
    out = set()

    def visit(node, function):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        counted = function not in CHECKS and (only is None or function in only)
        if counted and isinstance(node, ast.Attribute) and node.attr in SETTINGS and _is_settings(node.value):
            out.add(node.attr)
        if counted and isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            tables = [g.iter.id for g in node.generators if isinstance(g.iter, ast.Name)]
            gets = [
                n
                for n in ast.walk(node)
                if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "getattr" and _is_settings(n.args[0])
            ]
            for table in tables if gets else []:
                out.update(set(getattr(settings_module, table, ())) & SETTINGS)
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(tree, None)
    return out


def _files(parts):
    for part in parts:
        path = PKG / part
        yield from sorted(path.rglob("*.py")) if path.is_dir() else [path]


def read_by(launcher: str) -> set:
    got = set()
    for path in _files(LAUNCHERS[launcher]):
        got |= _reads(ast.parse(path.read_text()))
    for module, only in SHARED:
        got |= _reads(ast.parse((PKG / module).read_text()), only)
    return got


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_every_setting_a_launcher_accepts_is_read_or_refused(launcher):
    read, refused = read_by(launcher), _refused(launcher)
    print(launcher, "reads", sorted(read), "refuses", sorted(refused))
    assert not read & refused, f"{launcher} refuses settings it reads: {sorted(read & refused)}"
    assert SETTINGS - read - refused == set(), f"{launcher} parses and never reads {sorted(SETTINGS - read - refused)}"


def test_the_reader_sees_each_kind_of_read_and_skips_checks():
    """The static reader on known snippets: each spelling of a read, a table read through getattr,
    and a read inside a check (not counted)."""
    src = """
def run(cfg, hcfg, self):
    a = cfg.hilore.budget
    b = hcfg.mode
    c = self.hilore_cfg.fill
    d = {name: getattr(hcfg, name) for name in PLANNER_SETTINGS}
    e = other.codec

def validate(cfg):
    return cfg.hilore.compile
"""
    got = _reads(ast.parse(src))
    assert got == {"budget", "mode", "fill"} | set(settings_module.PLANNER_SETTINGS)
    assert "codec" not in got and "compile" not in got
