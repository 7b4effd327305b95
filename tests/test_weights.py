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
