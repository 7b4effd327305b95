"""The KEEP_EXACT table, one test per kind: each kind of tensor really stays exact under L; and
the attention kernels a partial unit keeps (flash-attn's custom ops through a CPU stand-in)."""

from typing import Optional, Tuple

import pytest
import torch

from conftest import grads, grpo_loss, packed_microbatch, rel_err
from hilore_actor.models import LoraSpec, build_model, tiny_config
from hilore_actor.recovery import RecoveryEngine, get_codec
from hilore_actor.recovery.rules import KEEP_EXACT, MIN_COMPRESS_NUMEL, exact_reason

VOCAB = 128


def _seed():
    seed = torch.seed() % 2**31
    print("seed", seed)
    return seed


def test_every_rule_has_a_reason():
    assert set(KEEP_EXACT) == {"not float", "small", "not finite", "attention core"}
    assert all(len(why) > 20 for why in KEEP_EXACT.values())


def test_integer_and_boolean_tensors_stay_exact():
    for t in (torch.arange(4096), torch.ones(4096, dtype=torch.bool), torch.zeros(4096, dtype=torch.int8)):
        assert exact_reason(t) == "not float"


def test_small_tensors_stay_exact_and_large_ones_may_be_compressed():
    assert exact_reason(torch.randn(MIN_COMPRESS_NUMEL - 1)) == "small"
    assert exact_reason(torch.randn(MIN_COMPRESS_NUMEL)) is None
    assert exact_reason(torch.randn(MIN_COMPRESS_NUMEL), in_attention_core=True) == "attention core"


@pytest.mark.parametrize("codec", ["int8", "bf16", "fp8-e4m3"])
def test_non_finite_tensors_are_flagged_by_every_codec(codec):
    mask = torch.zeros(8, 256)
    mask[:, 100:] = float("-inf")
    assert not get_codec(codec).encode(mask).finite()


def _run(model, ids, pos, engine=None, plan=None):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    if engine is None:
        grpo_loss(model, ids, pos).backward()
        return grads(model), None
    with engine.step(plan) as step:
        loss = grpo_loss(model, ids, pos)
        step.ensure_actions()
        held = step.bytes_by_unit(shared=False)
        loss.backward()
    return grads(model), held


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_attention_core_stays_exact_under_l(arch):
    """With the rule, an attention unit under L holds exact bytes the rule-free engine
    compresses (MLP units are unchanged), and attention-only L moves the gradient less."""
    seed = _seed()
    model = build_model(
        tiny_config(arch, hidden_size=64, num_layers=2, vocab_size=VOCAB),
        lora=LoraSpec(rank=4, alpha=8, dropout=0.0),
        seed=seed,
    ).train()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(seed))
    ids, pos = packed_microbatch(128, VOCAB, seed=seed)
    ref, _ = _run(model, ids, pos)
    out = {}
    for on in (True, False):
        engine = RecoveryEngine(model, codec="int8", attention_core_exact=on)
        plan = {n: "compressed" if n.endswith("self_attn") else "checkpoint" for n in engine.unit_names}
        g, held = _run(model, ids, pos, engine, plan)
        engine.detach()
        out[on] = (rel_err(g, ref), held)
    print({k: v[0] for k, v in out.items()})
    for name, b in out[True][1].items():
        off = out[False][1][name]
        if name.endswith("self_attn"):
            assert b["exact"] > off["exact"] and b["compressed"] < off["compressed"], name
        else:
            assert b == off, name
    assert out[True][0] < out[False][0]


def test_sign_reading_activations_keep_their_signs_under_l(monkeypatch):
    """OPT's MLP saves a ReLU output whose zero pattern its backward reads: all-L with the
    sign-keeping rule moves the gradient less than the same engine rounding to nearest there."""
    import arch_sweep

    import hilore_actor.recovery.engine as engine_mod

    seed = _seed()
    model = build_model(arch_sweep.tiny_config("opt"), seed=seed).train()
    ids = torch.randint(3, 128, (2, arch_sweep.SEQ), generator=torch.Generator().manual_seed(seed))
    ref = arch_sweep._run(model, ids)
    out = {}
    for on in (True, False):
        if not on:
            monkeypatch.setattr(engine_mod, "reads_sign", lambda m: False)
        engine = RecoveryEngine(model, codec="int8")
        out[on] = arch_sweep._rel(arch_sweep._run(model, ids, engine, "all-l"), ref)
        engine.detach()
    print(out)
    assert 0 < out[True] < out[False] / 2


# A stand-in for flash-attn's forward kernel (flash_attn 2.8.3, flash_attn_interface.py): a
# torch custom op of the same signature and outputs, (out, softmax_lse, S_dmask, rng_state) in
# flash's (batch, seq, heads, dim) layout, on CPU, and an autograd Function that saves what
# flash's does and whose backward reads the saved out and log-sum-exp. flash-attn itself has
# no CPU build; its real names are rules.LIBRARY_ATTENTION_KERNELS.
FAKE_FLASH = "hilore_test::_flash_attn_forward"
FLASH_CALLS = []


