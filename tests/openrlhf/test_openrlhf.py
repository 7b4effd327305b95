"""HiLoRe inside real OpenRLHF 0.11.2 code, on CPU.

Runs OpenRLHF's own ``Actor`` (no sample packing), ``PolicyLoss``, ``compute_approx_kl`` and
``ActorPPOTrainer.training_step`` (the real method, on a trainer whose strategy is a
single-process stand-in: backward = ``loss.backward()``, no optimizer step) with a tiny model,
and its CLI's argparse block. vllm and flash_attn are import-time shims (``openrlhf_shims.py``):
no code of theirs runs here. What needs a GPU (DeepspeedStrategy, vLLM, the Ray trainer) is not
run; the README says so.
"""

import os
import shutil
from hilore_actor.runtime.distributed import free_port
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import openrlhf_shims
from hilore_actor.models import LoraSpec, build_model, tiny_config
from hilore_actor.openrlhf.train_ppo_ray import PluginError, main, run_cli_main, split_flags
from planning import plan_on_cpu  # tests/helpers

ROOT = Path(__file__).resolve().parents[2]
RECIPE = [
    "--actor.model_name_or_path",
    "/models/Qwen2.5-3B-Instruct",
    "--data.prompt_dataset",
    "/data/math.jsonl",
    "--rollout.n_samples_per_prompt",
    "8",
    "--algo.advantage.estimator",
    "group_norm",
    "--algo.kl.use_loss",
    "--algo.kl.estimator",
    "k3",
    "--ds.lora.rank",
    "16",
    "--ds.packing_samples",
    "--vllm.num_engines",
    "1",
    "--actor.num_gpus_per_node",
    "2",
    "--rollout.batch_size",
    "8",
    "--train.batch_size",
    "64",
    "--rollout.micro_batch_size",
    "4",
    "--train.micro_batch_size",
    "4",
    "--actor.gradient_checkpointing_enable",
]


@pytest.fixture(scope="module")
def orl():
    openrlhf_shims.install()
    import openrlhf.trainer.ray.ppo_actor as ppo_actor

    yield ppo_actor
    openrlhf_shims.uninstall()


@pytest.fixture
def eager():
    """OpenRLHF compiles its entropy; eager is enough here (``config.patch``: monkeypatching
    the config module's attribute would delete it on undo)."""
    with torch._dynamo.config.patch(disable=True):
        yield


def _trainer(ppo_actor, actor):
    from hilore_actor.openrlhf.verify import single_process_trainer

    return single_process_trainer(actor)  # OpenRLHF's ActorPPOTrainer; strategy: loss.backward(), no step


def _experience(seed):
    from hilore_actor.openrlhf.verify import experience

    return experience(seed, B=4, P=12, A=20, vocab=128)


def _grads(model):
    return torch.cat([p.grad.detach().flatten().clone() for p in model.parameters() if p.requires_grad])


def _run(trainer, exp):
    for p in trainer.actor.parameters():
        p.grad = None
    from hilore_actor.openrlhf.verify import loss_batch_info

    torch.manual_seed(0)
    out = trainer.training_step(exp, 0.01, 0, loss_batch_info(exp))
    return _grads(trainer.actor), out


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_hr_gradients_equal_openrlhf_gradient_checkpointing(orl, arch):
    """OpenRLHF's training_step with its own gradient checkpointing vs the same step under
    HiLoRe (allocator's H/R plan, and a random H/R map): bitwise equal gradients."""
    from openrlhf.models import Actor

    from hilore_actor.learner.coordinator import BudgetCoordinator
    from hilore_actor.learner.settings import hilore_settings
    from hilore_actor.openrlhf.training_step import HiLoReTrainingStep
    from hilore_actor.recovery import RecoveryEngine

    seed = torch.seed() % 2**31
    model = build_model(tiny_config(arch, hidden_size=64, num_layers=4, vocab_size=128), lora=LoraSpec(8, 16), seed=0)
    actor = Actor(model)
    actor.packing_samples = False  # set by Actor(str) from --ds.packing_samples; packing needs flash_attn
    exp = _experience(seed)

    trainer = _trainer(orl, actor)
    actor.gradient_checkpointing_enable()  # OpenRLHF's own gradient checkpointing
    g_gc, out_gc = _run(trainer, exp)
    actor.gradient_checkpointing_disable()
    g_plain, _ = _run(trainer, exp)
    assert torch.equal(g_gc, g_plain)

    hcfg = hilore_settings(mode="hilore-hr", budget="1.3", profile_repeats=1)
    plan = plan_on_cpu(model, hcfg, exp.sequences.numel(), 4, seed)
    engine = RecoveryEngine(actor.model)
    co = BudgetCoordinator()
    co.register(0, 10**12)
    wrapper = HiLoReTrainingStep(plan, engine, co)
    wrapper.install(trainer)
    g_hl, out_hl = _run(trainer, exp)
    assert torch.equal(g_hl, g_gc)
    assert set(wrapper.last["actions"]) == set(engine.unit_names) and set(wrapper.last["actions"].values()) <= {
        "H",
        "R",
    }
    assert (
        "hilore_peak_over_budget" in out_hl["metrics"]
        and out_hl["metrics"]["policy_loss"] == out_gc["metrics"]["policy_loss"]
    )
    rng = torch.Generator().manual_seed(seed)
    plan.sp.plan = {
        n: ("exact", "checkpoint")[int(torch.randint(0, 2, (1,), generator=rng))] for n in engine.unit_names
    }
    g_mixed, _ = _run(trainer, exp)
    assert torch.equal(g_mixed, g_gc)
    assert co.step_record(0)["0"]["microbatches"] == 2


def test_online_actions_come_from_openrlhf_loss(orl):
    """Mode hilore: omega from OpenRLHF's loss (autograd through PolicyLoss + KL) drives the
    risk; with zero advantages and no KL every token's omega is 0, so no unit carries risk and
    every compressible unit may be L; gradients stay close to exact."""
    from openrlhf.models import Actor

    from hilore_actor.learner.settings import hilore_settings
    from hilore_actor.openrlhf.training_step import HiLoReTrainingStep
    from hilore_actor.recovery import RecoveryEngine

    seed = torch.seed() % 2**31
    model = build_model(
        tiny_config("qwen2", hidden_size=64, num_layers=4, vocab_size=128), lora=LoraSpec(8, 16), seed=0
    )
    actor = Actor(model)
    actor.packing_samples = False
    exp = _experience(seed)
    trainer = _trainer(orl, actor)
    g_ref, _ = _run(trainer, exp)
    hcfg = hilore_settings(calibration_batches=2, profile_repeats=1, budget="1.3")
    plan = plan_on_cpu(model, hcfg, exp.sequences.numel(), 4, seed)
    wrapper = HiLoReTrainingStep(plan, RecoveryEngine(actor.model))
    wrapper.install(trainer)
    g, _ = _run(trainer, exp)
    assert float((g - g_ref).norm() / g_ref.norm()) < 0.05
    seen = {}
    real = wrapper.plan.actions
    wrapper.plan.actions = lambda st, out, sp=None: (
        seen.setdefault("omega", out.omega) is not None and real(st, out, sp)
    )
    _run(trainer, exp)
    omega = seen["omega"]
    assert omega.shape == (4, exp.sequences.shape[1] - 1)
    resp = torch.zeros_like(omega, dtype=torch.bool)
    resp[:, -exp.action_mask.shape[1] :] = exp.action_mask
    assert (omega[~resp] == 0).all() and (omega[resp] != 0).any()


