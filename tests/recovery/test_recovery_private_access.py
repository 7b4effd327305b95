"""No module of ``hilore_actor/recovery/`` reads or writes another module's object's underscore-named attribute.

What counts: an underscore name (``_x``, not a dunder) that hilore_actor's own code defines in some
module, used by a recovery module that is not that one, on an object other than ``self`` / ``cls``:

- defined: a name assigned on ``self`` / ``cls`` in a class (``self._x = ...``), a class-body name
  (method, class attribute, field, ``__slots__`` entry), or a module-level name (``mod._x``);
- used: an attribute read, write or delete (``obj._x``), ``getattr`` / ``setattr`` / ``hasattr`` /
  ``delattr`` with a literal ``"_x"``, or ``from <hilore_actor module> import _x``.

Underscore attributes of torch, transformers or DeepSpeed objects (``t._base``, ``torch._C``,
``module._forward_hooks``, ``module._gradient_checkpointing_func``) are not hilore_actor's and stay
allowed: the engine works at torch's level, and these are the names torch and HF give those parts.
A name defined both by hilore_actor and by a library (none today) would be flagged: rename ours.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

PACKAGE = Path(__file__).resolve().parents[2] / "hilore_actor"
RECOVERY = PACKAGE / "recovery"
ACCESSORS = ("getattr", "setattr", "hasattr", "delattr")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _literal_accessor(node: ast.AST):
    """(object, name) of ``getattr(obj, "_x", ...)`` and its kin, else None."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ACCESSORS
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    ):
        return node.args[0], node.args[1].value
    return None


def defined_names(tree: ast.Module) -> Set[str]:
    """The underscore names one module's code defines (module level, class bodies, ``self._x``)."""
    out: Set[str] = set()

    def targets(node):
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            ts = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in ts:
                yield from (n for n in ast.walk(t) if isinstance(n, (ast.Name, ast.Attribute)))

    def top(body):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(node.name)
            for t in targets(node):
                if isinstance(t, ast.Name):
                    out.add(t.id)
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets
            ):
                out.update(c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant))

    top(tree.body)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            top(node.body)
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)) and _is_self(node.value):
            out.add(node.attr)
        acc = _literal_accessor(node)
        if acc is not None and node.func.id == "setattr" and _is_self(acc[0]):
            out.add(acc[1])
    return {n for n in out if isinstance(n, str) and _private(n)}


def definitions() -> Dict[str, Set[Path]]:
    """Underscore name -> the hilore_actor modules that define it."""
    out: Dict[str, Set[Path]] = {}
    for path in PACKAGE.rglob("*.py"):
        for name in defined_names(ast.parse(path.read_text(), str(path))):
            out.setdefault(name, set()).add(path)
    return out


def violations(path: Path, source: str, defined: Dict[str, Set[Path]]) -> List[str]:
    """Each use in ``source`` (the module at ``path``) of an underscore name another module defines."""
    out = []

    def foreign(name: str) -> bool:
        return _private(name) and bool(defined.get(name, set()) - {path})

    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.Attribute) and not _is_self(node.value) and foreign(node.attr):
            out.append(f"{path.name}:{node.lineno}: .{node.attr}")
        acc = _literal_accessor(node)
        if acc is not None and not _is_self(acc[0]) and foreign(acc[1]):
            out.append(f"{path.name}:{node.lineno}: {node.func.id}(..., {acc[1]!r})")
        if isinstance(node, ast.ImportFrom) and (node.level > 0 or (node.module or "").startswith("hilore_actor")):
            out += [f"{path.name}:{node.lineno}: import {a.name}" for a in node.names if _private(a.name)]
    return out


def test_no_recovery_module_reaches_into_another_modules_private_attributes():
    defined = definitions()
    found = [v for path in sorted(RECOVERY.glob("*.py")) for v in violations(path, path.read_text(), defined)]
    assert not found, "underscore attributes of other hilore_actor modules' objects:\n" + "\n".join(found)


def test_the_check_sees_a_reach_in():
    """The checker flags what the rule forbids (so a pass above means something): a read, a write
    and a literal ``getattr`` of another module's private attribute, and a private import."""
    defined = {"_step": {PACKAGE / "other.py"}, "_depth": {PACKAGE / "other.py"}}
    src = (
        "from .other import _depth\n"
        "def f(eng, st):\n"
        "    if eng._step is not st:\n"
        "        st.engine._step = None\n"
        "    return getattr(eng, '_depth')\n"
        "class A:\n"
        "    def g(self):\n"
        "        return self._step, self._depth\n"
    )
    found = violations(RECOVERY / "probe.py", src, defined)
    assert len(found) == 4, found
