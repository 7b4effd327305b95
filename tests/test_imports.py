"""``import hilore_actor`` needs torch alone: heavy dependencies are imported where used."""

import subprocess
import sys
from pathlib import Path

HEAVY = [
    "transformers",
    "peft",
    "deepspeed",
    "ray",
    "vllm",
    "flash_attn",
    "openrlhf",
    "reasoning_gym",
    "math_verify",
    "matplotlib",
    "verl",
    "tensordict",
    "hydra",
]

BLOCKER = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {blocked!r}:
            raise ImportError('blocked for this test: ' + name)
sys.meta_path.insert(0, Block())
import hilore_actor, hilore_actor.grpo, hilore_actor.runtime, hilore_actor.models, hilore_actor.data
import hilore_actor.rollout, hilore_actor.recovery, hilore_actor.workloads
import hilore_actor.train, hilore_actor.train.config, hilore_actor.train.checkpoint, hilore_actor.learner.coordinator
import hilore_actor.learner.plan, hilore_actor.learner.microbatch_run, hilore_actor.learner.settings
import hilore_actor.train_grpo, hilore_actor.openrlhf, hilore_actor.openrlhf.training_step
import hilore_actor.openrlhf.train_ppo_ray, hilore_actor.report.page, hilore_actor.report.__main__
import hilore_actor.verl, hilore_actor.verl.settings, hilore_actor.verl.main_ppo, hilore_actor.verl.token_weights
import hilore_actor.verl.microbatches
import hilore_actor.grpo as g, torch
s = torch.randn(2, 3, requires_grad=True)
loss, _ = g.policy_loss(s, s.detach(), torch.ones(2))
print('ok')
"""


def test_package_imports_with_only_torch():
    code = BLOCKER.format(blocked=set(HEAVY))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# The floors of the package, lowest first: a module imports only from lower floors (or its own
# package). The integrations share the learner room and never import one another.
FLOORS = [
    {"runtime", "models", "recovery"},
    {"grpo", "data"},
    {"rollout", "workloads"},
    {"allocation"},
    {"learner"},
    {"estimate"},  # a plan before the run: the learner layer on the meta device
    {"train", "train_grpo", "report", "openrlhf", "verl"},
]
# the job's entry point and the report of its run folder (which reads the job's files, and whose
# pictures the job draws per step) are part of the training job
SAME_APP = {"train_grpo": "train", "report": "train"}


def _package_imports():
    """(importing package, imported package, file:line) for every import of hilore_actor's own modules,
    lazy (inside functions) ones included."""
    import ast

    root = Path(__file__).resolve().parents[1] / "hilore_actor"
    for f in root.rglob("*.py"):
        parts = f.relative_to(root).parts
        here = parts[0] if len(parts) > 1 else parts[0][:-3]
        for node in ast.walk(ast.parse(f.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level == 0:
                if not (node.module or "").startswith("hilore_actor."):
                    continue
                target = node.module.split(".")[1]
            elif node.level == len(parts):  # from the package root: from ..x import y
                target = node.module.split(".")[0] if node.module else node.names[0].name
            else:
                target = here
            if target != here and target != "":
                yield here, target, f"{f.relative_to(root.parent)}:{node.lineno}"


def test_no_upward_imports_and_integrations_stay_apart():
    floor = {p: i for i, ps in enumerate(FLOORS) for p in ps}
    bad = []
    for here, target, where in _package_imports():
        a, b = SAME_APP.get(here, here), SAME_APP.get(target, target)
        if a == b or "__init__" in (here, target):
            continue
        assert here in floor and target in floor, f"{where}: {here} -> {target}: give the package a floor in FLOORS"
        if floor[target] >= floor[here]:
            bad.append(f"{where}: {here} (floor {floor[here]}) imports {target} (floor {floor[target]})")
    assert not bad, "imports that go up or sideways:\n" + "\n".join(bad)


def test_the_graph_check_sees_lazy_imports():
    seen = {(h, t) for h, t, _ in _package_imports()}
    assert ("openrlhf", "learner") in seen and ("train", "learner") in seen  # lazy, inside functions
    assert ("recovery", "allocation") not in seen


SKIP_DIRS = {"build", "dist", "patches", "__pycache__"}  # patches: sources of other projects, applied to them


def _dotted(root: Path, f: Path) -> str:
    """The name a file is imported by: its path from the nearest folder above it that is not a
    package (no ``__init__.py``), so ``hilore_actor/train/config.py`` is ``hilore_actor.train.config``,
    a package's ``__init__.py`` is the package, and a helper in ``tests/`` is its bare stem, as the
    tests import it (pytest puts that folder on ``sys.path``)."""
    parts = [f.stem] if f.name != "__init__.py" else []
    d = f.parent
    while (d / "__init__.py").is_file() and d != root:
        parts.insert(0, d.name)
        d = d.parent
    return ".".join(parts)


def _modules(root: Path) -> dict:
    """{module name: file} for every Python file of the repository (``_dotted``); a second file
    of one name (the ``conftest.py`` of two test folders) is known by its path."""
    out = {}
    for f in sorted(root.rglob("*.py")):
        if any(p.startswith(".") or p in SKIP_DIRS or p.endswith(".egg-info") for p in f.relative_to(root).parts[:-1]):
            continue
        name = _dotted(root, f)
        if name:
            out[name if name not in out else str(f.relative_to(root))] = f
    return out


def _import_graph(root: Path) -> dict:
    """{module: {imported module: "file:line"}} over the repository's own modules.

    Every import statement in a file's syntax tree counts: at module level, inside functions
    and under ``if TYPE_CHECKING``. ``import a.b.c`` is an edge to ``a.b.c``; ``from a.b import
    c`` is an edge to the submodule ``a.b.c`` where ``c`` is one, else to ``a.b`` (the module,
    or the package's ``__init__.py``). Relative imports resolve against the file's package. A
    package's ``__init__.py`` importing its own submodules is an edge like any other, so a
    submodule that takes a name from its package's ``__init__`` (which imports that submodule)
    closes a cycle; the parents that ``import a.b.c`` initialises on the way are not edges (else
    every absolute import of a sibling would tie it to the package's re-exports). Imports of
    other projects are left out, as are ``importlib.import_module`` calls (not statements)."""
    import ast

    mods = _modules(root)
    graph = {m: {} for m in mods}
    for mod, f in mods.items():
        dotted = _dotted(root, f)
        package = dotted if f.name == "__init__.py" else dotted.rpartition(".")[0]
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".") if package else []
                    up = up[: len(up) - (node.level - 1)] if node.level > 1 else up
                    base = ".".join([*up, *([node.module] if node.module else [])])
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for name in targets:
                while name and name not in mods:  # import a.b.c of a module a.b defines no further
                    name = name.rpartition(".")[0]
                if name and name != mod:
                    graph[mod].setdefault(name, f"{f.relative_to(root)}:{node.lineno}")
    return graph


def _cycles(graph: dict) -> list:
    """One cycle through each group of modules that import one another (a strongly connected
    component with more than one module), as ``a -> b -> a``, its edges with their lines."""
    index, low, stack, on, groups = {}, {}, [], set(), []

    def visit(v):  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    found = []
    for group in groups:
        start = min(group)
        paths, queue = {start: [start]}, [start]  # shortest way back to start inside the group
        while queue:
            v = queue.pop(0)
            for w in sorted(graph[v]):
                if w == start:
                    path = paths[v] + [start]
                    queue = []
                    break
                if w in group and w not in paths:
                    paths[w] = paths[v] + [w]
                    queue.append(w)
        edges = "\n".join(f"    {a} -> {b} ({graph[a][b]})" for a, b in zip(path, path[1:]))
        found.append(f"{' -> '.join(path)} (of {len(group)} modules: {', '.join(sorted(group))})\n{edges}")
    return found


def test_no_import_cycle_in_the_repository():
    """The package, the benchmarks, the tests' helpers and every other Python file: the modules
    import one another one way only."""
    cycles = _cycles(_import_graph(Path(__file__).resolve().parents[1]))
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_cycle_check_finds_cycles(tmp_path):
    files = {
        "pkg/__init__.py": "from .a import f\n",
        "pkg/a.py": "def f():\n    from . import b\n",  # lazy, relative, a submodule by name
        "pkg/b.py": "import pkg.c\n",
        "pkg/c.py": "from pkg.a import f\nimport os\n",  # closes pkg.a -> pkg.b -> pkg.c -> pkg.a
        "pkg/d.py": "from pkg import f\n",  # a name of __init__, which imports pkg.a, not pkg.d
        "pkg/sub/__init__.py": "",
        "pkg/sub/e.py": "from .. import d\nfrom ..sub import e\n",  # level 2; itself: no edge
        "helper.py": "import pkg.sub.e\n",
        "test_x.py": "from helper import *\n",
        "more/helper.py": "import pkg.d\n",  # a second "helper": known by its path, its imports still read
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = _import_graph(tmp_path)
    assert {m: set(d) for m, d in graph.items()} == {
        "pkg": {"pkg.a"},
        "pkg.a": {"pkg.b"},
        "pkg.b": {"pkg.c"},
        "pkg.c": {"pkg.a"},
        "pkg.d": {"pkg"},
        "pkg.sub": set(),
        "pkg.sub.e": {"pkg.d"},
        "helper": {"pkg.sub.e"},
        "test_x": {"helper"},
        "more/helper.py": {"pkg.d"},
    }
    (cycle,) = _cycles(graph)
    assert cycle.startswith("pkg.a -> pkg.b -> pkg.c -> pkg.a (of 3 modules: pkg.a, pkg.b, pkg.c)")
    assert "pkg.c -> pkg.a (pkg/c.py:1)" in cycle
    (tmp_path / "pkg/a.py").write_text("def f():\n    pass\n")
    assert _cycles(_import_graph(tmp_path)) == []
    (tmp_path / "pkg/a.py").write_text("from pkg import sub\n")  # a subpackage: an edge to pkg.sub, not to pkg
    assert _cycles(_import_graph(tmp_path)) == []
    (tmp_path / "pkg/a.py").write_text("from pkg import f\n")  # a name of pkg's __init__, which imports pkg.a
    assert _cycles(_import_graph(tmp_path))[0].startswith("pkg -> pkg.a -> pkg")
