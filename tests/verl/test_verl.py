"""HiLoRe's verl engine (hilore_actor/verl) against verl 0.9.1's own FSDP engine, on CPU.

Both engines are verl's real code (FSDP2 or FSDP1 over gloo, one rank, a tiny Llama with LoRA);
only the device platform is supplied (``verl_cpu.py``). The reference is verl's path with its
gradient checkpointing."""

import os
from hilore_actor.runtime.distributed import free_port

import pytest
import torch

pytest.importorskip("verl")
pytest.importorskip("tensordict")

import verl_cpu  # noqa: E402

from hilore_actor.verl import verify  # noqa: E402

VOCAB = verl_cpu.TINY["vocab_size"]
SETTINGS, JOB = verl_cpu.SETTINGS, verl_cpu.JOB


@pytest.fixture(scope="module")
def verl_env(tmp_path_factory):
    import torch.distributed as dist
    from verl.plugin.platform import platform_manager

    from hilore_actor.verl.fsdp_engine import register_for

    saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    platform_manager.set_platform(verl_cpu.cpu_platform())
    fresh = not dist.is_initialized()
    if fresh:
        dist.init_process_group("gloo", rank=0, world_size=1)
    register_for(("cpu",))
    seed = torch.seed() % 2**31
    print("seed", seed)
    path = verl_cpu.save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), seed)
    yield path, seed
    if fresh:
        dist.destroy_process_group()
    platform_manager._current_platform = None
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def engines(verl_env):
    """``engines(kind, remove_padding)``: one engine per kind and batch layout for the module
    (each build plans for seconds), all on the same weights: kind ``verl`` is verl's own
    engine with its gradient checkpointing, ``hilore-hr`` and ``hilore`` HiLoRe's engine in
    that mode."""
    from hilore_actor.verl.settings import CONFIG_ENV

    path, seed = verl_env
    built = {}

    def get(kind: str, remove_padding: bool = True):
        if (kind, remove_padding) not in built:
            try:
                built[kind, remove_padding] = verify.build_engine(
                    kind, path, seed, remove_padding=remove_padding, settings=SETTINGS, job=JOB
                )
            finally:
                os.environ.pop(CONFIG_ENV, None)
        return built[kind, remove_padding]

    yield get
    built.clear()


def _hilore(monkeypatch, **settings):
    from hilore_actor.verl.settings import CONFIG_ENV, to_env

    monkeypatch.setenv(CONFIG_ENV, to_env({**SETTINGS, **settings}, JOB))


@pytest.mark.parametrize("remove_padding", [True, False])
def test_hr_plan_is_bitwise_equal_to_verls_checkpointed_path(verl_env, engines, monkeypatch, remove_padding):
    """FSDP2 only: torch's FSDP1 refuses CPU modules under verl's ``sync_module_states=True``.
    Each learner microbatch closes after verl's ``micro_batch<i>`` scope has ended (a profiler
    stopped inside a scope that began while it ran corrupts the heap: engine.py)."""
    path, seed = verl_env
    td = verify.grpo_batch(
        seed, vocab=VOCAB, remove_padding=remove_padding, full=True
    )  # micro-batches of the planning size
    loss_fn = verify.ppo_loss_fn()
    ref = verify.batch_gradient(engines("verl", remove_padding), td.clone(), loss_fn)
    ours = engines("hilore-hr", remove_padding)
    assert not ours.module.is_gradient_checkpointing  # verl's HF checkpointing is off under HiLoRe
    mb = ours.hilore
    events = []
    real_scope, real_open, real_close = torch.profiler.record_function, mb.open, mb.close

    class Scope(real_scope):
        def __exit__(self, *exc):
            events.append(("end", self.name))
            return super().__exit__(*exc)

    monkeypatch.setattr(torch.profiler, "record_function", Scope)
    monkeypatch.setattr(mb, "open", lambda batch: (events.append(("open",)), real_open(batch)))
    monkeypatch.setattr(mb, "close", lambda: (events.append(("close",)) if mb._open else None, real_close()))
    step, g = mb.step, verify.batch_gradient(ours, td.clone(), loss_fn)
    print("plan", mb.plan.info.get("plan"), "actions", mb.last.get("counts"))
    assert mb.index == 2 and mb.step == step + 1  # two micro-batches, each one learner microbatch
    order = [e for e in events if e[0] != "end" or e[1].startswith("micro_batch")]
    assert order == [("open",), ("end", "micro_batch0"), ("close",), ("open",), ("end", "micro_batch1"), ("close",)]
    assert set(mb.last["actions"].values()) == {"H", "R"}  # a mixed plan: both paths ran
    assert ref.abs().sum() > 0 and torch.equal(g, ref)


