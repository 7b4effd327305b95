"""The estimate's exact part (``hilore_actor/estimate/meta.py``) against the real thing on CPU:
each unit's saved bytes as the planner's own probes measure them (``profiling._bytes_at``), and
the in-microbatch peaks of gc, no-gc and a mixed plan as the planner's runner measures them, on
the bundled SmolLM2-135M (real weights) and three tiny random architectures (dense, MoE, sliding
window) at three token counts each."""

import pytest
import torch

from hilore_actor.allocation.profiling import _bytes_at
from hilore_actor.allocation.runner import Runner
from hilore_actor.estimate.meta import meta_microbatch, meta_model, step_peak, unit_bytes
from hilore_actor.grpo.microbatch import Microbatch, microbatch_loss
from hilore_actor.models import LoraSpec, build_model
from hilore_actor.recovery import RecoveryEngine
from hilore_actor.workloads import DEFAULT_LOSS

LEVELS = ("L", "L:bf16")  # the default codecs' levels: int8-g64 (the engine's), bf16


def loss_fn(model, mb):
    return microbatch_loss(model, mb)


@pytest.fixture(autouse=True)
def storage_meter(monkeypatch):
    """The CPU runs measure with the storage meter (``runtime/storage_meter.py``): the same live
    bytes as the profiler's meter, without its event log, which makes SmolLM2's passes minutes."""
    import hilore_actor.runtime.memory as memory

    monkeypatch.setattr(memory, "CPU_METER", "storage")


def _config(arch: str):
    from arch_sweep import tiny_config  # tests/helpers

    if arch == "smollm2":
        import transformers

        from hilore_actor.models.smollm2 import convert_smollm2

        return transformers.AutoConfig.from_pretrained(str(convert_smollm2()), local_files_only=True)
    return tiny_config(arch)


# (architecture, dtype, token counts): the MoE's grouped expert matmul has a meta kernel in
# bfloat16 only; the sliding window is 16 tokens (tests/helpers/arch_sweep.py)
CASES = [
    ("smollm2", torch.float32, (32, 64, 96)),
    ("qwen2", torch.float32, (32, 64, 96)),
    ("mixtral", torch.bfloat16, (32, 64, 96)),
    ("mistral", torch.float32, (8, 12, 16)),
]


def _real(arch, dtype, seed):
    config = _config(arch)
    if arch == "smollm2":
        from hilore_actor.models.smollm2 import convert_smollm2
        from hilore_actor.models import load_model

        model = load_model(convert_smollm2(), dtype=dtype, lora=LoraSpec(8, 16), seed=seed)
    else:
        model = build_model(config, dtype=dtype, lora=LoraSpec(8, 16), seed=seed)
    return config, model


def _cpu_microbatch(config, tokens, seed):
    g = torch.Generator().manual_seed(seed)
    f = lambda: torch.randn(1, tokens - 1, generator=g)  # noqa: E731
    ids = torch.randint(3, config.vocab_size, (1, tokens), generator=g)
    mask = torch.ones(1, tokens - 1)
    return Microbatch(ids, torch.arange(tokens)[None], f(), f(), f(), mask, loss_options=dict(DEFAULT_LOSS))


@pytest.mark.parametrize("arch, dtype, token_counts", CASES, ids=[c[0] for c in CASES])
def test_meta_bytes_are_the_planners_probes(arch, dtype, token_counts, fresh_seed):
    """Per unit H, each L level and an attention unit's MLP input: the meta forward's bytes equal
    the probes' on the CPU, to the byte."""
    print("seed", fresh_seed)
    config, real = _real(arch, dtype, fresh_seed)
    runner = Runner(real, RecoveryEngine(real), loss_fn=loss_fn)
    meta = RecoveryEngine(meta_model(config, dtype=dtype, lora=LoraSpec(8, 16)))
    assert meta.unit_names == runner.engine.unit_names
    for tokens in token_counts:
        cpu = _bytes_at(runner, _cpu_microbatch(config, tokens, fresh_seed), 1, LEVELS)
        est = unit_bytes(meta, loss_fn, meta_microbatch(tokens, 1, DEFAULT_LOSS), levels=LEVELS)
        for key in ("H", *LEVELS, "mixed"):
            assert est[key] == cpu[key], (tokens, key)


def test_meta_peaks_are_the_runners_within_a_percent_on_smollm2(fresh_seed):
    """gc (every unit R), no-gc (every unit H) and a plan that keeps every other unit: the
    meta device's peak against the CPU meter's (``Runner.run(measure_peak=True)``), gradients
    allocated inside the microbatch as the runner's passes allocate them."""
    print("seed", fresh_seed)
    config, real = _real("smollm2", torch.float32, fresh_seed)
    runner = Runner(real, RecoveryEngine(real), loss_fn=loss_fn)
    meta = RecoveryEngine(meta_model(config, dtype=torch.float32, lora=LoraSpec(8, 16)))
    names = runner.engine.unit_names
    mixed = {n: ("exact" if i % 2 else "checkpoint") for i, n in enumerate(names)}
    tokens = 96
    mb = _cpu_microbatch(config, tokens, fresh_seed)
    for plan in ("all-r", "all-h", mixed):
        measured = runner.run(mb, plan, measure_peak=True).peak_bytes
        predicted = step_peak(meta, loss_fn, meta_microbatch(tokens, 1, DEFAULT_LOSS), plan, grads_held=False)
        print(plan if isinstance(plan, str) else "mixed", measured, predicted)
        assert predicted == pytest.approx(measured, rel=0.01), plan


def test_an_moe_in_float32_is_named_not_a_traceback():
    """The one op found here without a float32 meta kernel (a grouped expert matmul): one message."""
    from hilore_actor.estimate.meta import MetaUnsupported

    meta = RecoveryEngine(meta_model(_config("mixtral"), dtype=torch.float32))
    with pytest.raises(MetaUnsupported, match="BF16"):
        unit_bytes(meta, loss_fn, meta_microbatch(32, 1, DEFAULT_LOSS))
