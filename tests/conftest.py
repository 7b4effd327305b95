"""Shared helpers (fresh random packed microbatches, a GRPO loss over them) and the test tiers.

Tiers (markers registered in ``pytest.ini``, assigned here at collection): ``slow`` is set by
hand and is a tier of its own, out of the default run; of the others, ``integration`` is a test
that runs Ray, two or more ranks, a DeepSpeed engine, OpenRLHF or verl, or starts a process (its
module is in ``INTEGRATION_MODULES``, or it, a fixture it uses, or a function under ``tests/``
either calls reaches a name of ``STARTS_PROCESSES``); every other test is ``unit``, and a unit
test that starts a Python process or a ``multiprocessing`` one fails (``_unit_starts_nothing``).
"""

import contextlib
import importlib
import multiprocessing.process
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from hilore_actor.grpo import policy_loss
from hilore_actor.models.logprobs import token_log_probs

# rank and worker helpers (tests/helpers) import as top-level modules, here and in their own processes
sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))


def packed_microbatch(total: int, vocab: int, n_seqs: int = 3, seed=None):
    """One packed row of ``n_seqs`` sequences of random lengths: (input_ids, position_ids)."""
    gen = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    cuts = sorted(torch.randperm(total - 2, generator=gen)[: n_seqs - 1].add(1).tolist())
    lens = [b - a for a, b in zip([0] + cuts, cuts + [total])]
    ids = torch.randint(3, vocab, (1, total), generator=gen)
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    return ids, pos


def grpo_loss(model, ids, pos, seed=0):
    """Forward + the GRPO loss with random advantages, old/ref log-probs and a prompt mask."""
    gen = torch.Generator().manual_seed(seed)
    out = model(input_ids=ids, position_ids=pos, use_cache=False)
    logp = token_log_probs(out.logits[:, :-1], ids[:, 1:])
    old = logp.detach() + 0.1 * torch.randn(logp.shape, generator=gen)
    ref = logp.detach() + 0.1 * torch.randn(logp.shape, generator=gen)
    mask = (torch.rand(logp.shape, generator=gen) > 0.2).float()
    adv = torch.randn(logp.shape, generator=gen)
    loss, _ = policy_loss(logp, old, adv, mask, ref, kl_coef=0.01)
    return loss


def downgrade_peaks(model, loss_of, device: str):
    """H then R after an exact forward, twice (the first pair warms up): per action the peak of
    set_actions + backward (``MemoryMeter`` after the ``downgrade`` mark), and the exact bundle
    bytes held before it. ``loss_of(model)`` runs the forward. Asserts R holds nothing exact."""
    from hilore_actor.recovery import RecoveryEngine
    from hilore_actor.runtime import MemoryMeter

    engine = RecoveryEngine(model)
    peaks = {}
    for action in ["H", "R", "H", "R"]:
        model.zero_grad(set_to_none=True)
        with MemoryMeter(device) as meter:
            with engine.step(None) as step:
                loss = loss_of(model)
                held = step.bytes_by_unit()
                step.set_actions({n: action for n in engine.unit_names})
                meter.mark("downgrade")
                after = step.bytes_by_unit()
                loss.backward()
        peaks[action] = meter.report.peak_since["downgrade"]
        if action == "R":
            assert sum(b["exact"] for b in after.values()) == 0
    engine.detach()
    return peaks, sum(b["exact"] for b in held.values())


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def rel_err(g, ref):
    num = torch.cat([(g[n] - ref[n]).flatten() for n in ref]).norm()
    return float(num / torch.cat([ref[n].flatten() for n in ref]).norm())


@pytest.fixture
def fresh_seed():
    return torch.seed() % 2**31


