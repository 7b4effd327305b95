"""Weights sent from learner to rollout workers: merged LoRA equals the adapted model;
adapter and full round trips reproduce the learner's outputs."""

import pytest
import torch

from hilore_actor.models import LoraSpec, build_model, tiny_config
from hilore_actor.models.weights import export_weights, load_weights, merged_state_dict


def _trained(arch, seed):
    m = build_model(tiny_config(arch, hidden_size=32, num_layers=2, vocab_size=97), lora=LoraSpec(4, 8), seed=0)
    g = torch.Generator().manual_seed(seed)
    for p in m.parameters():
        if p.requires_grad:
            p.data = 0.05 * torch.randn(p.shape, generator=g)
    return m


@pytest.mark.parametrize("arch", ["qwen2", "llama", "phi3"])
def test_merged_weights_match_the_adapted_model(arch):
    seed = torch.seed() % 2**31
    m = _trained(arch, seed)
    plain = build_model(tiny_config(arch, hidden_size=32, num_layers=2, vocab_size=97), seed=1)
    missing = plain.load_state_dict(merged_state_dict(m), strict=True)
    assert not missing.missing_keys
    ids = torch.randint(0, 97, (2, 17), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids).logits, m(input_ids=ids).logits, atol=2e-5, rtol=1e-4)


def test_adapter_and_full_round_trips():
    seed = torch.seed() % 2**31
    src = _trained("qwen2", seed)
    dst = build_model(tiny_config("qwen2", hidden_size=32, num_layers=2, vocab_size=97), lora=LoraSpec(4, 8), seed=0)
    ids = torch.randint(0, 97, (1, 11))
    with torch.no_grad():
        assert not torch.equal(dst(input_ids=ids).logits, src(input_ids=ids).logits)
        load_weights(dst, export_weights(src, "adapter"), "adapter")
        assert torch.equal(dst(input_ids=ids).logits, src(input_ids=ids).logits)
    full_src = build_model(tiny_config("llama", hidden_size=32, num_layers=2, vocab_size=97), seed=seed)
    full_dst = build_model(tiny_config("llama", hidden_size=32, num_layers=2, vocab_size=97), seed=seed + 1)
    load_weights(full_dst, export_weights(full_src, "full"), "full")
    with torch.no_grad():
        assert torch.equal(full_dst(input_ids=ids).logits, full_src(input_ids=ids).logits)
    with pytest.raises(ValueError, match="adapter weights need a peft"):
        export_weights(full_src, "adapter")
    with pytest.raises(ValueError, match="unknown weight kind"):
        export_weights(src, "lora")


def _merged_all_at_once(model):
    """The export as it was: every LoRA delta built first, then folded in (the bitwise reference)."""
    from peft.tuners.lora import LoraLayer

    base, deltas, out = model.get_base_model(), {}, {}
    with torch.no_grad():
        for name, mod in base.named_modules():
            if isinstance(mod, LoraLayer):
                delta = torch.zeros_like(mod.get_base_layer().weight, dtype=torch.float32)
                for ad in mod.active_adapters:
                    if ad in mod.lora_A:
                        delta += mod.get_delta_weight(ad).float()
                deltas[name + ".weight"] = delta
        for k, v in base.state_dict().items():
            if ".lora_" not in k:
                clean, v = k.replace(".base_layer.", "."), v.detach().cpu()
                out[clean] = ((v.float() + deltas[clean].cpu()).to(v.dtype) if clean in deltas else v).clone()
    return out, deltas


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merged_export_holds_one_module_delta_at_a_time(dtype):
    """The merged export equals building every delta first (bitwise, same keys in the same order),
    and its peak above what it returns is one module's float32 delta and its temporaries, not the
    sum of every delta (which the old export held, 15x the largest one here)."""
    from hilore_actor.runtime import MemoryMeter

    seed = torch.seed() % 2**31
    print("seed", seed)
    m = build_model(tiny_config("qwen2", hidden_size=64, num_layers=4, vocab_size=97), lora=LoraSpec(4, 8), seed=0)
    m.to(dtype)
    g = torch.Generator().manual_seed(seed)
    for p in m.parameters():
        if p.requires_grad:
            p.data = (0.05 * torch.randn(p.shape, generator=g)).to(dtype)
    ref, deltas = _merged_all_at_once(m)
    largest, total = max(d.nbytes for d in deltas.values()), sum(d.nbytes for d in deltas.values())
    bound = 3 * largest + 16 * 2**10
    assert total > 2 * bound  # building all deltas first cannot pass
    del deltas
    with MemoryMeter("cpu") as meter:
        got = export_weights(m, "merged")
    over = meter.report.peak_bytes - meter.report.net_bytes
    print("peak above the result", over, "bound", bound, "largest delta", largest)
    assert over <= bound
    assert list(got) == list(ref)
    for k in ref:
        assert got[k].dtype == ref[k].dtype and torch.equal(got[k], ref[k]), k


def test_export_gathers_one_module_at_a_time():
    """With a ``gather`` (ZeRO-3's), every kind gathers one module's parameters at a time (a LoRA
    layer with its adapters), every parameter at least once, and a rank that keeps nothing makes
    the same gathers (collectives) and returns None."""
    import contextlib

    from peft.tuners.lora import LoraLayer

    m = _trained("qwen2", 3)
    owners = {id(p): n for n, mod in m.named_modules() if isinstance(mod, LoraLayer) for p in mod.parameters()}
    owners.update({id(p): n.rsplit(".", 1)[0] for n, p in m.named_parameters() if id(p) not in owners})
    for kind in ("merged", "full", "adapter"):
        calls = {True: [], False: []}
        for keep in (True, False):

            def gather(params, keep=keep):
                calls[keep].append([id(p) for p in params])
                return contextlib.nullcontext()

            out = export_weights(m, kind, gather=gather, keep=keep)
            assert (out is None) == (not keep)
            if keep:
                assert all(torch.equal(out[k], v) for k, v in export_weights(m, kind).items())
        assert calls[True] == calls[False] and calls[True]
        if kind != "adapter":  # the adapter: the LoRA tensors only, in one gather
            assert all(len({owners[i] for i in c}) == 1 for c in calls[True]), kind
            assert {i for c in calls[True] for i in c} == set(owners), kind


def test_zero3_export_gathers_module_by_module_on_two_ranks(tmp_path):
    """The learner's ZeRO-3 export (``zero3_gather``, every rank alike): rank 0's weights equal the
    unwrapped model's bitwise for every kind, no gather holds more than one LoRA layer (or the
    embedding), far from the whole model, and rank 1 returns None."""

    from torchrun import torchrun

    r0, r1 = torchrun("zero3_export_ranks.py", cwd=tmp_path)
    print(r0)
    assert r0["partitioned"]
    for kind in ("merged", "full", "adapter"):
        assert r0[kind]["equal"] and r1[kind]["none"], kind
        assert r0[kind]["gathers"] == r1[kind]["gathers"] > 0, kind
    for kind in ("merged", "full"):
        # the largest weight and its rank-4 LoRA A and B
        assert r0[kind]["gathers"] > 10 and r0[kind]["max_gathered"] <= r0["largest"] + 4 * (64 + 256), kind
        assert r0[kind]["max_gathered"] < r0[kind]["total"] / 5, kind