@pytest.mark.parametrize(
    "actor,entropy",
    [
        ({}, False),
        ({"loss_agg_mode": "seq-mean-token-mean", "use_kl_loss": True}, False),
        ({"entropy_coeff": 0.01, "loss_agg_mode": "token-sum"}, True),
    ],
)
def test_omega_is_autograd_of_verls_loss_and_zero_off_the_responses(verl_env, engines, monkeypatch, actor, entropy):
    """omega from the re-wrapped log-probs equals d loss / d log-prob taken by autograd on verl's
    own nested output (a stock engine, same weights), for several loss settings; it and the
    mask are zero off the response tokens, and the mask counts exactly the response tokens."""
    path, seed = verl_env
    td = verify.grpo_batch(seed + 7, vocab=VOCAB, entropy=entropy, full=True)
    loss_fn = verify.ppo_loss_fn(**actor)
    refs = []

    def reference(model_output, data, dp_group=None):  # verl's loss on detached leaves: autograd w.r.t. them
        leaves = {
            k: v.values().detach().requires_grad_() for k, v in model_output.items() if k in ("log_probs", "entropy")
        }
        loss, _ = loss_fn(model_output=leaves, data=data, dp_group=dp_group)
        refs.append(torch.autograd.grad(loss, leaves["log_probs"])[0])
        return loss_fn(model_output=model_output, data=data, dp_group=dp_group)

    verify.batch_gradient(engines("verl"), td.clone(), reference)
    ours = engines("hilore-hr")
    seen = []
    real_choose = ours.hilore._choose

    def choose(rec, loss, held, data):
        out = real_choose(rec, loss, held, data)
        seen.append((dict(ours.hilore.weights), data["response_mask"].sum()))
        return out

    monkeypatch.setattr(ours.hilore, "_choose", choose)
    verify.batch_gradient(ours, td.clone(), loss_fn)
    assert len(seen) == len(refs) == 2
    for (w, n_resp), ref in zip(seen, refs):
        assert torch.allclose(w["omega"], ref, rtol=1e-6, atol=1e-9) and ref.abs().sum() > 0
        assert int(w["mask"].sum()) == int(n_resp)
        assert (w["omega"][w["mask"] == 0] == 0).all() and (w["weight"][w["mask"] == 0] == 0).all()
        if entropy:
            assert (w["weight"] > w["omega"].abs()).any()  # the entropy term's weight is counted


def test_hilore_mode_stays_within_the_gradient_tolerance(verl_env, engines):
    """Mode hilore (L offered, calibrated on synthetic microbatches) over one verl batch: the
    gradient stays within the tolerance of verl's checkpointed path."""
    path, seed = verl_env
    td = verify.grpo_batch(seed + 11, vocab=VOCAB, full=True)
    loss_fn = verify.ppo_loss_fn()
    ref = verify.batch_gradient(engines("verl"), td.clone(), loss_fn)
    ours = engines("hilore")
    g = verify.batch_gradient(ours, td.clone(), loss_fn)
    rel = float((g - ref).norm() / ref.norm())
    print("actions", ours.hilore.last["counts"], "relative error", rel)
    assert rel <= 0.015
    assert ours.hilore.last["peak_over_budget"] <= 1.0


