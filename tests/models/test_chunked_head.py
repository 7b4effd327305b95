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


class _Float32CopyHead(ChunkedTokenLogProbs):
    """The head as it was: each chunk's weight gradient ``gw.addmm_(gl.t().float(), h.float())``
    (a float32 GEMM on a float32 ``[V, chunk]`` copy of the logit gradient), the float32 logits
    still held. Kept here only as the reference the new path is measured against."""

    @staticmethod
    def backward(ctx, grad, grad_ent=None):
        hidden, weight, bias, labels, lse, ent = ctx.saved_tensors
        assert bias is None and not ctx.entropy and ctx.scale == 1.0
        gh = torch.empty_like(hidden)
        gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        c = ctx.chunk
        for i in range(0, hidden.shape[0], c):
            h, g = hidden[i : i + c], grad[i : i + c].float()
            z = torch.nn.functional.linear(h, weight).float()
            dz = z.sub_(lse[i : i + c, None]).exp_().mul_(-g[:, None])
            dz.scatter_add_(-1, labels[i : i + c, None], g[:, None])
            gl = dz.to(hidden.dtype)
            gh[i : i + c] = gl @ weight
            gw.addmm_(gl.t().float(), h.float())
        return gh, gw.to(weight.dtype), None, None, None, None, None


def _head_case(seed, dtype, n, hdim, vocab):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hdim, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hdim, generator=gen) / hdim**0.5).to(dtype).requires_grad_()
    lab = torch.randint(0, vocab, (n,), generator=gen)
    g = torch.randn(n, generator=gen)
    return h, w, lab, g


def test_a_bf16_heads_weight_gradient_holds_no_float32_copy_of_the_logit_gradient(fresh_seed):
    """bf16 head, full fine-tuning: the backward's peak (CPU meter, forward + backward of the head)
    is below the float32-copy path's by at least that copy, 4 * chunk * V bytes; the gradients
    stay within bf16 rounding of it. The shapes put the peak in the chunk loop (chunk > H / 3:
    the chunk's float32 logits outweigh the final float32 -> bf16 cast of the [V, H] gradient)."""
    from hilore_actor.runtime import MemoryMeter

    print("seed", fresh_seed)
    n, hdim, vocab, chunk = 256, 64, 8192, 64
    h, w, lab, g = _head_case(fresh_seed, torch.bfloat16, n, hdim, vocab)
    peaks, grads = {}, {}
    for name, fn in (("float32 copy", _Float32CopyHead), ("bf16 GEMM", ChunkedTokenLogProbs)):
        with MemoryMeter("cpu") as m:
            out = fn.apply(h, w, None, lab, chunk)
            grads[name] = torch.autograd.grad((out * g).sum(), (h, w))
        peaks[name] = m.report.peak_bytes
    drop, copy = peaks["float32 copy"] - peaks["bf16 GEMM"], 4 * chunk * vocab
    print(f"peaks {peaks}; drop {drop} B, the float32 [chunk, V] copy {copy} B")
    assert drop >= copy
    assert torch.equal(grads["float32 copy"][0], grads["bf16 GEMM"][0])  # the hidden gradient: untouched
    old, new = (grads[k][1].double() for k in ("float32 copy", "bf16 GEMM"))
    assert (new - old).abs().max() <= 2**-7 * old.abs().max()


@pytest.mark.parametrize("dtype, chunk", [(torch.float32, 16), (torch.bfloat16, 16), (torch.bfloat16, 5)])
def test_full_fine_tunings_head_gradient_matches_a_float64_full_head(fresh_seed, dtype, chunk):
    """A full fine-tuning model's head-weight gradient through the chunked head (several chunks)
    against autograd of the full head in float64 on the same hidden states and weights. bf16 at
    5 rows a chunk: each chunk's product in 4 tiles of head rows (8 for the last chunk, of 2
    rows), as a GPU head at H = 4096 takes 2 per 1024-row chunk; at 16 rows, one tile.

    float32: within 1e-6 of the largest entry (float32 rounding, ~2e-7 here), and bitwise the
    float32-copy path (the head in the accumulator's dtype: one addmm_, as before).
    bf16: elementwise, to first order in u = 2^-8 (bf16's unit roundoff), with dz = g (onehot - p)
    the float64 logit gradient and S = |dz|^T |h|:
    - the logits come out of the GEMM rounded to bf16: |dZ| <= d = (u + H 2^-24) |h| |W|^T (the
      float32 sums inside it), which moves the softmax by |dp_k| <= p_k (d_k + sum_j p_j d_j), and
      the weight gradient by at most T = |h|^T (|g| |dp|);
    - three bf16 roundings of at most u each: the logit gradient (u S), each chunk's product
      (u S over the chunks) and the returned gradient (u S); float32 sums across chunks ~2^-24 S.
    |error| <= 1.1 (3 u S + T), 1.1 for second-order terms. Accumulating in bf16 (the float32 sum
    rounded after every chunk) breaks it at 12 chunks. Printed beside the model's own bf16
    head's error."""
    print("seed", fresh_seed)
    gen = torch.Generator().manual_seed(fresh_seed)
    vocab, hdim = 512, 32
    model = build_model(tiny_config("qwen2", hidden_size=hdim, num_layers=1, vocab_size=vocab), seed=fresh_seed)
    model.to(dtype)
    ids = torch.randint(3, vocab, (1, 193), generator=gen)  # 12 or 39 chunks
    wt = torch.randn(1, 192, generator=gen)
    head = model.get_output_embeddings()
    assert head.weight.requires_grad and model.get_input_embeddings().weight is not head.weight
    (chunked_token_log_probs(model, ids, chunk=chunk) * wt).sum().backward()
    got = head.weight.grad.double()
    with torch.no_grad():
        hid = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[0, :-1]
    h64, lab, g = hid.double(), ids[0, 1:], wt[0].double()
    w64 = head.weight.detach().double().requires_grad_()
    z = torch.nn.functional.linear(h64, w64)
    (z.log_softmax(-1).gather(-1, lab[:, None]).squeeze(-1) * g).sum().backward()
    ref = w64.grad
    err = (got - ref).abs()
    print(f"{dtype}: max |error| / max |ref| = {float(err.max() / ref.abs().max()):.3g}")
    if dtype == torch.float32:
        assert err.max() <= 1e-6 * ref.abs().max()
        model.zero_grad()
        (_Float32CopyHead.apply(hid.detach(), head.weight, None, lab, chunk) * g.float()).sum().backward()
        assert torch.equal(head.weight.grad, got.float())
        return
    u = 2.0**-8
    p = z.detach().softmax(-1)
    dz = g[:, None] * (torch.nn.functional.one_hot(lab, vocab).double() - p)
    d = (u + hdim * 2.0**-24) * (h64.abs() @ w64.detach().abs().t())
    dp = p * (d + (p * d).sum(-1, keepdim=True))
    bound = 1.1 * (3 * u * (dz.abs().t() @ h64.abs()) + (g.abs()[:, None] * dp).t() @ h64.abs())
    print(f"largest error / bound {float((err / bound).max()):.3f}")
    assert (err <= bound).all()
    own = torch.nn.functional.linear(hid, head.weight.detach().requires_grad_())
    plain = torch.autograd.grad((own.float().log_softmax(-1).gather(-1, lab[:, None]).squeeze(-1) * wt[0]).sum(), own)
    plain_w = (plain[0].t() @ hid).double()  # the model's own head: one bf16 GEMM over all rows
    print(f"own bf16 head: max |error| / max |ref| = {float((plain_w - ref).abs().max() / ref.abs().max()):.3g}")
