"""Saved-tensor kinds on a tiny LoRA model: every saved tensor gets exactly one kind, the
attention core's inputs and the projections' inputs are found, and compressing one kind
changes the gradient only when that kind was saved."""

import torch

from conftest import packed_microbatch
from benchmarks.bench.saved_kinds import KINDS, SavedKinds, kind_grad_errors
from hilore_actor.grpo.microbatch import Microbatch, microbatch_loss
from hilore_actor.models import LoraSpec, build_model, tiny_config
from hilore_actor.recovery import get_codec


def _setup(seed):
    model = build_model(
        tiny_config("llama", hidden_size=64, num_layers=2, vocab_size=128),
        lora=LoraSpec(rank=4, alpha=8, dropout=0.0),
        seed=seed,
    ).train()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    ids, pos = packed_microbatch(96, 128, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    n = ids.shape[1] - 1
    mb = Microbatch(
        ids,
        pos,
        -torch.rand(1, n, generator=gen),
        -torch.rand(1, n, generator=gen),
        torch.randn(1, n, generator=gen),
        (torch.rand(1, n, generator=gen) > 0.2).float(),
        loss_options={"clip_eps_low": 0.2},
    )
    return model, mb


def test_every_saved_tensor_gets_one_kind():
    seed = torch.seed() % 2**31
    print("seed", seed)
    model, mb = _setup(seed)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    total = [0]

    def count(t):  # the reference: a plain hook that counts what SavedKinds should classify
        if (
            t.is_floating_point()
            and not isinstance(t, torch.nn.Parameter)
            and t.untyped_storage().data_ptr() not in params
        ):
            total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(count, lambda x: x):
        microbatch_loss(model, mb).loss.backward()
    with SavedKinds(model) as sk:
        microbatch_loss(model, mb).loss.backward()
    print({k: v for k, v in sk.bytes.items() if v})
    assert sum(sk.bytes.values()) == total[0]
    for k in ("query", "key", "value", "attention input", "attention output", "mlp input", "activation", "lora"):
        assert sk.bytes[k] > 0, k


def test_compressing_one_kind_moves_the_gradient_only_if_it_was_saved():
    seed = torch.seed() % 2**31
    print("seed", seed)
    model, mb = _setup(seed)
    with SavedKinds(model) as sk:
        microbatch_loss(model, mb).loss.backward()
    errs = kind_grad_errors(model, microbatch_loss, [mb], get_codec("int8"))
    print(errs)
    assert set(errs) == set(KINDS)
    for k in KINDS:
        if sk.bytes[k] == 0:
            assert errs[k] == 0.0, k  # nothing of that kind was saved: nothing to compress
    for k in ("query", "key", "value", "attention input", "attention output", "mlp input", "activation"):
        assert 0.0 < errs[k] < 0.1, k  # each saves [tokens, >= 64] tensors, which int8 moves a little