def test_split_flags():
    backend, h, rest = split_flags(
        ["--a", "1", "--actor_backend", "hilore", "--hilore.budget=1.2", "--b", "--hilore.mode", "hilore-hr"]
    )
    assert backend == "hilore" and h == {"budget": "1.2", "mode": "hilore-hr"} and rest == ["--a", "1", "--b"]
    assert split_flags(["--actor.backend", "deepspeed"])[0] == "deepspeed"
    with pytest.raises(PluginError, match="choose one of deepspeed, hilore"):
        split_flags(["--actor_backend", "fast"])
    with pytest.raises(PluginError, match="needs a value"):
        split_flags(["--hilore.budget"])


def test_real_cli_parses_the_recipe(orl):
    """OpenRLHF's own argparse block and validation, up to the call of ``train``."""
    import openrlhf.cli.train_ppo_ray as cli

    seen = {}
    backend, h, rest = split_flags(RECIPE + ["--actor_backend", "hilore", "--hilore.budget", "1.2"])
    run_cli_main(cli, rest, lambda args: seen.setdefault("args", args))
    args = seen["args"]
    assert args.actor.model_name_or_path == "/models/Qwen2.5-3B-Instruct" and args.rollout.n_samples_per_prompt == 8
    assert args.algo.advantage.estimator == "group_norm" and args.ds.lora.rank == 16
    assert args.actor.eps_clip_low_high == (0.2, 0.2)  # set by OpenRLHF's validation code
    with pytest.raises(PluginError, match="OpenRLHF rejected the flags: group_norm requires n_samples_per_prompt > 1"):
        run_cli_main(cli, [a if a != "8" else "1" for a in rest], lambda args: None)


def test_plugin_without_gpu_fails_with_a_message(orl, capsys):
    assert not torch.cuda.is_available()
    assert main(RECIPE + ["--actor_backend", "hilore", "--hilore.mode", "hilore-hr"]) == 2
    err = capsys.readouterr().err
    assert "needs CUDA" in err and "Traceback" not in err
    assert main(RECIPE + ["--actor_backend", "hilore", "--hilore.budget", "lots"]) == 2
    assert "cannot read budget" in capsys.readouterr().err
    assert main(RECIPE + ["--hilore.mode", "hilore-hr"]) == 2
    assert "need --actor_backend hilore" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # argparse's own answer to an unknown flag
        main(RECIPE + ["--actor_backend", "hilore", "--actor.no_such_flag", "1"])
    assert e.value.code == 2


@pytest.mark.parametrize(
    "ds, settings, message",
    [
        ({"ring_attn_size": 2}, {}, "ring attention puts collectives"),
        ({"tensor_parallel_size": 2}, {}, "AutoTP puts collectives"),
        ({"zero_stage": 3}, {"compile": True}, "hooks that torch.compile would trace"),
    ],
)
def test_unsupported_parallelism_stops_with_one_message(ds, settings, message):
    """Ring attention (OpenRLHF's sequence parallelism), AutoTP and compiled units under ZeRO-3
    are refused before Ray starts, each with the reason (ZeRO-3 runs:
    ``test_openrlhf_zero3.py``)."""
    from types import SimpleNamespace

    from hilore_actor.openrlhf.train_ppo_ray import use_hilore

    args = SimpleNamespace(
        ds=SimpleNamespace(**dict({"zero_stage": 2, "ring_attn_size": 1, "tensor_parallel_size": 1}, **ds))
    )
    with pytest.raises(PluginError, match=message):
        use_hilore(args, settings)


def test_plugin_without_openrlhf_fails_with_a_message(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "openrlhf" else real(name, *a))
    assert main(["--actor_backend", "hilore"]) == 2
    assert "OpenRLHF is not installed" in capsys.readouterr().err


def _our_flags_in(text):
    from hilore_actor.learner.settings import HILORE_FLAGS

    missing = [f"--{name}" for name, *_ in HILORE_FLAGS if f"--{name} " not in text]
    return "--actor_backend {deepspeed,hilore}" in text and not missing


