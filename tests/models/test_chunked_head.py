"""The chunked head against the plain one: same log-probs and gradients (float rounding)."""

import pytest
import torch

from hilore_actor.models import LoraSpec, build_model, tiny_config
from hilore_actor.models.chunked_head import ChunkedTokenLogProbs, chunked_token_log_probs
from hilore_actor.models.logprobs import sequence_log_probs


def test_function_matches_plain_log_softmax():
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    h = torch.randn(7, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(11, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    b = torch.randn(11, dtype=torch.float64, generator=gen, requires_grad=True)
    lab = torch.randint(0, 11, (7,), generator=gen)
    f = lambda h, w, b: ChunkedTokenLogProbs.apply(h, w, b, lab, 3).double()  # noqa: E731
    out = f(h, w, b)
    ref = (torch.nn.functional.linear(h, w, b).float().log_softmax(-1).gather(-1, lab[:, None]).squeeze(-1)).double()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    g = torch.randn(7, dtype=torch.float64, generator=gen)
    got = torch.autograd.grad((out * g).sum(), (h, w, b))
    want = torch.autograd.grad((ref * g).sum(), (h, w, b))
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("scale", [1.0, 1 / 0.7])
def test_entropy_and_temperature_match_autograd(scale):
    """With a temperature (``scale`` = 1 / T) and the entropy output, values and gradients of
    any weighted sum of log-probs and entropies equal autograd through the full softmax."""
    seed = torch.seed() % 2**31
    print("seed", seed)
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(9, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(13, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    b = torch.randn(13, dtype=torch.float64, generator=gen, requires_grad=True)
    lab = torch.randint(0, 13, (9,), generator=gen)
    lp, ent = ChunkedTokenLogProbs.apply(h, w, b, lab, 4, scale, True)
    z = torch.nn.functional.linear(h, w, b) * scale
    ref_lp = z.log_softmax(-1).gather(-1, lab[:, None]).squeeze(-1)
    ref_ent = -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)
    torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=1e-5)
    g, ge = torch.randn(9, dtype=torch.float64, generator=gen), torch.randn(9, dtype=torch.float64, generator=gen)
    got = torch.autograd.grad((lp * g).sum() + (ent * ge).sum(), (h, w, b))
    want = torch.autograd.grad((ref_lp * g).sum() + (ref_ent * ge).sum(), (h, w, b), retain_graph=True)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)
    # entropy computed but unused by the loss: the log-prob gradient alone
    lp2, _ = ChunkedTokenLogProbs.apply(h, w, b, lab, 4, scale, True)
    for a, e in zip(
        torch.autograd.grad((lp2 * g).sum(), (h, w, b)), torch.autograd.grad((ref_lp * g).sum(), (h, w, b))
    ):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch,tied", [("qwen2", False), ("llama", True), ("phi3", False)])
def test_model_log_probs_and_grads_match(arch, tied):
    model = build_model(
        tiny_config(arch, hidden_size=64, vocab_size=300, tie_word_embeddings=tied), lora=LoraSpec(4, 8)
    )
    ids = torch.randint(3, 300, (1, 50))
    pos = torch.cat([torch.arange(20), torch.arange(30)])[None]
    w = torch.randn(1, 49)
    lp_ref = sequence_log_probs(model, ids, position_ids=pos)
    (lp_ref * w).sum().backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    lp = chunked_token_log_probs(model, ids, pos, chunk=16)
    (lp * w).sum().backward()
    torch.testing.assert_close(lp, lp_ref, rtol=1e-5, atol=1e-5)
    for n, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, ref[n], rtol=1e-4, atol=1e-6)


