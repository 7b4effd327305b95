"""``import hilore_actor`` needs torch alone: heavy dependencies are imported where used."""

import subprocess
import sys

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
import hilore_actor, hilore_actor.grpo, hilore_actor.runtime, hilore_actor.models, hilore_actor.data, hilore_actor.rollout
import hilore_actor.recovery, hilore_actor.workloads
import hilore_actor.train, hilore_actor.train.config, hilore_actor.train.checkpoint, hilore_actor.learner.coordinator
import hilore_actor.learner.plan, hilore_actor.learner.step, hilore_actor.learner.settings, hilore_actor.train_grpo, hilore_actor.openrlhf, hilore_actor.openrlhf.training_step
import hilore_actor.openrlhf.train_ppo_ray
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
    {"learner", "diagnostics"},
    {"train", "train_grpo", "openrlhf", "bench", "verl", "fidelity"},
]
SAME_APP = {"train_grpo": "train"}  # the job's entry point is part of the training job


def _package_imports():
    """(importing package, imported package, file:line) for every import of hilore_actor's own modules,
    lazy (inside functions) ones included."""
    import ast
    from pathlib import Path

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


def _module_imports(package: str):
    """{module: modules of ``hilore_actor.<package>`` it imports}, lazy and TYPE_CHECKING imports
    included (every ``from .x import`` in the file's syntax tree)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "hilore_actor" / package
    mods = {f.stem for f in root.glob("*.py") if f.stem != "__init__"}
    graph = {}
    for m in mods:
        deps = set()
        for node in ast.walk(ast.parse((root / f"{m}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                deps.add(node.module.split(".")[0])
            elif isinstance(node, ast.ImportFrom) and node.level == 1:
                deps |= {a.name for a in node.names}
        graph[m] = deps & mods
    return graph


def _cycles(graph):
    """Every module that can reach itself, with one path (plain depth-first search)."""
    found = []
    for start in sorted(graph):
        stack = [(start, [start])]
        seen = set()
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    found.append(" -> ".join(path + [start]))
                    stack = []
                    break
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
    return found


def test_no_import_cycle_inside_recovery():
    assert not _cycles(_module_imports("recovery"))


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"engine": {"step"}, "step": {"engine"}, "saved": set()}) == [
        "engine -> step -> engine",
        "step -> engine -> step",
    ]
    assert _cycles({"engine": {"step", "saved"}, "step": {"saved"}, "saved": set()}) == []