def test_help_lists_openrlhfs_flags_and_ours_without_vllm():
    """``python -m hilore_actor.openrlhf.train_ppo_ray --help`` exits 0 where vllm cannot be
    imported (blocked here, as on any CPU machine): OpenRLHF's parser is built from its CLI's
    source, the module (which imports vllm) not imported, with ``--actor_backend`` and every
    ``--hilore.*`` flag as one more group."""
    run = (
        "import runpy, sys; sys.modules['vllm'] = sys.modules['flash_attn'] = None; "
        "sys.argv = ['train_ppo_ray', '--help']; "
        "runpy.run_module('hilore_actor.openrlhf.train_ppo_ray', run_name='__main__')"
    )
    done = subprocess.run([sys.executable, "-c", run], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "Traceback" not in done.stdout + done.stderr, done.stderr
    out = done.stdout
    assert out.startswith("usage: python -m hilore_actor.openrlhf.train_ppo_ray")
    assert "--actor.model_name_or_path" in out and "--vllm.num_engines" in out and "note:" not in out  # OpenRLHF's own
    assert _our_flags_in(out) and "(default: 1.10)" in out


def test_help_without_openrlhf_lists_ours_and_says_why(monkeypatch, capsys):
    """Without OpenRLHF ``--help`` still exits 0: our group, then one line saying what is missing."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "openrlhf" else real(name, *a))
    assert main(["--actor_backend", "hilore", "--help"]) == 0
    out = capsys.readouterr().out
    assert _our_flags_in(out) and out.strip().splitlines()[-1].startswith("note: OpenRLHF is not installed")


def test_openrlhfs_gradient_checkpointing_is_replaced_with_one_line(orl, monkeypatch, actor_env):
    """``--actor.gradient_checkpointing_enable`` (in OpenRLHF's recipes) is accepted: the actor
    turns it off before OpenRLHF builds the model, and says so in one line."""
    from hilore_actor.openrlhf import policy_actor as pa

    seen, printed = {}, []
    monkeypatch.setattr(pa, "has_cuda", lambda: True)
    monkeypatch.setattr(
        orl.PolicyModelActor.__ray_actor_class__,
        "init_model_from_pretrained",
        lambda self, st, *a, **k: seen.setdefault("gc", st.args.actor.gradient_checkpointing_enable),
    )
    st = _strategy_stub([])
    st.print = printed.append
    st.args.actor.gradient_checkpointing_enable = True
    object.__new__(pa._HiLoRePolicyModelActor).init_model_from_pretrained(st, "/models/any")
    assert seen == {"gc": False}
    assert printed == ["[hilore] --actor.gradient_checkpointing_enable is replaced by HiLoRe's per-unit recompute"]


def test_patch_applies_to_the_release_and_adds_the_flag(orl, tmp_path):
    from importlib.metadata import version

    import openrlhf.cli.train_ppo_ray as cli

    assert version("openrlhf") == "0.11.2"
    dst = tmp_path / "openrlhf" / "cli"
    dst.mkdir(parents=True)
    shutil.copy(cli.__file__, dst / "train_ppo_ray.py")
    patch = ROOT / "patches" / "openrlhf-0.11.2-actor-backend.patch"
    r = subprocess.run(["git", "apply", "-v", str(patch)], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    patched = dst / "train_ppo_ray.py"
    seen = {}
    with pytest.raises(PluginError, match="needs CUDA"):  # the patched block dispatched to use_hilore
        run_cli_main(
            cli,
            RECIPE + ["--actor_backend", "hilore", "--hilore.budget", "1.2"],
            lambda args: seen.setdefault("args", args),
            path=str(patched),
        )
    assert "args" not in seen
    with pytest.raises(SystemExit):
        run_cli_main(cli, RECIPE + ["--actor_backend", "fast"], lambda args: None, path=str(patched))
    run_cli_main(cli, RECIPE, lambda args: seen.setdefault("args", args), path=str(patched))
    assert (
        seen["args"].actor_backend == "deepspeed" and seen["args"].hilore.budget is None
    )  # unset: the table's default
    # the patched CLI refuses exactly what the launcher refuses (one table, one check)
    for bad, message in (
        (["--hilore.budget", "lots"], "cannot read budget"),
        (["--hilore.codec", "int4"], "--hilore.codec"),
        (["--hilore.loo", "maybe"], "expected true|false"),
    ):
        with pytest.raises(PluginError, match=message):
            run_cli_main(cli, RECIPE + ["--actor_backend", "hilore"] + bad, lambda args: None, path=str(patched))
        assert main(RECIPE + ["--actor_backend", "hilore"] + bad) == 2


def test_gpu_verification_script_says_it_needs_a_gpu():
    from hilore_actor.openrlhf.verify import main as verify

    with pytest.raises(SystemExit, match="runs on a GPU"):
        verify([])


def test_example_recipe_parses_with_openrlhfs_cli(orl):
    """examples/openrlhf_grpo_hilore.sh: OpenRLHF's own parser and validation accept its flags."""
    import shlex

    import openrlhf.cli.train_ppo_ray as cli

    text = (ROOT / "examples" / "openrlhf_grpo_hilore.sh").read_text()
    cmd = text.split("-- python3 -m hilore_actor.openrlhf.train_ppo_ray", 1)[1].split("\n#")[0]
    argv = shlex.split(cmd.replace("\\\n", " ").replace('"$MODEL"', "/models/qwen").replace('"$DATA"', "/data/m.jsonl"))
    backend, h, rest = split_flags(argv)
    assert backend == "hilore" and h == {"budget": "1.10", "calibration_batches": "16"}
    seen = {}
    run_cli_main(cli, rest, lambda args: seen.setdefault("args", args))
    a = seen["args"]
    assert (a.rollout.n_samples_per_prompt, a.algo.advantage.estimator, a.ds.lora.rank, a.ds.packing_samples) == (
        8,
        "group_norm",
        16,
        True,
    )


def test_entropy_term_weighs_its_tokens(orl, eager):
    """With ``--actor.entropy_coef`` set, OpenRLHF's loss has an entropy term that reaches the
    weights through the full logits: its per-token weight (autograd of the same loss) is added
    to the exposure weight; omega stays autograd of the loss w.r.t. the log-probs."""
    from openrlhf.models import Actor

    from hilore_actor.learner.settings import hilore_settings
    from hilore_actor.openrlhf.training_step import HiLoReTrainingStep
    from hilore_actor.recovery import RecoveryEngine

    seed = torch.seed() % 2**31
    print("seed", seed)
    model = build_model(
        tiny_config("qwen2", hidden_size=64, num_layers=2, vocab_size=128), lora=LoraSpec(8, 16), seed=0
    )
    actor = Actor(model)
    actor.packing_samples = False
    exp = _experience(seed)
    trainer = _trainer(orl, actor)
    trainer.args.actor.entropy_coef = 0.05
    hcfg = hilore_settings(mode="hilore", budget="1.3", calibration_batches=2, profile_repeats=1, loo=False)
    plan = plan_on_cpu(model, hcfg, exp.sequences.numel(), 4, seed)
    seen = {}
    real = plan.actions
    plan.actions = lambda st, out, sp=None: seen.setdefault("weight", out.omega) is not None and real(st, out, sp)
    wrapper = HiLoReTrainingStep(plan, RecoveryEngine(actor.model))
    wrapper.install(trainer)
    _, out = _run(trainer, exp)
    omega, eta = wrapper.weights["omega"], wrapper.weights["eta"]
    assert eta is not None and "entropy_loss" in out["metrics"]
    resp = torch.zeros_like(omega, dtype=torch.bool)
    resp[:, -exp.action_mask.shape[1] :] = exp.action_mask
    assert (eta[~resp] == 0).all() and (eta[resp] != 0).all()
    assert torch.equal(seen["weight"], omega.abs() + eta.abs())
    trainer.args.actor.entropy_coef = None  # no entropy term: the weight is omega itself
    seen.clear()
    _run(trainer, exp)
    assert wrapper.weights["eta"] is None and torch.equal(seen["weight"], wrapper.weights["omega"])


def test_chunked_head_matches_openrlhfs_forward_with_a_lower_peak(orl, eager):
    """``--hilore.chunked_head``: OpenRLHF's ``Actor.forward`` replaced by the chunked head
    (temperature 0.7, entropy returned): action log-probs and entropies within 1e-5 of
    OpenRLHF's own, gradients of its whole training step (entropy term on) close, and the
    measured peak of that step lower."""
    from openrlhf.models import Actor

    from hilore_actor.openrlhf.actor_forward import install
    from hilore_actor.runtime import MemoryMeter

    seed = torch.seed() % 2**31
    print("seed", seed)
    vocab = 4096  # the head's logits dominate, as in a real model
    model = _lora_model(seed, vocab=vocab, layers=2)
    from hilore_actor.openrlhf.verify import experience

    exp = experience(seed, B=4, P=24, A=40, vocab=vocab)
    actor = Actor(model, temperature=0.7)
    actor.packing_samples = False
    trainer = _trainer(orl, actor)
    trainer.args.actor.entropy_coef = 0.01
    args = (exp.sequences, exp.action_mask)
    kw = dict(attention_mask=exp.attention_mask, return_output=True, return_entropy=True)
    with torch.no_grad():
        lp_ref, out_ref = actor(*args, **kw)

    def step():
        with MemoryMeter(torch.device("cpu")) as meter:
            g, out = _run(trainer, exp)
        return g, out, meter.report.peak_bytes

    g_ref, m_ref, peak_ref = step()
    install(actor)
    with torch.no_grad():
        lp, out = actor(*args, **kw)
    torch.testing.assert_close(lp, lp_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.entropy, out_ref.entropy, rtol=0, atol=1e-5)
    g, m, peak = step()
    rel = float((g - g_ref).norm() / g_ref.norm())
    print(
        f"gradient relative difference {rel:.2e}; peak {peak / 2**20:.1f} MiB vs OpenRLHF's {peak_ref / 2**20:.1f} MiB"
    )
    assert rel < 1e-4
    assert float(m["metrics"]["entropy_loss"]) == pytest.approx(float(m_ref["metrics"]["entropy_loss"]), abs=1e-5)
    assert peak < peak_ref
    # no action mask: OpenRLHF's own forward (it returns the logits)
    full = actor(exp.sequences, attention_mask=exp.attention_mask, return_output=True)
    assert full["logits"].shape == (4, 64, vocab)


def _lora_model(seed, vocab=128, layers=3):
    """A tiny qwen2 with LoRA whose B is drawn away from zero (seeded): LoRA A's gradients exist."""
    model = build_model(
        tiny_config("qwen2", hidden_size=64, num_layers=layers, vocab_size=vocab), lora=LoraSpec(8, 16), seed=0
    )
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(seed))
    return model


def _cpu_builder(orl, seed, sabotage=None):
    """``verify.check``'s builder on CPU: the single-process trainer around OpenRLHF's Actor."""
    from openrlhf.models import Actor

    from hilore_actor.learner.settings import hilore_settings
    from hilore_actor.openrlhf.training_step import HiLoReTrainingStep
    from hilore_actor.recovery import RecoveryEngine

    def build(method):
        model = _lora_model(seed)
        actor = Actor(model)
        actor.packing_samples = False
        trainer = _trainer(orl, actor)
        if method == "gc":
            actor.gradient_checkpointing_enable()
            return trainer, None
        hcfg = hilore_settings(mode=method, budget="1.3", calibration_batches=2, profile_repeats=1, loo=False)
        plan = plan_on_cpu(model, hcfg, 4 * 32, 4, seed)
        wrapper = HiLoReTrainingStep(plan, RecoveryEngine(actor.model))
        wrapper.install(trainer)
        if sabotage == "gradient":  # a unit that recomputes a slightly different activation
            layer = model.get_decoder().layers[1]
            layer.register_forward_hook(
                lambda m, a, out: (out[0] * 1.01, *out[1:]) if isinstance(out, tuple) else out * 1.01
            )
        elif sabotage == "budget":
            plan.budget = 1
        return trainer, wrapper

    return build


@pytest.mark.parametrize("sabotage", [None, "gradient", "budget"])
def test_verification_fails_on_a_wrong_gradient_or_a_peak_over_b(orl, sabotage):
    """``verify.check`` (the GPU script's comparison) on CPU: the drop-in passes; a unit whose
    activation is off by 1%, or a peak over B, makes it fail."""
    from hilore_actor.openrlhf.verify import check, experience

    seed = torch.seed() % 2**31
    print("seed", seed)
    exps = [experience(seed + i, B=4, P=12, A=20, vocab=128) for i in range(2)]
    result = check(_cpu_builder(orl, seed, sabotage), exps, ["hilore-hr"])
    print(result["failures"])
    if sabotage is None:
        assert result["failures"] == [] and result["noise_floor"] == 0.0
    else:
        word = {"gradient": "gradient relative error", "budget": "over B"}[sabotage]
        assert len(result["failures"]) == 1 and word in result["failures"][0]


def test_chunked_head_through_a_deepspeed_engine(orl, monkeypatch):
    """After ``strategy.prepare`` the Actor's model is a DeepSpeed engine (ZeRO-2): the chunked
    head runs inside the engine's forward, whose output hooks start ZeRO's backward; the
    reduced gradient equals the one from OpenRLHF's own forward."""
    import deepspeed
    import torch.distributed as dist
    from openrlhf.models import Actor

    from hilore_actor.openrlhf.actor_forward import install
    from hilore_actor.openrlhf.verify import experience, flat_gradient

    for k, v in dict(
        DS_ACCELERATOR="cpu",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
    ).items():
        monkeypatch.setenv(k, v)
    seed = torch.seed() % 2**31
    print("seed", seed)
    exp = experience(seed, B=4, P=12, A=20, vocab=512)
    w = torch.randn(exp.action_mask.shape, generator=torch.Generator().manual_seed(seed))
    from deepspeed.utils import groups

    from hilore_actor.runtime.distributed import init_deepspeed_distributed

    groups._release_process_group_references()  # an earlier test's destroyed group may still be cached
    init_deepspeed_distributed("cpu")
    try:
        grads = []
        for chunked in (False, True):
            model = _lora_model(seed, vocab=512, layers=2)
            actor = Actor(model, temperature=0.8)
            actor.packing_samples = False
            params = [p for p in model.parameters() if p.requires_grad]
            engine, *_ = deepspeed.initialize(
                model=actor.model,
                optimizer=torch.optim.AdamW(params, lr=1e-3),
                config={
                    "train_micro_batch_size_per_gpu": 1,
                    "gradient_accumulation_steps": 1,
                    "steps_per_print": 10**9,
                    "zero_optimization": {"stage": 2, "reduce_bucket_size": 2**20, "allgather_bucket_size": 2**20},
                },
            )
            actor.model = engine
            if chunked:
                install(actor)
            lp = actor(exp.sequences, exp.action_mask, attention_mask=exp.attention_mask)
            engine.backward((lp * w).sum())
            grads.append(flat_gradient(actor))
        rel = float((grads[1] - grads[0]).norm() / grads[0].norm())
        print(f"gradient relative difference through ZeRO-2: {rel:.2e}")
        assert grads[0].norm() > 0 and rel < 1e-4
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        groups._release_process_group_references()


def _torch_padding(monkeypatch):
    """flash-attn's unpad/pad helpers (what OpenRLHF's packing calls) in plain torch."""
    import openrlhf.models.ring_attn_utils as rau

    def unpad_input(hidden, mask):
        idx = mask.flatten().nonzero(as_tuple=False).flatten()
        lens = mask.sum(-1, dtype=torch.int32)
        cu = torch.nn.functional.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))
        return hidden.reshape(-1, *hidden.shape[2:])[idx], idx, cu, int(lens.max()), lens

    def pad_input(x, idx, batch, seqlen):
        out = x.new_zeros(batch * seqlen, *x.shape[1:])
        out[idx] = x
        return out.view(batch, seqlen, *x.shape[1:])

    monkeypatch.setattr(rau, "unpad_input", unpad_input)
    monkeypatch.setattr(rau, "pad_input", pad_input)
    monkeypatch.setattr(rau, "index_first_axis", lambda x, idx: x[idx])
    monkeypatch.setattr(rau, "rearrange", lambda x, pattern: x.reshape(-1, *x.shape[2:]))