def test_each_micro_batch_reports_its_peak_and_actions_in_verls_metrics(verl_env, engines):
    """verl's worker reduces the metrics of ``forward_backward_batch``'s output: HiLoRe's peak / B
    (max) and action fractions (mean) are there, one value per micro-batch, as measured."""
    path, seed = verl_env
    td = verify.grpo_batch(seed + 5, vocab=VOCAB, full=True)
    ours = engines("hilore-hr")
    ours.optimizer_zero_grad()
    with ours.train_mode():
        out = ours.forward_backward_batch(td, verify.ppo_loss_fn())
    m = out["metrics"]  # verl merges the micro-batches' Metric objects key by key
    peaks = m["actor/hilore_peak_over_budget"]
    assert peaks.values == ours.hilore.batch_peaks and len(peaks.values) == 2
    assert peaks.aggregate() == max(ours.hilore.batch_peaks) and "actor/pg_loss" in m
    fractions = [sum(m[f"actor/hilore_fraction_{a}"].values[i] for a in "HLPR") for i in range(2)]
    assert fractions == pytest.approx([1.0, 1.0])
    assert m["actor/hilore_fraction_H"].values[-1] == ours.hilore.last["counts"]["H"] / len(ours.hilore.last["actions"])


def test_two_fsdp2_ranks_plan_in_lockstep_and_match_verl(verl_ranks):
    """Two ranks (``verl_two_ranks.py``, two processes over gloo): rank 0 plans, rank 1 replays
    its passes (``learner/lockstep.py``), so neither hangs in a collective the other skipped;
    both adopt one budget and one plan; each rank's own batch then gives the reduced gradient
    of verl's checkpointed path bitwise under the H/R plan, also when rank 1 recomputes every
    unit while rank 0 stores one, and within the tolerance in mode hilore."""
    print("seed", verl_ranks["seed"])
    r0, r1 = verl_ranks["lockstep"]
    print({k: (r0[k]["counts"], r1[k]["counts"]) for k in r0})
    for kind in ("hilore-hr", "hilore"):
        assert r0[kind]["plan"] == r1[kind]["plan"] and r0[kind]["budget"] == r1[kind]["budget"]
    assert r0["hilore-hr"]["equal"] and r1["hilore-hr"]["equal"]
    assert r0["hilore-hr"]["counts"]["H"] >= 1 and r0["hilore-hr"]["counts"]["R"] >= 1  # a mixed plan ran
    assert (
        r1["divergent"]["counts"]["R"] == sum(r1["divergent"]["counts"].values())
        and r0["divergent"]["counts"]["H"] >= 1
    )
    assert r0["divergent"]["equal"] and r1["divergent"]["equal"]
    assert r0["hilore"]["rel"] <= 0.015 and r1["hilore"]["rel"] <= 0.015


def test_with_param_offload_planning_runs_in_verls_train_mode(verl_env, monkeypatch):
    """``fsdp_config.param_offload=True``: verl's ``initialize`` leaves parameters and optimizer on
    the CPU and loads them in ``train_mode()``; HiLoRe plans inside it, so planning's passes and
    resident bytes are on the training device (on a CPU both devices are the CPU: this shows
    where planning runs, not the move)."""
    import hilore_actor.verl.attach as attach_mod

    path, seed = verl_env
    real, seen = attach_mod.attach, []

    def spy(fsdp_engine):
        seen.append((fsdp_engine.mode, fsdp_engine.module.training))
        return real(fsdp_engine)

    monkeypatch.setattr(attach_mod, "attach", spy)
    from hilore_actor.verl.settings import CONFIG_ENV

    try:
        engine = verify.build_engine("hilore-hr", path, seed, settings=SETTINGS, job=JOB, param_offload=True)
    finally:
        os.environ.pop(CONFIG_ENV, None)
    assert seen == [("train", True)] and engine.mode is None  # verl's context closed after planning
    assert engine.hilore is not None and engine.engine_config.param_offload


