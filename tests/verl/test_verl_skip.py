"""The zero-advantage skip in HiLoRe's verl engine (``hilore_actor/verl/skip.py``), against the
same engine training every response."""

from functools import partial

import pytest
import torch

pytest.importorskip("verl")
pytest.importorskip("tensordict")

import verl_cpu  # noqa: E402

from hilore_actor.verl import skip, verify  # noqa: E402


def test_two_ranks_with_the_skip_train_the_weights_they_train_without(verl_ranks):
    """Two gloo ranks (``verl_skip_ranks.py``), rank 0 with no response to train and rank 1 with
    3 of 8: the same reduced LoRA gradient with the skip as without (fixed and dynamic
    micro-batches), fewer micro-batches and the same count on both ranks (no hang), every
    gradient materialized when nothing is kept, and the same weights after three AdamW steps."""
    print("seed", verl_ranks["seed"])
    r0, r1 = verl_ranks["skip"]
    for r in (r0, r1):
        for kind in ("fixed", "dynamic"):
            assert r[kind]["rel"] <= 1e-6, (kind, r[kind])
            assert r[f"off/{kind}"]["norm"] > 0
            assert r[f"on/{kind}"]["skip"]["zero_adv_share"] == pytest.approx(13 / 16)
        assert r["on/fixed"]["microbatches"] == 2 < r["off/fixed"]["microbatches"] == 4
        assert r["on/dynamic"]["microbatches"] == 3 < r["off/dynamic"]["microbatches"] == 8  # 1.5 responses each
        assert r["on/fixed"]["skip"]["pad_samples"] == 5  # rank 0: four, rank 1: one beside its three
        assert r["on/dynamic"]["skip"]["pad_samples"] == 3  # rank 0: three, for rank 1's three micro-batches
        assert r["on/nothing"]["microbatches"] == 1 and r["on/nothing"]["skip"]["zero_adv_share"] == 1.0
        assert r["on/nothing"]["grad_numel"] == r["off/nothing"]["grad_numel"] == r["off/fixed"]["grad_numel"]
        assert r["off/moved"] > 1e-5 and r["weights"]["rel"] <= 1e-6, r["weights"]


def _config(**actor):
    return verify.ppo_loss_fn(batch_size=8, **actor).keywords["config"]


@pytest.mark.parametrize(
    "actor,word",
    [
        ({"use_kl_loss": True, "kl_loss_coef": 0.001}, "KL term"),
        ({"entropy_coeff": 0.01}, "entropy term"),
        ({"policy_loss": {"loss_mode": "clip_cov"}}, "loss_mode=clip_cov"),
        ({"loss_agg_mode": "seq-mean-token-sum-norm"}, "padded width"),
    ],
)
def test_auto_trains_everything_and_on_is_refused_where_the_loss_reaches_a_zero_advantage(actor, word):
    from verl.workers.config import PolicyLossConfig
    from verl.workers.utils.losses import ppo_loss

    if "policy_loss" in actor:
        actor = {**actor, "policy_loss": PolicyLossConfig(**actor["policy_loss"])}
    loss = partial(ppo_loss, config=_config(**actor))
    assert skip.resolve("auto", loss) is False
    with pytest.raises(ValueError, match=word) as e:
        skip.resolve("on", loss)
    assert "\n" not in str(e.value)
    plain = partial(ppo_loss, config=_config())
    assert skip.resolve("auto", plain) and skip.resolve("on", plain) and not skip.resolve("off", plain)
    assert not skip.resolve("auto", lambda **kw: None)  # a loss other than ppo_loss is not read


@pytest.mark.parametrize(
    "dynamic,kept,pads",
    [(False, [1, 4, 6], 1), (True, [1, 4, 6], 0), (False, [], 2), (True, [], 1)],
)  # fixed: micro-batches of 2; dynamic: min(kept, ceil(tokens / limit)) micro-batches, at least 1
def test_one_rank_keeps_its_responses_then_pads_to_verls_micro_batch_count(dynamic, kept, pads):
    """World 1: the kept responses in order, then the shortest skipped ones with their loss
    mask zeroed, as many as verl's micro-batching needs; the loss keeps the whole batch's
    token count."""
    from verl.utils import tensordict_utils as tu

    seed = torch.seed() % 2**31
    print("seed", seed)
    td = verify.grpo_batch(seed, vocab=verl_cpu.TINY["vocab_size"], B=8, P=8, R=24)
    td["advantages"][[i for i in range(8) if i not in kept]] = 0.0
    lens = td["input_ids"].offsets().diff().tolist()
    if dynamic:
        tu.assign_non_tensor(td, use_dynamic_bsz=True, max_token_len_per_gpu=max(lens))
    out, overrides, metrics = skip.skip_batch(td.clone(), None, "cpu")
    skipped = sorted((i for i in range(8) if i not in kept), key=lambda i: (lens[i], i))
    assert out["input_ids"].offsets().diff().tolist() == [lens[i] for i in kept + skipped[:pads]]
    assert overrides == {"batch_num_tokens": int(td["loss_mask"].sum())}
    n = len(kept)
    assert out["loss_mask"][:n].sum() == td["loss_mask"][kept].sum() and out["loss_mask"][n:].sum() == 0
    assert metrics["pad_samples"] == pads and metrics["zero_adv_share"] == 1 - n / 8


def test_the_micro_batch_count_is_the_one_verl_settles_on():
    """``micro_batch_count`` against verl's own ``rearrange_micro_batches`` (one rank): random
    lengths and limits, including limits where verl's first guess does not fit."""
    from verl.utils.seqlen_balancing import rearrange_micro_batches

    seed = torch.seed() % 2**31
    print("seed", seed)
    g = torch.Generator().manual_seed(seed)
    for i in range(20):
        td = verify.grpo_batch(
            seed + i, vocab=verl_cpu.TINY["vocab_size"], B=int(torch.randint(1, 9, (1,), generator=g))
        )
        lens = td["input_ids"].offsets().diff().tolist()
        limit = int(torch.randint(max(lens), 2 * max(lens) + 1, (1,), generator=g))
        batches, _ = rearrange_micro_batches(td, max_token_len=limit)
        assert skip.micro_batch_count(lens, limit) == len(batches), (lens, limit)
    full = verify.grpo_batch(seed, vocab=verl_cpu.TINY["vocab_size"], B=3, P=8, R=24, full=True)
    assert skip.micro_batch_count([32] * 3, 48) == len(rearrange_micro_batches(full, max_token_len=48)[0]) == 3