def test_chunked_head_with_packed_samples(orl, monkeypatch, eager):
    """``--ds.packing_samples``: the chunked head unpads and pads with OpenRLHF's own helpers
    (here over torch stand-ins for flash-attn's): the same log-probs, entropies and gradients
    as OpenRLHF's packed forward."""
    from openrlhf.models import Actor

    from hilore_actor.openrlhf.actor_forward import install
    from hilore_actor.openrlhf.verify import experience

    _torch_padding(monkeypatch)
    seed = torch.seed() % 2**31
    print("seed", seed)
    exp = experience(seed, B=3, P=10, A=16, vocab=300)
    model = _lora_model(seed, vocab=300, layers=2)
    model.config.use_cache = False  # as OpenRLHF's Actor sets it when it loads a model (with a cache, HF's
    # sdpa mask ignores the packed positions)
    actor = Actor(model, temperature=0.9)
    actor.packing_samples = True
    w = torch.randn(exp.action_mask.shape, generator=torch.Generator().manual_seed(seed))

    def run():
        model.zero_grad(set_to_none=True)
        lp, out = actor(
            exp.sequences, exp.action_mask, attention_mask=exp.attention_mask, return_output=True, return_entropy=True
        )
        ((lp * w).sum() + out.entropy.sum()).backward()
        g = torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])
        return lp.detach(), out.entropy.detach(), g

    lp_ref, ent_ref, g_ref = run()
    install(actor)
    lp, ent, g = run()
    torch.testing.assert_close(lp, lp_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, ent_ref, rtol=0, atol=1e-5)
    assert float((g - g_ref).norm() / g_ref.norm()) < 1e-4