def test_a_worker_without_cuda_stops_with_one_message(verl_env, monkeypatch):
    """verl falls back to device "cuda" when it finds no accelerator; the engine refuses then,
    in the worker, before building anything."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig

    import hilore_actor.verl.fsdp_engine as engine_mod
    import verl.utils.device

    path, seed = verl_env
    _hilore(monkeypatch)
    monkeypatch.setattr(verl.utils.device, "get_device_name", lambda: "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    mc = HFModelConfig(path=path, load_tokenizer=False, override_config={"attn_implementation": "sdpa"})
    with pytest.raises(RuntimeError, match="needs a CUDA device in each actor worker"):
        engine_mod.HiLoReFSDPEngine(
            mc, FSDPEngineConfig(strategy="fsdp2"), FSDPOptimizerConfig(lr=1e-3), CheckpointConfig()
        )


@pytest.mark.parametrize("forward_only", [False, True])
def test_the_training_engine_turns_verls_activation_offload_off(verl_env, monkeypatch, capsys, forward_only):
    """Through verl's own main_ppo (the patch; no launcher to turn it off) the training engine
    still turns activation offload off, with one line, before verl's engine builds the model;
    the forward-only reference engine is left as configured."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    import hilore_actor.verl.fsdp_engine as engine_mod

    path, seed = verl_env
    _hilore(monkeypatch)
    seen = []
    monkeypatch.setattr(engine_mod, "_need_device", lambda: None)
    monkeypatch.setattr(
        FSDPEngineWithLMHead, "__init__", lambda self, mc, *a: seen.append(mc.enable_activation_offload)
    )
    mc = HFModelConfig(path=path, load_tokenizer=False, enable_activation_offload=True)
    engine_mod.HiLoReFSDPEngine(
        mc,
        FSDPEngineConfig(strategy="fsdp2", forward_only=forward_only),
        FSDPOptimizerConfig(lr=1e-3),
        CheckpointConfig(),
    )
    assert seen == [forward_only]
    lines = capsys.readouterr().out.splitlines()
    assert lines == (
        []
        if forward_only
        else [
            "[hilore] actor_rollout_ref.model.enable_activation_offload=true is turned off: HiLoRe's plan decides per "
            "unit what is kept, compressed or recomputed"
        ]
    )


def test_registration_is_idempotent(verl_env):
    from verl.workers.engine import EngineRegistry

    from hilore_actor.verl.fsdp_engine import BACKEND, HiLoReFSDPEngine, register_for

    register_for(("cpu",))
    register_for(("cpu",))
    assert EngineRegistry._engines["language_model"][BACKEND]["cpu"] is HiLoReFSDPEngine


def test_the_patch_applies_to_verls_released_file(tmp_path):
    """patches/verl-0.9.1-actor-backend.patch against the installed 0.9.1 wheel's own file."""
    import shutil
    import subprocess
    from pathlib import Path

    import verl
    import verl.workers.engine as engine_pkg

    assert verl.__version__ == "0.9.1"
    patch = Path(__file__).resolve().parents[2] / "patches" / "verl-0.9.1-actor-backend.patch"
    target = tmp_path / "verl" / "workers" / "engine" / "__init__.py"
    target.parent.mkdir(parents=True)
    shutil.copy(engine_pkg.__file__, target)
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    out = subprocess.run(["git", "apply", str(patch)], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "hilore_actor.verl.register" in target.read_text()


def test_verify_check_passes_on_the_engine_and_fails_on_a_peak_over_b(verl_env, engines):
    """The GPU check's comparison (``verify.check``) on CPU: no failure for HiLoRe's engines;
    one when the budget it is held to is below the measured peak."""
    path, seed = verl_env
    td = verify.grpo_batch(seed + 3, vocab=VOCAB, full=True)
    loss_fn = verify.ppo_loss_fn()
    result = verify.check(engines, td, loss_fn, steps=1)
    print({k: result[k] for k in ("noise_floor", "relative_error", "peak_over_budget")})
    assert result["failures"] == [] and result["noise_floor"] == 0.0
    plan = engines("hilore-hr").hilore.plan
    real = plan.budget
    try:
        plan.budget = 1024  # bytes: every micro-batch is over it
        result = verify.check(engines, td, loss_fn, modes=("hilore-hr",), steps=0)
    finally:
        plan.budget = real
    assert len(result["failures"]) == 1 and "over B" in result["failures"][0]
