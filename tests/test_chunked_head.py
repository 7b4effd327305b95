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
    for a, e in zip(torch.autograd.grad((lp2 * g).sum(), (h, w, b)), torch.autograd.grad((ref_lp * g).sum(), (h, w, b))):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch,tied", [("qwen2", False), ("llama", True), ("phi3", False)])
def test_model_log_probs_and_grads_match(arch, tied):
    model = build_model(tiny_config(arch, hidden_size=64, vocab_size=300, tie_word_embeddings=tied), lora=LoraSpec(4, 8))
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
    cfg = transformers.Gemma2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                    final_logit_softcapping=0.01)  # a cap well inside the logits' range
    capped, plain = build_model(cfg, seed=seed), build_model(tiny_config("qwen2", hidden_size=32, num_layers=2,
                                                                          vocab_size=128), seed=seed)
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