def test_a_model_whose_logits_are_not_the_linear_head_keeps_its_own_logits():
    import transformers

    from hilore_actor.models.chunked_head import head_is_linear

    seed = torch.seed() % 2**31
    print("seed", seed)
    cfg = transformers.Gemma2Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        final_logit_softcapping=0.01,
    )  # a cap well inside the logits' range
    capped, plain = (
        build_model(cfg, seed=seed),
        build_model(tiny_config("qwen2", hidden_size=32, num_layers=2, vocab_size=128), seed=seed),
    )
    assert not head_is_linear(capped) and head_is_linear(plain)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(seed))
    for model in (capped, plain):
        ref = sequence_log_probs(model, ids)
        torch.testing.assert_close(chunked_token_log_probs(model, ids), ref, rtol=1e-5, atol=1e-5)
    z = torch.nn.functional.linear(capped.get_decoder()(input_ids=ids).last_hidden_state, capped.lm_head.weight)
    uncapped = torch.log_softmax(z[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    gap = (uncapped - sequence_log_probs(capped, ids)).abs().max()
    print("gap", float(gap))
    assert gap > 1e-2  # the check had something to catch


def test_cuda_chunks_are_sized_for_the_device_and_cpu_keeps_its_rule():
    """On CUDA a chunk streams the whole head: at Qwen's vocabulary the old 32 MiB rule gave 55
    rows (the head read ~75 times per 4096 tokens); the rule gives >= 1024 there, more for a small
    vocabulary, and a known room caps it. The CPU rule is the old one, unchanged."""
    from hilore_actor.models.chunked_head import chunk_row_bytes, head_chunk_rows

    bf16 = torch.bfloat16
    assert head_chunk_rows("cuda", 151936, 2048, bf16) >= 1024
    assert head_chunk_rows("cuda", 32768, 2048, bf16) == 2048
    for v in (97, 32000, 49152, 151936, 256000):
        assert head_chunk_rows("cpu", v, 2048, bf16) == max(16, 32 * 2**20 // (4 * v))
    assert head_chunk_rows("cpu", 151936, 2048, bf16, room_bytes=10**12) == 55
    room = 8 * 300 * chunk_row_bytes(151936, 2048, bf16)
    assert head_chunk_rows("cuda", 151936, 2048, bf16, room_bytes=room) == 300
    assert head_chunk_rows("cuda", 151936, 2048, bf16, room_bytes=0) == 16
    assert head_chunk_rows("cuda", 151936, 2048, bf16, room_bytes=10**12) == head_chunk_rows("cuda", 151936, 2048, bf16)


@pytest.mark.parametrize("entropy", [False, True])
def test_the_cuda_chunk_and_a_small_one_match_the_full_head(entropy):
    """Log-probs, entropies and the gradients of hidden, head and bias through one CUDA-sized
    chunk (all rows) and through chunks of 7 rows equal the full head's autograd (float64
    inputs; the head computes in float32)."""
    from hilore_actor.models.chunked_head import head_chunk_rows

    seed = torch.seed() % 2**31
    print("seed", seed)
    gen = torch.Generator().manual_seed(seed)
    n, hdim, vocab = 600, 16, 3001
    h = torch.randn(n, hdim, dtype=torch.float64, generator=gen, requires_grad=True)
    w = (0.3 * torch.randn(vocab, hdim, dtype=torch.float64, generator=gen)).requires_grad_()
    b = torch.randn(vocab, dtype=torch.float64, generator=gen, requires_grad=True)
    lab = torch.randint(0, vocab, (n,), generator=gen)
    g, ge = torch.randn(n, dtype=torch.float64, generator=gen), torch.randn(n, dtype=torch.float64, generator=gen)
    z = torch.nn.functional.linear(h, w, b)
    ref_lp = z.log_softmax(-1).gather(-1, lab[:, None]).squeeze(-1)
    ref_ent = -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)
    loss = (ref_lp * g).sum() + ((ref_ent * ge).sum() if entropy else 0)
    want = torch.autograd.grad(loss, (h, w, b))
    big = head_chunk_rows("cuda", vocab, hdim, torch.float64)
    assert big >= n
    for chunk in (big, 7):
        out = ChunkedTokenLogProbs.apply(h, w, b, lab, chunk, 1.0, entropy)
        lp, ent = out if entropy else (out, None)
        torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-5, atol=1e-5)
        if entropy:
            torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=1e-5)
        got = torch.autograd.grad((lp * g).sum() + ((ent * ge).sum() if entropy else 0), (h, w, b))
        for a, e in zip(got, want):
            torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)


def test_the_model_path_and_the_openrlhf_drop_in_share_the_rule(monkeypatch):
    """``chunked_token_log_probs`` (the job and the benchmark) and the OpenRLHF forward ask
    ``head_chunk_rows`` with the head's device, vocabulary, width and dtype."""
    from hilore_actor.models import chunked_head
    from hilore_actor.openrlhf import actor_forward as orl_head

    assert orl_head.head_chunk_rows is chunked_head.head_chunk_rows
    seen = []
    real = chunked_head.head_chunk_rows
    monkeypatch.setattr(chunked_head, "head_chunk_rows", lambda *a, **k: seen.append(a) or real(*a, **k))
    model = build_model(tiny_config("qwen2", hidden_size=32, num_layers=1, vocab_size=128))
    chunked_token_log_probs(model, torch.randint(0, 128, (1, 9)))
    assert seen == [("cpu", 128, 32, torch.float32)]
