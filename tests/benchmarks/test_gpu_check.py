"""``benchmarks/gpu_check.sh`` and the CUDA-only tests its cuda-tests stage runs.

The dry run runs here (no GPU): every stage's command line checked, the plan within 540 s
with every timeout at least twice its estimate (``benchmarks/gpu_check_plan.py``, whose pass
count follows the benchmark's code and workload), the files under $OUT; a dry run with a broken
stage, one whose plan breaks that rule and one with a Python that cannot import the package
must fail, saying why. ``TestCuda`` (skipped without a CUDA device) checks on a
GPU what the CPU suite checks on the CPU: the CUDA memory meter against the allocator, H, P, R
and gc against no-gc, L's codecs, and that R frees what H holds.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import downgrade_peaks, packed_microbatch, rel_err

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
STAGES = ["selfcheck", "gpu-ref", "verl", "cuda-tests"]
MB = 2**20


def dry_run(out, python=sys.executable, **env):
    e = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")}
    e.update(OUT=str(out), PYTHON=str(python), **env)
    r = subprocess.run(["bash", str(SCRIPT), "--dry-run"], cwd=ROOT, env=e, capture_output=True, text=True, timeout=240)
    print(r.stdout[-4000:], r.stderr[-2000:])
    return r, json.loads((out / "summary.json").read_text())


def test_the_dry_run_checks_every_stage_and_plans_within_nine_minutes(tmp_path):
    r, summary = dry_run(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert summary["mode"] == "dry-run" and summary["exit_status"] == 0
    stages = {s["name"]: s for s in summary["stages"]}
    assert list(stages) == STAGES and all(s["status"] == "passed" for s in stages.values())
    limits = [s["timeout_s"] for s in summary["stages"]]
    assert all(t > 0 for t in limits) and summary["planned_timeout_s"] == sum(limits) <= 540
    assert all(s["timeout_s"] >= 2 * s["estimate_s"] > 0 for s in summary["stages"])
    assert stages["gpu-ref"]["timeout_s"] >= 240  # the benchmark stage has most of the time
    printed = {
        m[1]: (float(m[2]), int(m[3]), float(m[4]))
        for m in re.finditer(r"^  (\S+) +(\d+)s +(\d+)s +([\d.]+)x  ", r.stdout, re.M)
    }
    assert set(printed) == set(STAGES) | {"total"}, printed
    for name, (estimate, timeout, headroom) in printed.items():
        assert headroom >= 2 and abs(headroom - timeout / estimate) < 0.05, (name, printed[name])
    assert printed["total"][1] == sum(printed[s][1] for s in STAGES) <= 540
    assert "gpu-ref's estimate, row by row" in r.stdout and "timing: 4 methods" in r.stdout
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == sorted(["selfcheck.txt", "gpu-ref.log", "verl.log", "cuda-tests.log", "summary.json"])
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", f) for f in files) and len(files) <= 8
    selfcheck = (tmp_path / "selfcheck.txt").read_text()
    for item in (
        "python",
        "torch",
        "cuda",
        "hilore_actor",
        "transformers",
        "peft",
        "verl",
        "deepspeed",
        "free disk",
        "OUT",
    ):
        assert re.search(rf"^\w+ +{item}:", selfcheck, re.M), item
    assert "total" in selfcheck and "gpu-ref" in selfcheck  # the plan is kept beside the self-check
    assert "--workload gpu-ref" in r.stdout and "--methods gc,no-gc,hilore-hr " in r.stdout
    assert "arguments ok" in (tmp_path / "gpu-ref.log").read_text()
    assert "arguments ok" in (tmp_path / "verl.log").read_text()
    collected = (tmp_path / "cuda-tests.log").read_text()
    assert "test_gpu_check.py::TestCuda::test_" in collected
    assert "test_engine.py" not in collected and "test_memory.py" not in collected  # CPU suites: not on the GPU's time


def test_a_plan_that_breaks_the_rule_fails_the_dry_run_before_any_stage(tmp_path):
    r = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "GPU_CHECK_BENCH_ARGS": "--repeats 20"},
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert re.search(r"plan problem: gpu-ref: headroom [\d.]+ < 2", r.stderr), r.stderr
    assert "== selfcheck" not in r.stdout and not (tmp_path / "summary.json").exists()


def _planner():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check_plan", ROOT / "benchmarks" / "gpu_check_plan.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_plans_pass_count_follows_the_benchmarks_code():
    """What ``gpu_check_plan`` counts passes from must be what the benchmark runs: the workload's
    shape, the benchmark's defaults, the planner's loop bounds and modes."""
    import inspect

    from hilore_actor.allocation.planner import Planner
    from benchmarks.bench import methods
    from benchmarks.bench.cli import build_parser
    from benchmarks.bench.workloads import WORKLOADS
    from hilore_actor.recovery.policies import ENGINE_POLICIES

    plan = _planner()
    wl = WORKLOADS["gpu-ref"]
    assert {
        k: wl.model[k]
        for k in ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "vocab_size")
    } == {k: v for k, v in plan.GPU_REF.items() if k in wl.model}
    assert (wl.microbatches, wl.tokens, wl.calib_tokens) == tuple(
        plan.GPU_REF[k] for k in ("microbatches", "tokens", "calib_tokens")
    )
    d = build_parser().parse_args([])
    assert {k: getattr(d, k) for k in plan.BENCH_DEFAULTS} == plan.BENCH_DEFAULTS
    assert {n: (m, p) for n, (m, p, _) in methods.VARIANTS.items()} == plan.HILORE
    assert plan.PLAIN == {"no-gc", "gc", "gc-aa", *ENGINE_POLICIES}
    config = Planner.Config()
    assert methods.PROFILE_REPEATS == plan.PROFILE_REPEATS and config.loo_units == plan.LOO_UNITS
    assert len(config.plan_risk_scales) == plan.RISK_SCALES["hilore"]
    assert inspect.signature(Planner._fit).parameters["attempts"].default == plan.FIT_ATTEMPTS
    assert inspect.signature(Planner._drop_useless).parameters["repeats"].default == plan.LOO_REPEATS
    assert abs(plan.params() - 3.09e9) < 0.01e9  # Qwen2.5-3B


def test_the_plan_counts_what_each_argument_adds():
    plan = _planner()
    base = ["--workload", "gpu-ref", "--methods", "gc,no-gc,hilore-hr", "--repeats", "3", "--updates", "1", "--no-loo"]
    rows = {r.what.split(":")[0]: r for r in plan.gpu_ref_passes(base)}
    assert rows["timing"].count == 4 * (1 + 3) * 4  # gc, gc-aa, no-gc, hilore-hr; a warm-up and 3 repeats; 4 mbs
    assert rows["records"].count == 4 * (1 + 2 * 3)  # no-gc's reference, then peaks and gradients of all but gc-aa
    assert "calibration" not in rows  # hilore-hr needs none
    more = plan.gpu_ref_passes(base[:3] + ["gc,no-gc,hilore-hr,hilore"] + base[4:])
    calib = next(r for r in more if r.what.startswith("calibration"))
    assert calib.count == 2 * 16 * (1 + 72) and calib.tokens == 1024  # 2 L levels, --calib 16, 72 units
    assert plan.gpu_ref_estimate(base + ["--no-aa", "--repeats", "1"])[0] < plan.gpu_ref_estimate(base)[0]
    with pytest.raises(ValueError, match="not modelled"):
        plan.gpu_ref_passes(base[:3] + ["gc,compile-budget"])


def test_a_broken_stage_fails_the_dry_run_and_the_others_still_run(tmp_path):
    r, summary = dry_run(tmp_path, GPU_CHECK_BENCH_ARGS="--no-such-flag")
    assert r.returncode == 1 and summary["exit_status"] == 1
    status = {s["name"]: s["status"] for s in summary["stages"]}
    assert status == {"selfcheck": "passed", "gpu-ref": "failed", "verl": "passed", "cuda-tests": "passed"}
    assert "unrecognized arguments: --no-such-flag" in (tmp_path / "gpu-ref.log").read_text()
    assert "== gpu-ref: failed" in r.stdout


def test_a_python_without_the_package_stops_at_the_self_check(tmp_path):
    python = tmp_path / "bare-python"  # no site-packages, no PYTHONPATH: neither torch nor hilore_actor
    python.write_text(f'#!/bin/sh\nexec {sys.executable} -I -S "$@"\n')
    python.chmod(0o755)
    out = tmp_path / "out"
    r, summary = dry_run(out, python=python)
    assert r.returncode == 1
    status = {s["name"]: s["status"] for s in summary["stages"]}
    assert status == {"selfcheck": "failed", "gpu-ref": "skipped", "verl": "skipped", "cuda-tests": "skipped"}
    line = next(x for x in r.stdout.splitlines() if x.startswith("self-check failed"))
    assert "torch" in line and "hilore_actor" in line
    assert re.search(r"MISSING +hilore_actor: not importable", (out / "selfcheck.txt").read_text())


def test_arguments_other_than_dry_run_are_refused(tmp_path):
    r = subprocess.run(
        ["bash", str(SCRIPT), "--bogus"],
        cwd=ROOT,
        env={**os.environ, "OUT": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2 and "usage" in r.stderr and not (tmp_path / "summary.json").exists()


def test_the_verl_stage_names_a_missing_module_and_exits_as_skipped(tmp_path):
    code = (
        "import sys; sys.modules['tensordict'] = None\n"
        "from hilore_actor.verl.gpu_check import main; sys.exit(main(sys.argv[1:]))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, "--out", str(tmp_path / "verl.json")],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    print(r.stdout[-2000:], r.stderr[-2000:])
    assert r.returncode == 3
    assert "skipped: verl's engine path cannot be imported: missing module tensordict" in r.stdout
    assert json.loads((tmp_path / "verl.json").read_text())["skipped"].startswith("missing module tensordict")


def test_the_verl_check_keeps_what_it_logged_in_its_result_while_it_runs(tmp_path, monkeypatch):
    """A verl stage cut short by its timeout leaves verl.json with every line logged so far."""
    from hilore_actor.verl import gpu_check, verify

    out = tmp_path / "verl.json"
    seen = []

    def check_cut_short(path, args, log):
        log("[verify] verl: gradient norm 1.5")
        seen.append(json.loads(out.read_text()))
        raise KeyboardInterrupt  # stands for the kill: nothing after this line runs

    monkeypatch.setattr(gpu_check, "import_engine_path", lambda allowed: ([], None))
    monkeypatch.setattr(verify, "one_gpu_process_group", lambda *a: True)
    monkeypatch.setattr(gpu_check, "write_model", lambda path, *a: path)
    monkeypatch.setattr(gpu_check, "reduced_check", check_cut_short)
    with pytest.raises(KeyboardInterrupt):
        gpu_check.main(["--out", str(out), "--workdir", str(tmp_path)])
    doc = json.loads(out.read_text())
    assert doc["partial"] is True and doc["log"][-1] == "[verify] verl: gradient norm 1.5" and seen[0] == doc
    assert doc["log"][0].startswith("[verl-check] writing a random Qwen2") and len(doc["log"]) == 3
    assert sorted(x.name for x in tmp_path.iterdir()) == ["verl.json"]


def test_the_ray_stand_in_answers_only_is_initialized():
    from hilore_actor.verl.gpu_check import ray_stand_in

    ray = ray_stand_in()
    assert ray.is_initialized() is False and not isinstance(object(), ray.ObjectRef)
    for use in (lambda: ray.get([]), lambda: ray.remote(object), lambda: ray.util.get_node_ip_address()):
        with pytest.raises((RuntimeError, AttributeError), match="stand-in|get_node_ip_address"):
            use()


# ---- on a GPU (the check's cuda-tests stage) ----------------------------------------------------
VOCAB = 128


def _model(seed, layers=2, hidden=64):
    from hilore_actor.models import LoraSpec, build_model, init_lora_b, tiny_config

    model = build_model(
        tiny_config("qwen2", hidden_size=hidden, num_layers=layers, vocab_size=VOCAB),
        lora=LoraSpec(rank=4, alpha=8, dropout=0.0),
        seed=seed,
    )
    init_lora_b(model, 1e-2, seed)
    return model.to("cuda").train()


def _batch(total, seed, n_seqs=3):
    ids, pos = packed_microbatch(total, VOCAB, n_seqs=n_seqs, seed=seed)
    return ids.cuda(), pos.cuda()


def _loss(model, ids, pos, seed=0):
    """conftest's GRPO loss, its random coefficients made on the CPU and moved to the device."""
    from hilore_actor.grpo import policy_loss
    from hilore_actor.models.logprobs import token_log_probs

    gen = torch.Generator().manual_seed(seed)
    out = model(input_ids=ids, position_ids=pos, use_cache=False)
    logp = token_log_probs(out.logits[:, :-1], ids[:, 1:])
    noise = [torch.randn(logp.shape, generator=gen).to(logp.device) for _ in range(2)]
    mask = (torch.rand(logp.shape, generator=gen) > 0.2).float().to(logp.device)
    adv = torch.randn(logp.shape, generator=gen).to(logp.device)
    loss, _ = policy_loss(logp, logp.detach() + 0.1 * noise[0], adv, mask, logp.detach() + 0.1 * noise[1], kl_coef=0.01)
    return loss