def bench_setup(arch: str, num_layers: int, n_mbs: int):
    """A tiny LoRA model with LoRA B away from zero, ``n_mbs`` replayed 256-token microbatches,
    and one benchmark runner per head (fresh seed, printed)."""
    from benchmarks.bench.methods import head_runners
    from hilore_actor.models import LoraSpec, build_model, init_lora_b, tiny_config
    from hilore_actor.recovery import RecoveryEngine
    from hilore_actor.workloads import replayed_microbatches

    seed = torch.seed() % 2**31
    print("seed", seed)
    model = build_model(
        tiny_config(arch, hidden_size=64, num_layers=num_layers, vocab_size=4096), lora=LoraSpec(8, 16), seed=seed
    )
    init_lora_b(model, 1e-2, seed)
    model.train()
    return head_runners(model, RecoveryEngine(model)), replayed_microbatches(model, n_mbs, 256, seed=seed)


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory):
    """Three uninterrupted steps of the training job's tiny preset (``train_job.py``), logged to
    W&B offline and evaluated greedily on a held-out file after every step: the reference the
    fault, resume and multi-node tests reproduce (their runs log and evaluate nothing, so they
    also show that neither changes what is learned), and the run the logging test reads."""
    import json

    from train_job import job

    held_out = tmp_path_factory.mktemp("held_out") / "held_out.jsonl"
    held_out.write_text(
        "".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(5))
    )
    out = tmp_path_factory.mktemp("full")
    logged = ["--use_wandb", "--wandb_run_name", "tiny-test", "--eval.dataset", str(held_out)]
    r = job(
        out, "--max_steps", "3", *logged, "--eval.steps", "1", "--eval.max_samples", "3", env={"WANDB_MODE": "offline"}
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out, r


SKIP_REWARDS = """
calls = []
# per step, two groups of four: with --train.batch_size 4 each group is one update, and each rank
# runs one row of two responses per update (sequences 0-1 and 4-5 on rank 0, 2-3 and 6-7 on rank 1)
STEPS = ([1, 0.5, 0, 0.5, 0.5, 0.5, 0, 1], [1, 1, 1, 1, 0, 1, 0, 1], [0, 1, 0.5, 0.5] + [0.25] * 4)


def reward_func(queries, prompts, labels):
    if len(queries) != 8:  # the job's probe before Ray (two prompts): not a step
        return [0.0] * len(queries)
    calls.append(1)
    return STEPS[len(calls) - 1]
"""


@pytest.fixture(scope="session")
def skip_runs(tmp_path_factory):
    """The tiny preset without its KL loss, three steps of two updates each (``--train.batch_size
    4``) whose rewards are known in advance (advantage 0 where a reward is its group's mean).
    Step 1: update 1 shrinks both ranks' rows to one response each, update 2 leaves rank 0
    nothing (a pad); step 2: update 1 trains nothing (a pad per rank), update 2 all; step 3:
    update 1 leaves rank 1 nothing, update 2 trains nothing (pads 1, 2, 3).
    ``on``: the skip on, under ZeRO-3 with B close to gc's peak (a plan that mixes H and R), what
    the skip's test (``tests/train/test_skip.py``) and ZeRO-3's (``test_zero3_ranks_agree_on_every_
    units_action``) check; ``ref``: their reference, none of it under test: gradient checkpointing
    (``--actor_backend gc``) under ZeRO-2, every response trained. H/R gradients are exact, so the
    two runs differ by the reductions' order only."""
    from train_job import job

    root = tmp_path_factory.mktemp("skip")
    reward = root / "rewards.py"
    reward.write_text(SKIP_REWARDS)
    settings = {
        "on": ("--hilore.skip_zero_advantage", "on", "--ds.zero_stage", "3", "--hilore.budget", "1.02"),
        "ref": ("--hilore.skip_zero_advantage", "off", "--actor_backend", "gc"),
    }
    runs = {}
    for setting, more in settings.items():
        out = root / setting
        args = ("--algo.kl.use_loss", "false", "--reward.path", str(reward), "--max_steps", "3")
        r = job(out, *args, "--train.batch_size", "4", *more)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        (out / "driver.log").write_text(r.stdout)  # what the driver said (its start-up lines, its Ray actors)
        runs[setting] = out
    return runs


# the two-rank verl cases (tests/helpers/verl_ranks.py), each read by one test file of tests/verl
VERL_CASES = {"lockstep": "test_verl", "skip": "test_verl_skip", "ulysses": "test_verl_ulysses"}


@pytest.fixture(scope="session")
def verl_ranks(request, tmp_path_factory):
    """``{"seed": seed, case: [rank 0's results, rank 1's]}`` for the ``VERL_CASES`` whose tests
    pytest selected, on one pair of ranks and one tiny model: starting the ranks and importing
    verl cost more than a case (``HILORE_SEED=N`` reruns a printed seed)."""
    pytest.importorskip("verl")
    pytest.importorskip("tensordict")
    import verl_cpu

    seed = int(os.environ.get("HILORE_SEED") or torch.seed() % 2**31)
    files = {item.path.stem for item in request.session.items if "verl_ranks" in getattr(item, "fixturenames", ())}
    cases = [case for case, file in VERL_CASES.items() if file in files]
    ranks = verl_cpu.two_ranks(cases, tmp_path_factory.mktemp("verl_ranks"), seed, timeout=1200, hang_s=600)
    return {"seed": seed, **ranks}


class _Chooser:
    """Stands in for ``RankPlanner.planner``: counts the side passes it was asked to keep state across."""

    def __init__(self):
        self.entered = 0

    @contextlib.contextmanager
    def side_pass(self):
        self.entered += 1
        yield


class FixedPlan:
    """The parts of a ``RankPlanner`` the learner room's sequences use: a fixed plan, its default
    actions, and a record of the tighten and observe calls."""

    def __init__(self, plan, budget=10**12):
        from types import SimpleNamespace

        self.sp, self.budget, self.track_tokens = SimpleNamespace(plan=plan), budget, False
        self.tightened, self.observed, self.planner = [], [], _Chooser()

    def for_tokens(self, tokens):
        return self.sp

    def predicted_peak(self, sp):
        return 0

    def actions(self, step, loss_output, sp=None):
        from hilore_actor.recovery.labels import DEFAULT_ACTION

        return {n: DEFAULT_ACTION[q] for n, q in (sp or self.sp).plan.items()}

    def tighten(self, by_bytes, who="", tokens=None):
        self.tightened.append((by_bytes, tokens))

    def observe(self, predicted_bytes, peak_bytes):
        self.observed.append((predicted_bytes, peak_bytes))


TESTS = Path(__file__).resolve().parent
# whole modules in the integration tier: OpenRLHF's or verl's engines (DeepSpeed, FSDP) in this process
INTEGRATION_MODULES = {"test_openrlhf", "test_openrlhf_zero3", "test_verl", "test_verl_recipes", "test_verl_ulysses"}
# names (globals, attributes, imports) whose use starts processes; pairs named together start Ray or
# a DeepSpeed engine (importing either alone starts nothing)
STARTS_PROCESSES = frozenset({"subprocess", "Popen", "spawn", "spawn_two", "start_processes", "Cluster"})
STARTS_TOGETHER = ({"ray", "init"}, {"deepspeed", "initialize"})


def _of_tests(obj) -> bool:
    """Whether ``obj`` (a function or module) is defined in a file under ``tests/``."""
    path = getattr(getattr(obj, "__code__", None), "co_filename", None) or getattr(obj, "__file__", None)
    return bool(path) and TESTS in Path(path).resolve().parents


def _starts_processes(code, namespace: dict, seen: set) -> bool:
    """Whether ``code``, a function it defines, or a function under ``tests/`` it names (a global,
    an import, or an attribute of a module under ``tests/``) uses a name of ``STARTS_PROCESSES``
    or both names of a pair of ``STARTS_TOGETHER``."""
    if code in seen:
        return False
    seen.add(code)
    names = set(code.co_names)
    if names & STARTS_PROCESSES or any(pair <= names for pair in STARTS_TOGETHER):
        return True
    nested = [(c, namespace) for c in code.co_consts if isinstance(c, types.CodeType)]
    for name in names:
        obj = namespace.get(name, sys.modules.get(name))
        if obj is None and (TESTS / "helpers" / f"{name}.py").is_file():  # a helper a fixture imports when it runs
            obj = importlib.import_module(name)
        if isinstance(obj, types.ModuleType) and _of_tests(obj):
            obj = [getattr(obj, n) for n in names if isinstance(getattr(obj, n, None), types.FunctionType)]
        for f in obj if isinstance(obj, list) else [obj]:
            f = getattr(f, "__wrapped__", f)  # a decorated helper (``contextlib.contextmanager``): its own code
            if isinstance(f, types.FunctionType) and _of_tests(f):
                nested.append((f.__code__, f.__globals__))
    return any(_starts_processes(c, ns, seen) for c, ns in nested)


def tier(item) -> str:
    """``integration`` or ``unit`` (the module docstring)."""
    if item.path.stem in INTEGRATION_MODULES:
        return "integration"
    seen = set()
    fixtures = [d[-1].func for n, d in item._fixtureinfo.name2fixturedefs.items() if d and n != "_unit_starts_nothing"]
    for f in [item.function] + fixtures:
        f = getattr(f, "__wrapped__", f)
        if _of_tests(f) and _starts_processes(f.__code__, f.__globals__, seen):
            return "integration"
    return "unit"


def pytest_collection_modifyitems(config, items):
    for item in items:  # a slow test is in the slow tier only, so `-m unit` and `-m integration` stay fast
        if item.get_closest_marker("slow") is not None:
            continue
        if isinstance(item, pytest.Function) and not any(item.get_closest_marker(m) for m in ("unit", "integration")):
            item.add_marker(tier(item))


def _from_inductor() -> bool:
    """Whether torch.compile's inductor is the caller (its compile workers and build probes)."""
    frame = sys._getframe(2)
    while frame is not None:
        if "torch/_inductor/" in frame.f_code.co_filename.replace("\\", "/"):
            return True
        frame = frame.f_back
    return False


def _refused(what: str):
    raise RuntimeError(f"a unit test starts {what}: mark it integration (tests/conftest.py's INTEGRATION_MODULES)")


@pytest.fixture(autouse=True)
def _unit_starts_nothing(request, monkeypatch):
    """A unit test may not start a Python process (torch.compile's own workers aside) nor a
    ``multiprocessing`` one: the tier stays in one process."""
    if request.node.get_closest_marker("unit") is None:
        yield
        return
    popen, start = subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start

    def guarded_popen(self, args, *rest, **kwargs):
        argv = [str(a) for a in ([args] if isinstance(args, (str, bytes, Path)) else args)]
        python = argv and (argv[0] == sys.executable or Path(argv[0].split()[0]).name.startswith("python"))
        if python and not _from_inductor():
            _refused(f"a Python process ({' '.join(argv)[:200]})")
        popen(self, args, *rest, **kwargs)

    def guarded_start(self):
        if not _from_inductor():
            _refused("a multiprocessing process")
        start(self)

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded_popen)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", guarded_start)
    yield