def _strategy_stub(calls):
    """What ``planning_prepare`` reads of OpenRLHF's DeepspeedStrategy: its args, ``prepare``
    (here: records the reduce bucket the train config then has) and ``get_ds_train_config``."""
    from types import SimpleNamespace as NS

    args = NS(
        train=NS(micro_batch_size=4, seed=0),
        data=NS(max_len=32),
        rollout=NS(n_samples_per_prompt=4),
        actor=NS(eps_clip_low_high=(0.2, 0.2)),
        algo=NS(kl=NS(use_loss=True, init_coef=0.01, estimator="k3")),
        ds=NS(zero_stage=2),
    )
    st = NS(args=args, print=lambda *a: None)
    st.get_ds_train_config = lambda *a, **k: {"zero_optimization": {"reduce_bucket_size": "auto"}}

    def prepare(*models, **kwargs):
        calls.append(st.get_ds_train_config()["zero_optimization"]["reduce_bucket_size"])
        return models

    st.prepare = prepare
    return st


def test_prepare_sizes_the_reduce_bucket_and_does_not_plan(orl, monkeypatch):
    """``strategy.prepare`` under the drop-in only sizes ZeRO's reduce bucket to the actor's
    trainable parameters (ZeRO-3's partitioned ones by ``ds_numel``); planning waits for the
    first ``fit``. A later ``prepare`` (EMA, reference) passes through."""
    from types import SimpleNamespace as NS

    import hilore_actor.learner.plan as plan_mod
    from hilore_actor.openrlhf.policy_actor import bucket_prepare

    monkeypatch.setattr(plan_mod, "plan_in_lockstep", lambda *a, **k: pytest.fail("planned inside prepare"))
    model = build_model(
        tiny_config("qwen2", hidden_size=64, num_layers=2, vocab_size=128), lora=LoraSpec(8, 16), seed=0
    )
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    calls = []
    st = _strategy_stub(calls)
    prepare = bucket_prepare(st)
    prepare((NS(model=model), {}))
    assert calls == [max(trainable, 2**20)]
    prepare(NS(model=model))
    assert calls[-1] == "auto"
    big = torch.nn.Linear(4, 4)
    big.weight.ds_numel = 3 * 2**20  # a ZeRO-3 partition: numel() 16, the whole weight 3M elements
    calls.clear()
    bucket_prepare(_strategy_stub(calls))((NS(model=big), {}))
    assert calls == [3 * 2**20 + 4]


def test_first_update_has_no_leftover_planning_gradient(orl):
    """Real planning through ``plan_wrapped`` (CPU), then OpenRLHF's ``training_step`` under
    the drop-in without clearing gradients: bitwise OpenRLHF's own gradient-checkpointing
    gradient (a planning gradient left on the LoRA weights would be added to it)."""
    from types import SimpleNamespace as NS

    from openrlhf.models import Actor

    from hilore_actor.learner.settings import hilore_settings
    from hilore_actor.openrlhf.policy_actor import plan_wrapped
    from hilore_actor.openrlhf.training_step import HiLoReTrainingStep
    from hilore_actor.openrlhf.verify import loss_batch_info
    from hilore_actor.recovery import RecoveryEngine

    seed = torch.seed() % 2**31
    print("seed", seed)
    exp = _experience(seed)

    def fresh():
        m = _lora_model(seed)
        a = Actor(m)
        a.packing_samples = False
        return m, a

    model, actor = fresh()
    trainer = _trainer(orl, actor)
    actor.gradient_checkpointing_enable()
    trainer.training_step(exp, 0.01, 0, loss_batch_info(exp))
    g_gc = _grads(actor)

    model, actor = fresh()
    import torch.distributed as dist

    orig = dist.get_world_size, dist.get_rank
    dist.get_world_size, dist.get_rank = (lambda *a: 1), (lambda *a: 0)
    try:  # the drop-in's planning on the wrapped model (here a stand-in engine: the module, no optimizer)
        plan = plan_wrapped(
            NS(model=NS(module=model, optimizer=None)),
            _strategy_stub([]),
            hilore_settings(mode="hilore-hr", budget="1.3", profile_repeats=1, chunked_head=False),
            torch.device("cpu"),
        )
    finally:
        dist.get_world_size, dist.get_rank = orig
    trainer = _trainer(orl, actor)
    HiLoReTrainingStep(plan, RecoveryEngine(actor.model)).install(trainer)
    trainer.training_step(exp, 0.01, 0, loss_batch_info(exp))  # gradients not cleared
    assert torch.equal(_grads(actor), g_gc)


@pytest.mark.parametrize("given,tokens", [(None, 4 * 32), (96, 96)])
def test_planning_takes_the_plan_tokens_flag_else_the_recipes_largest_microbatch(orl, monkeypatch, given, tokens):
    """``--hilore.plan_tokens`` sets the planning microbatch's tokens, as in the job and verl; unset,
    the recipe's largest microbatch (micro batch x ``--data.max_len``). The sequences per microbatch
    stay the recipe's."""
    from types import SimpleNamespace as NS

    import hilore_actor.learner.plan as plan_mod
    from hilore_actor.learner.settings import hilore_settings
    from hilore_actor.openrlhf.policy_actor import plan_wrapped

    seen = {}
    monkeypatch.setattr(plan_mod, "plan_in_lockstep", lambda module, hcfg, **kw: seen.update(kw) or "the plan")
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a: 0)
    model = torch.nn.Linear(4, 4)
    actor = NS(model=NS(module=model, optimizer=None))
    plan = plan_wrapped(actor, _strategy_stub([]), hilore_settings(plan_tokens=given), torch.device("cpu"))
    assert plan == "the plan" and (seen["tokens"], seen["seqs_per_microbatch"]) == (tokens, 4)


def test_the_actor_plans_at_its_first_fit_on_the_gpu_openrlhf_set(orl, monkeypatch, actor_env):
    """``init_model_from_pretrained`` plans nothing: under ZeRO-3 the model is partitioned at
    load and with ``--ds.enable_sleep`` its states leave the GPU before it returns. The first
    ``fit`` (OpenRLHF's ``ppo_train`` reloaded the states, vLLM sleeps) plans, on the device
    OpenRLHF's ``setup_distributed`` set (here 3; read before it, every actor reads device 0),
    before OpenRLHF's own ``fit`` runs, and only once; the random state training draws from
    is the one it had before planning."""
    from types import SimpleNamespace as NS

    from hilore_actor.openrlhf import policy_actor as pa

    chosen, events = {}, []

    def current_device():
        if "device" not in chosen:
            raise AssertionError("the CUDA device was read before OpenRLHF's setup_distributed set it")
        return chosen["device"]

    def base_init(self, strategy, pretrain, max_steps=None, vllm_engines=None):
        chosen["device"] = 3  # OpenRLHF: strategy.setup_distributed() -> torch.cuda.set_device(LOCAL_RANK)
        self.strategy, self.actor = strategy, NS(train=lambda: None)
        strategy.prepare((NS(model=torch.nn.Linear(4, 4)), None))
        events.append("init (offload under --ds.enable_sleep)")

    def planned(actor, strategy, hcfg, device):
        torch.rand(3)  # planning draws random numbers
        events.append(("plan", device))
        return "the plan"

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", current_device)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.random, "fork_rng", _cpu_fork_rng(torch.random.fork_rng))
    monkeypatch.setattr(pa, "plan_wrapped", planned)
    monkeypatch.setattr(orl.PolicyModelActor.__ray_actor_class__, "init_model_from_pretrained", base_init)
    monkeypatch.setattr(
        orl.PolicyModelActor.__ray_actor_class__,
        "fit",
        lambda self, kl_ctl=0: events.append(("fit", torch.rand(1).item())) or {"ok": 1},
    )
    monkeypatch.setattr(
        pa._HiLoRePolicyModelActor,
        "_attach",
        lambda self, st, hcfg, plan, device: setattr(self, "hilore", plan) or events.append("attach"),
    )
    st = _strategy_stub([])
    st.args.actor.gradient_checkpointing_enable = False
    actor = object.__new__(pa._HiLoRePolicyModelActor)
    actor.init_model_from_pretrained(st, "/models/any")
    assert events == ["init (offload under --ds.enable_sleep)"] and actor.hilore is None
    torch.manual_seed(5)
    want = torch.rand(1).item()
    torch.manual_seed(5)
    assert actor.fit(0.01) == {"ok": 1} and actor.fit(0.01) == {"ok": 1}
    cuda3 = torch.device("cuda", 3)
    assert events[1:4] == [("plan", cuda3), "attach", ("fit", want)] and len(events) == 5