def _grads(model, ids, pos, engine=None, plan=None):
    model.zero_grad(set_to_none=True)
    step = None
    if engine is None:
        _loss(model, ids, pos).backward()
    else:
        with engine.step(plan) as step:
            _loss(model, ids, pos).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}, step


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (bash benchmarks/gpu_check.sh runs it on one)"
)
class TestCuda:
    def test_meter_reads_the_allocator_and_leaves_the_hosts_peak(self):
        from hilore_actor.runtime import MemoryMeter

        dev = torch.device("cuda", 0)
        keep = torch.empty(MB, dtype=torch.uint8, device=dev)  # live before the region
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(0)  # the host's own reset
        with MemoryMeter(dev) as m:
            a = torch.empty(4 * MB, dtype=torch.uint8, device=dev)
            del a
            b = torch.empty(2 * MB, dtype=torch.uint8, device=dev)
            m.mark("b")
            c = torch.empty(3 * MB, dtype=torch.uint8, device=dev)
            del c
        print(m.report)
        assert m.report.peak_before["b"] == 4 * MB and m.report.peak_since["b"] == 5 * MB
        assert m.peak_bytes == 5 * MB and m.report.net_bytes == 2 * MB
        assert torch.cuda.max_memory_allocated(0) == m.report.max_allocated_bytes
        assert m.report.max_reserved_bytes >= m.report.max_allocated_bytes
        del b, keep

    def test_h_p_r_and_gc_match_no_gc(self, fresh_seed):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        from hilore_actor.recovery import RecoveryEngine, apply_baseline

        print("seed", fresh_seed)
        model = _model(fresh_seed)
        ids, pos = _batch(96, fresh_seed)
        ref, _ = _grads(model, ids, pos)
        # no-gc itself is not bitwise repeatable here: SDPA with the packed mask runs the
        # memory-efficient kernel, whose float32 backward adds dQ with atomics in no fixed order,
        # so two runs may agree exactly and the next differ. The floor is what float32 summation
        # order alone changes: two more no-gc runs and one on SDPA's math backend (another order,
        # which does not come out equal by chance). A wrong saved tensor or recomputation is off
        # by orders of magnitude more than 4x that.
        floor = max(rel_err(_grads(model, ids, pos)[0], ref) for _ in range(2))
        with sdpa_kernel(SDPBackend.MATH):
            floor = max(floor, rel_err(_grads(model, ids, pos)[0], ref))
        tol = max(4 * floor, 1e-6)
        engine = RecoveryEngine(model)
        errs = {plan: rel_err(_grads(model, ids, pos, engine, plan)[0], ref) for plan in ("all-h", "all-p", "all-r")}
        engine.detach()
        apply_baseline(model, "gc")
        errs["gc"] = rel_err(_grads(model, ids, pos)[0], ref)
        apply_baseline(model, "no-gc")
        print(f"noise floor {floor:.3g}; {errs}")
        assert all(e <= tol for e in errs.values()), (errs, tol)

    @pytest.mark.parametrize("codec", ["int8-g64", "bf16", "fp8-e4m3"])
    def test_all_l_is_close_on_the_device(self, fresh_seed, codec):
        from hilore_actor.recovery import RecoveryEngine

        print("seed", fresh_seed)
        model = _model(fresh_seed)
        ids, pos = _batch(96, fresh_seed)
        ref, _ = _grads(model, ids, pos)
        engine = RecoveryEngine(model, codec=codec)
        g, step = _grads(model, ids, pos, engine, "all-l")
        err, recon = rel_err(g, ref), step.reconstruction_errors()
        engine.detach()
        print(f"{codec}: all-l gradient rel. error {err:.4f}; reconstruction {max(recon.values()):.4f} max")
        assert 0.0 < err < (0.25 if codec.startswith("fp8") else 0.05)
        assert set(recon) == set(engine.unit_names) and all(0 < e < 0.2 for e in recon.values())

    def test_r_after_forward_frees_what_h_holds(self, fresh_seed):
        """As on the CPU (tests/recovery/test_engine.py), measured by the CUDA meter: after a downgrade to
        R, the backward's peak is lower than H's by at least 80% of the exact bundle bytes."""
        print("seed", fresh_seed)
        model = _model(fresh_seed, layers=8, hidden=128)
        ids, pos = _batch(256, fresh_seed)
        peaks, bundle = downgrade_peaks(model, lambda m: _loss(m, ids, pos), "cuda")  # its first pair warms up
        saved = peaks["H"] - peaks["R"]
        print(f"bundle {bundle} B, peak H {peaks['H']} B, peak R {peaks['R']} B, saved {saved / max(bundle, 1):.1%}")
        assert bundle > 0 and saved >= 0.8 * bundle