@torch.library.custom_op(FAKE_FLASH, mutates_args=(), device_types="cpu")
def _fake_flash_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    return_softmax: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    FLASH_CALLS.append(q.shape)
    s = _scores(q, k, softmax_scale, causal)
    lse = torch.logsumexp(s, dim=-1)  # (b, h, s), float32 as flash's
    out = (torch.exp(s - lse[..., None]) @ v.transpose(1, 2).float()).transpose(1, 2).to(q.dtype).contiguous()
    return out, lse, q.new_empty(0), torch.zeros(2, dtype=torch.int64)


def _scores(q, k, scale, causal):
    s = (q.transpose(1, 2).float() @ k.transpose(1, 2).float().transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return s


class _FakeFlashFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale):
        out, lse, _, rng_state = torch.ops.hilore_test._flash_attn_forward(
            q, k, v, 0.0, scale, True, -1, -1, 0.0, None, False
        )
        ctx.save_for_backward(q, k, v, out, lse, rng_state)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout):
        """flash's backward: the probabilities from the saved log-sum-exp, D from the saved out."""
        q, k, v, out, lse, _ = ctx.saved_tensors
        p = torch.exp(_scores(q, k, ctx.scale, True) - lse[..., None])
        do, vh, qh, kh = (t.transpose(1, 2).float() for t in (dout, v, q, k))
        dv = p.transpose(-1, -2) @ do
        ds = p * (do @ vh.transpose(-1, -2) - (do * out.transpose(1, 2).float()).sum(-1, keepdim=True))
        dq, dk = ds @ kh * ctx.scale, ds.transpose(-1, -2) @ qh * ctx.scale
        return (*(t.transpose(1, 2).to(q.dtype) for t in (dq, dk, dv)), None)


def _fake_flash_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention interface over the fake kernel (causal, one sequence per row)."""
    groups = query.shape[1] // key.shape[1]
    q, k, v = (t.transpose(1, 2) for t in (query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)))
    return _FakeFlashFn.apply(q, k, v, scaling if scaling is not None else query.shape[-1] ** -0.5), None


def test_library_attention_kernels_resolve_only_when_registered(monkeypatch):
    """``namespace::op`` names resolve to every overload of a registered op; an unregistered one
    (flash-attn absent, as on CPU) is skipped; P and P:core both keep a listed kernel."""
    from hilore_actor.recovery import rules

    fake = torch.ops.hilore_test._flash_attn_forward.default
    assert rules.library_kernels([FAKE_FLASH, "hilore_absent::_flash_attn_varlen_forward"]) == {fake}
    assert fake not in rules.partial_saves("core")
    monkeypatch.setattr(rules, "LIBRARY_ATTENTION_KERNELS", rules.LIBRARY_ATTENTION_KERNELS + (FAKE_FLASH,))
    assert fake in rules.partial_saves("core") and fake in rules.partial_saves()
    from torch.utils.checkpoint import CheckpointPolicy

    assert rules.partial_policy("core")(None, fake) == CheckpointPolicy.MUST_SAVE
    assert "flash_attn::_flash_attn_varlen_forward" in rules.LIBRARY_ATTENTION_KERNELS
    seed = _seed()  # the stand-in is causal attention, forward and backward (sdpa's, within float32 rounding)
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 7, 3, 8, generator=gen, requires_grad=True) for _ in range(3))
    dout = torch.randn(2, 7, 3, 8, generator=gen)
    out = _FakeFlashFn.apply(q, k, v, 0.3)
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q, k, v)), is_causal=True, scale=0.3
    ).transpose(1, 2)
    for a, b in zip(
        (out,) + torch.autograd.grad(out, (q, k, v), dout), (ref,) + torch.autograd.grad(ref, (q, k, v), dout)
    ):
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()


@pytest.mark.parametrize("listed", [True, False])
def test_p_core_keeps_a_library_kernels_outputs(monkeypatch, listed):
    """P:core keeps out, softmax_lse and rng_state of a custom-op attention kernel in the list:
    the kernel runs once per layer (backward's replay gets its outputs back), the attention
    units hold them, and the gradients are bitwise plain autograd's. Not listed: the kernel
    runs again in backward and the units keep nothing."""
    import transformers

    from hilore_actor.recovery import rules

    seed = _seed()
    transformers.AttentionInterface.register("hilore_fake_kernel", _fake_flash_attention)
    if listed:
        monkeypatch.setattr(rules, "LIBRARY_ATTENTION_KERNELS", rules.LIBRARY_ATTENTION_KERNELS + (FAKE_FLASH,))
    model = build_model(
        tiny_config("llama", hidden_size=64, num_layers=2, vocab_size=VOCAB),
        attn_implementation="hilore_fake_kernel",
        seed=seed,
    ).train()
    ids = torch.randint(3, VOCAB, (1, 48), generator=torch.Generator().manual_seed(seed))
    pos = torch.arange(48)[None]
    ref, _ = _run(model, ids, pos)
    engine = RecoveryEngine(model)
    FLASH_CALLS.clear()
    g, held = _run(model, ids, pos, engine, "all-p:core")
    engine.detach()
    layers = len(model.model.layers)
    assert len(FLASH_CALLS) == (layers if listed else 2 * layers)
    assert all(torch.equal(g[n], ref[n]) for n in ref)
    for name, b in held.items():
        kept = b["partial"]
        assert (kept > 0) == (listed and name.endswith("self_attn")), (name, b)