def _cpu_fork_rng(real):
    """``fork_rng`` on a CPU-only build, where the test's ``cuda:3`` has no random state."""
    return lambda devices=None, **k: real(devices=[], **k)


def test_memory_watch_rebases_after_the_first_step_and_logs_reserved(orl, monkeypatch):
    """ZeRO-2 allocates its gradient buckets in the first backward: resident bytes measured
    before it miss them. After the first step the plan is rebased on a new measurement (once),
    a changed B is registered, and each step's maximum allocated and reserved bytes are in its
    metrics."""
    from types import SimpleNamespace as NS

    from fake_cuda import FakeCudaAllocator

    from hilore_actor.openrlhf.policy_actor import watch_memory

    a = FakeCudaAllocator()
    monkeypatch.setattr(torch._C, "_cuda_memoryStats", a.stats, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_resetPeakMemoryStats", a.reset, raising=False)
    for mod in (torch.cuda, torch.cuda.memory):
        monkeypatch.setattr(mod, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    MB = 2**20
    a.alloc(100 * MB)  # weights and optimizer partitions

    first = [True]

    def step(*args):
        if first.pop() if first else False:
            a.alloc(8 * MB)  # ZeRO-2's reduce bucket, kept from the first backward on
        a.alloc(30 * MB)
        a.free(30 * MB)
        return {"metrics": {}, "weights": {}}

    rebased, registered = [], []
    plan = NS(budget=200 * MB, rebase=lambda resident: rebased.append(resident) or True)
    trainer = NS(training_step=step)
    watch_memory(trainer, plan, torch.device("cuda", 0), model=None, register=registered.append)
    out = trainer.training_step("experience")
    trainer.training_step("experience")
    assert rebased == [108 * MB] and registered == [200 * MB]
    assert out["metrics"]["hilore_max_allocated_gb"] == 138 * MB / 2**30
    assert out["metrics"]["hilore_max_reserved_gb"] == 138 * MB / 2**30 and "hilore_max_reserved_gb" in out["weights"]


# OpenRLHF's documented RL command (its README, "PPO/REINFORCE++ with Ray and vLLM", as of the
# v0.11.0 snapshot, the newest available), with GRPO's estimator and 8 samples per prompt (its
# GRPO variant). Two of the README's flags are gone from 0.11.2's parser, which would exit 2 on
# them: --prompt_max_len/--generate_max_len are --data.max_len/--rollout.max_new_tokens there.
DOCUMENTED_RL = (
    "--ref.num_nodes 1 --ref.num_gpus_per_node 8 --reward.num_nodes 1 --reward.num_gpus_per_node 8 "
    "--critic.num_nodes 1 --critic.num_gpus_per_node 8 --actor.num_nodes 1 --actor.num_gpus_per_node 8 "
    "--vllm.num_engines 4 --vllm.tensor_parallel_size 2 --train.colocate_all --vllm.gpu_memory_utilization 0.5 "
    "--actor.model_name_or_path OpenRLHF/Llama-3-8b-sft-mixture --reward.model_name_or_path "
    "OpenRLHF/Llama-3-8b-rm-700k "
    "--ckpt.output_dir /openrlhf/final/llama3-8b-rlhf --ckpt.path /openrlhf/ckpt/llama3-8b-rlhf --ckpt.save_hf "
    "--train.batch_size 128 --rollout.batch_size 1024 --train.dynamic_batch_enable --rollout.n_samples_per_prompt 8 "
    "--train.max_epochs 1 --data.max_len 2048 --data.max_samples 100000 --rollout.max_new_tokens 1024 "
    "--ds.zero_stage 3 --ds.param_dtype bf16 --actor.adam.lr 5e-7 --critic.adam.lr 9e-6 --algo.kl.init_coef 0.01 "
    "--data.prompt_dataset OpenRLHF/prompt-collection-v0.1 --data.input_key context_messages "
    "--data.apply_chat_template "
    "--reward.normalize_enable --actor.gradient_checkpointing_enable --ds.packing_samples --vllm.sync_backend nccl "
    "--vllm.enforce_eager --vllm.enable_sleep --ds.enable_sleep --algo.advantage.estimator group_norm"
).split()
# A LoRA GRPO command on ZeRO-2 (OpenRLHF documents LoRA flags but no LoRA RL command):
# colocated actor and reference, the KL as a loss, as GRPO recipes write it.
LORA_ZERO2_GRPO = (
    "--ref.num_nodes 1 --ref.num_gpus_per_node 4 --actor.num_nodes 1 --actor.num_gpus_per_node 4 "
    "--vllm.num_engines 2 --vllm.tensor_parallel_size 1 --train.colocate_actor_ref "
    "--actor.model_name_or_path Qwen/Qwen2.5-3B-Instruct --data.prompt_dataset /data/math.jsonl "
    "--data.input_key prompt "
    "--data.apply_chat_template --ds.zero_stage 2 --ds.param_dtype bf16 --ds.lora.rank 16 --ds.lora.alpha 32 "
    "--ds.lora.target_modules all-linear --rollout.n_samples_per_prompt 8 --algo.advantage.estimator group_norm "
    "--algo.kl.use_loss --algo.kl.estimator k3 --algo.kl.init_coef 0.001 --train.batch_size 128 "
    "--rollout.batch_size 128 "
    "--train.micro_batch_size 4 --rollout.micro_batch_size 8 --data.max_len 4096 --rollout.max_new_tokens 3072 "
    "--actor.adam.lr 1e-6 --ds.packing_samples --actor.gradient_checkpointing_enable --vllm.enable_sleep "
    "--ds.enable_sleep"
).split()


@pytest.mark.parametrize("recipe", [DOCUMENTED_RL, LORA_ZERO2_GRPO], ids=["documented-rl-zero3", "lora-zero2-grpo"])
def test_documented_recipes_reach_the_gpu_check(orl, recipe, capsys):
    """OpenRLHF's documented RL command (ZeRO-3, colocated models with sleep, packing) and a
    LoRA ZeRO-2 GRPO command, with ``--actor_backend hilore``: OpenRLHF's parser and
    validation accept them and the launcher refuses none of their settings; on this CPU
    machine it stops where the Ray cluster is checked for GPUs, exit 2, one message."""
    assert main(recipe + ["--actor_backend", "hilore"]) == 2
    err = capsys.readouterr().err
    assert "needs CUDA GPUs" in err and "cannot run with" not in err and "Traceback" not in err, err


# what the actor's __init__ and init_model_from_pretrained (HiLoRe's and OpenRLHF's) set in its environment
ACTOR_ENV = (
    "PYTORCH_CUDA_ALLOC_CONF",
    "PYTORCH_ALLOC_CONF",
    "NCCL_CUMEM_ENABLE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
)


@pytest.fixture
def actor_env(monkeypatch):
    """Every variable in ``ACTOR_ENV`` absent, and after the test as it was (set, then deleted: the
    undo also removes what the actor set)."""
    for k in ACTOR_ENV:
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)
    return monkeypatch


class _CudaStarts(Exception):
    pass


def _allocator_at_cuda_start(monkeypatch, recipe):
    """OpenRLHF's real actor (HiLoRe's subclass, constructed as Ray does) and its real
    ``init_model_from_pretrained`` on a CLI-parsed recipe, up to ``_setup_distributed``, where CUDA
    starts: (``PYTORCH_CUDA_ALLOC_CONF`` after construction, there, the lines printed, the args)."""
    from types import SimpleNamespace as NS

    import openrlhf.cli.train_ppo_ray as cli
    from openrlhf.trainer.ray.launcher import BaseModelActor

    from hilore_actor.openrlhf import policy_actor as pa

    parsed, seen, printed = {}, {}, []
    run_cli_main(cli, split_flags(recipe)[2], lambda args: parsed.setdefault("args", args))
    actor = pa._HiLoRePolicyModelActor(1, 0, "127.0.0.1", 29500)
    constructed = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")

    def setup_distributed(self, strategy):
        seen["at_cuda"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
        raise _CudaStarts

    monkeypatch.setattr(pa, "has_cuda", lambda: True)
    monkeypatch.setattr(BaseModelActor, "_setup_distributed", setup_distributed)
    with pytest.raises(_CudaStarts):
        actor.init_model_from_pretrained(
            NS(args=parsed["args"], print=printed.append, prepare=None), "/models/any", vllm_engines=[object()]
        )
    return constructed, seen["at_cuda"], [x for x in printed if "expandable" in x], parsed["args"]


def test_the_colocated_recipe_keeps_expandable_segments_off(orl, actor_env):
    """OpenRLHF's documented recipe (``--train.colocate_all``, NCCL sync, not async) sends the
    actor's weights to vLLM by CUDA IPC, which cannot export expandable-segment memory where
    ``pidfd_getfd`` is refused: the actor leaves the allocator variable as the user set it
    (unset) until CUDA starts, and says so in one line."""
    constructed, at_cuda, lines, args = _allocator_at_cuda_start(actor_env, DOCUMENTED_RL)
    assert constructed is None and at_cuda is None and "PYTORCH_ALLOC_CONF" not in os.environ
    assert len(lines) == 1 and lines[0].startswith("[hilore] allocator: expandable segments left off")
    assert args.train.colocate_all and args.vllm.sync_backend == "nccl"


def test_other_recipes_get_expandable_segments_and_user_settings_stay(orl, actor_env):
    """Without CUDA IPC (colocated actor and reference only) the actor sets expandable segments
    before CUDA starts; a value the user set stays as it is, with one warning where it turns
    expandable segments on for the colocated recipe."""
    constructed, at_cuda, lines, _ = _allocator_at_cuda_start(actor_env, LORA_ZERO2_GRPO)
    assert constructed is None and at_cuda == "expandable_segments:True" and lines == []
    for value, warned in (("expandable_segments:True", True), ("max_split_size_mb:256", False)):
        actor_env.setenv("PYTORCH_CUDA_ALLOC_CONF", value)
        _, at_cuda, lines, _ = _allocator_at_cuda_start(actor_env, DOCUMENTED_RL)
        assert at_cuda == value and len(lines) == int(warned)
        assert not warned or lines[0].startswith("[hilore] warning: your allocator settings turn expandable")


@pytest.mark.parametrize(
    "recipe, ipc",
    [
        (DOCUMENTED_RL, True),
        ([a for a in DOCUMENTED_RL if a != "--vllm.enable_sleep"] + ["--train.async_enable"], False),  # async: no sleep
        (DOCUMENTED_RL + ["--vllm.sync_backend", "gloo"], False),  # argparse: the last value wins
        (LORA_ZERO2_GRPO, False),
    ],
    ids=["documented", "async", "gloo", "lora-zero2"],
)
def test_cuda_ipc_is_read_as_openrlhfs_trainer_decides_it(orl, monkeypatch, recipe, ipc):
    """``weights_via_cuda_ipc`` against OpenRLHF's own ``ActorPPOTrainer.__init__`` (its
    ``use_cuda_ipc``) on CLI-parsed recipes."""
    from types import SimpleNamespace as NS

    import openrlhf.cli.train_ppo_ray as cli

    from hilore_actor.openrlhf.policy_actor import weights_via_cuda_ipc

    parsed = {}
    run_cli_main(cli, split_flags(recipe)[2], lambda args: parsed.setdefault("args", args))
    monkeypatch.setattr(orl, "torch_dist_barrier_and_cuda_sync", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # the replay buffer's target device
    trainer = orl.ActorPPOTrainer(NS(args=parsed["args"]), None, None, None, None, vllm_engines=None)
    assert trainer.use_cuda_ipc is ipc and weights_via_cuda_ipc(parsed["args"]) is ipc


def test_planning_sizes_the_microbatch_as_the_recipe_trains(orl):
    """Fixed microbatches: sequences x max length; dynamic batching: OpenRLHF's token cap."""
    from types import SimpleNamespace as NS

    from hilore_actor.openrlhf.policy_actor import microbatch_shape

    fixed = NS(
        train=NS(micro_batch_size=4, dynamic_batch_enable=False, max_tokens_per_gpu=16192), data=NS(max_len=2048)
    )
    assert microbatch_shape(fixed) == (8192, 4)
    dynamic = NS(
        train=NS(micro_batch_size=1, dynamic_batch_enable=True, max_tokens_per_gpu=16192), data=NS(max_len=2048)
    )
    assert microbatch_shape(dynamic) == (16192, 7)


def test_skip_on_with_a_kl_loss_stops_with_one_line_before_ray(orl, capsys):
    """``--hilore.skip_zero_advantage on`` where a loss term reaches the responses it would skip
    (here the recipe's ``--algo.kl.use_loss``): one ``error:`` line naming the flag, exit 2,
    before Ray starts."""
    import ray

    assert main(RECIPE + ["--actor_backend", "hilore", "--hilore.skip_zero_advantage", "on"]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert errors[0].startswith("error: --hilore.skip_zero_advantage on: --algo.kl.use_loss adds a KL term")
    assert not ray.is_initialized()


def test_skip_blockers_read_openrlhfs_parsed_recipe(orl):
    """The skip is exact, so ``auto`` skips, with OpenRLHF's PPO loss alone (the recipe without
    its KL loss; also a KL loss of coefficient 0 and an entropy coefficient of 0, which only logs
    it; dynamic batches under ZeRO-3, also with EMA, which then moves once per optimizer step); a KL
    loss, an entropy or MoE auxiliary term, EMA over fixed micro-batches, or dynamic batches under
    ZeRO-2 make ``auto`` train everything and ``on`` a one-line ``ValueError`` naming the flag.
    ``off`` never skips."""
    import openrlhf.cli.train_ppo_ray as cli

    from hilore_actor.openrlhf.skip import blockers, resolve

    def parsed(*extra):
        seen = {}
        recipe = [a for a in RECIPE if a != "--algo.kl.use_loss"] + list(extra)
        run_cli_main(cli, recipe, lambda args: seen.setdefault("args", args))
        return seen["args"]

    args = parsed()
    assert blockers(args) == [] and resolve("auto", args) and resolve("on", args) and not resolve("off", args)
    assert blockers(parsed("--actor.entropy_coef", "0", "--algo.kl.use_loss", "--algo.kl.init_coef", "0")) == []
    assert blockers(parsed("--train.dynamic_batch_enable", "--ds.zero_stage", "3", "--train.enable_ema")) == []
    for extra in (
        ["--algo.kl.use_loss"],
        ["--actor.entropy_coef", "0.01"],
        ["--actor.aux_loss_coef", "0.01"],
        ["--train.enable_ema"],
        ["--train.dynamic_batch_enable", "--ds.zero_stage", "2"],  # DeepSpeed keeps a step's last micro-batch
    ):
        args = parsed(*extra)
        assert not resolve("auto", args) and not resolve("off", args)
        with pytest.raises(ValueError, match=f"^--hilore.skip_zero_advantage on: {extra[0]}") as e:
            resolve("on", args)
        assert "\n" not in str(e.value)


def _samples(n, zero, seed=0):
    """``n`` single samples as OpenRLHF's replay buffer holds them, advantage 0 at ``zero``."""
    from openrlhf.trainer.ppo_utils.experience import remove_padding_in_sequences, split_experience_batch

    from hilore_actor.openrlhf.verify import experience

    exp = experience(seed, B=n, P=12, A=20, vocab=128)
    exp.advantages[zero] = 0.0
    exp.total_length = exp.attention_mask.sum(-1)
    return remove_padding_in_sequences(split_experience_batch(exp))


def test_skip_windows_keep_each_steps_totals_and_boundary(orl):
    """The fixed micro-batch path on one rank, gas 2, two samples per micro-batch: each window
    gets OpenRLHF's own totals (``iter_grad_accum_global_norm``'s, counted before the skip) and
    runs its kept samples, collated in order, in as few micro-batches as they need; a window
    with nothing kept runs one pad (its shortest sample) and one that keeps everything runs
    OpenRLHF's own micro-batches. The engine's boundary falls on each window's last
    micro-batch, and where the buffer is not a multiple of gas (the trailing window) where
    DeepSpeed's own count has it; then it is handed back."""
    from types import SimpleNamespace as NS

    from openrlhf.trainer.ppo_utils.experience import make_experience_batch
    from openrlhf.utils.loss_utils import iter_grad_accum_global_norm

    from hilore_actor.openrlhf.skip import ZeroAdvantageSkip

    items = _samples(14, [0, 2, 3, 4, 5, 6, 7, 12])  # windows: samples 0-3 keep 1, 4-7 none, 8-11 all; 12-13 keep 13
    batches = [make_experience_batch(items[i : i + 2]) for i in range(0, 14, 2)]
    calls = []
    trainer = NS(
        actor=NS(model=NS(micro_steps=0, set_gradient_accumulation_boundary=calls.append)),
        replay_buffer=NS(sample_batch_size=2, packing_samples=False),
    )
    skip = ZeroAdvantageSkip(trainer)
    mask = lambda e: e.action_mask
    want = [info for _, info in iter_grad_accum_global_norm(iter(batches), NS(), 2, mask)]
    got = list(skip.windows(iter(batches), NS(), 2, mask))
    assert [info for _, info in got] == [want[0], want[2], want[4], want[5], want[6]]
    shortest = min(items[4:8], key=lambda s: s.sequences.numel())
    assert [len(b.sequences) for b, _ in got] == [1, 1, 2, 2, 1]
    for (b, _), sample in zip(got, [items[1], shortest, None, None, items[13]]):
        if sample is not None:
            assert torch.equal(b.sequences[0], sample.sequences) and torch.equal(b.advantages[0], sample.advantages)
    assert got[2][0] is batches[4] and got[3][0] is batches[5]  # nothing left out: OpenRLHF's own
    assert calls == [True, True, False, True, False, None]  # the trailing window ends no step (DeepSpeed's count)
    assert skip.flags == {0: (False, True), 1: (True, False), 2: (False, True), 3: (False, True), 4: (False, True)}
    m = skip.metrics(NS())
    assert m["hilore_zero_adv_share"] == 8 / 14 and m["hilore_pad_microbatches"] == 1
    zero_tokens = sum(int(items[i].action_mask.sum()) for i in [0, 2, 3, 4, 5, 6, 7, 12])
    assert m["hilore_zero_adv_token_share"] == zero_tokens / sum(int(s.action_mask.sum()) for s in items)


@pytest.fixture
def world_one(monkeypatch):
    """One gloo rank in this process, and the CPU for OpenRLHF's ``torch.cuda.current_device()``."""
    import torch.distributed as dist

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    fresh = not dist.is_initialized()
    if fresh:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    if fresh:
        dist.destroy_process_group()


def test_skip_rebuilds_dynamic_batches_from_the_kept_samples(orl, world_one, monkeypatch):
    """Dynamic batching (``setup_dynamic_batch``, OpenRLHF's own first): each optimizer step's
    micro-batches hold exactly its kept samples, each within ``--train.max_tokens_per_gpu``, as
    few as the first-fit count OpenRLHF sizes by; every micro-batch keeps the step's own token
    and sample totals; the optimizer steps after each step's last one; a step with nothing kept
    runs one pad, its shortest sample."""
    from types import SimpleNamespace as NS

    import torch.distributed as dist
    from openrlhf.trainer.ppo_utils.replay_buffer import NaiveReplayBuffer
    from openrlhf.utils.seqlen_balancing import get_minimum_num_micro_batch_size

    from hilore_actor.openrlhf.skip import ZeroAdvantageSkip

    with monkeypatch.context() as m:  # the buffer names its device f"cuda:{current_device()}"
        m.setattr(torch.cuda, "current_device", lambda: 0)
        buf = NaiveReplayBuffer(1, cpu_offload=False, dynamic_batch=True)
    buf.items = _samples(8, [0, 1, 2, 3, 5])  # step 1: nothing kept; step 2: 4, 6, 7
    args = NS(
        train=NS(batch_size=4, max_tokens_per_gpu=64),
        rollout=NS(batch_size=2, n_samples_per_prompt=4),
        ds=NS(ring_attn_size=1, tensor_parallel_size=1),
    )

    def all_reduce(t, op="mean"):
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t

    strategy = NS(args=args, ds_device_mesh={"dp": NS(get_group=lambda: None)}, all_reduce=all_reduce)  # 1 rank
    NaiveReplayBuffer.setup_dynamic_batch(buf, strategy)
    before = {"tokens": list(buf.dynamic_batch_num_tokens), "samples": list(buf.dynamic_global_batch_size)}
    first_step = buf.dynamic_optimizer_step.index(1) + 1
    skip = ZeroAdvantageSkip(NS(replay_buffer=buf, actor=NS(model=None), max_epochs=1))
    skip.setup_dynamic_batch(strategy)
    length = lambda j: int(buf.items[j].total_length)
    k = get_minimum_num_micro_batch_size([length(j) for j in (4, 6, 7)], 64, 1, 1)
    assert buf.dynamic_indices[0] == [min(range(4), key=length)]
    assert sorted(j for p in buf.dynamic_indices[1:] for j in p) == [4, 6, 7] and len(buf.dynamic_indices) == 1 + k
    assert all(sum(length(j) for j in p) <= 64 for p in buf.dynamic_indices[1:])
    assert buf.dynamic_optimizer_step == [1] + [0] * (k - 1) + [1]
    assert buf.dynamic_batch_num_tokens == [before["tokens"][0]] + [before["tokens"][first_step]] * k
    assert buf.dynamic_global_batch_size == [before["samples"][0]] + [before["samples"][first_step]] * k
    assert skip.step_flags(0) == (True, False) and all(skip.step_flags(i) == (False, True) for i in range(1, 1 + k))
    assert skip.counts.pads == 1 and skip.counts.zero_samples == 5
