"""The job's skip of zero-advantage responses (``train/skip.py``): the rows every rank runs
after it give the update's gradient that all rows give (the job's rule: each row's loss over
gas x world, summed), every rank runs as many rows, and pads carry exactly nothing."""

from types import SimpleNamespace

import pytest
import torch

from hilore_actor.grpo.microbatch import Microbatch, microbatch_loss
from hilore_actor.models import LoraSpec, build_model, tiny_config
from hilore_actor.models.logprobs import sequence_log_probs
from hilore_actor.train.skip import skip_rows, zero_advantage_shares
from hilore_actor.train_grpo import shard_rows
from train_job import metrics  # tests/helpers

WORLD, MICRO, BATCH = 2, 2, 8  # gas 2


def _cfg():
    return SimpleNamespace(
        actor=SimpleNamespace(num_nodes=1, num_gpus_per_node=WORLD),
        train=SimpleNamespace(batch_size=BATCH, micro_batch_size=MICRO),
    )


def _seqs(gen, advantages):
    out = []
    for a in advantages:
        prompt, response = int(torch.randint(3, 8, (1,), generator=gen)), int(torch.randint(2, 9, (1,), generator=gen))
        out.append((torch.randint(3, 200, (prompt + response,), generator=gen), prompt, float(a)))
    return out


def _gradient(model, ranks, gas):
    """The update's gradient as DeepSpeed forms it: every row's loss / gas, averaged over ranks."""
    model.zero_grad(set_to_none=True)
    for rows in ranks:
        for r in rows:
            with torch.no_grad():
                old = sequence_log_probs(model, r["input_ids"], position_ids=r["position_ids"]).float()
            mb = Microbatch(
                r["input_ids"],
                r["position_ids"],
                old,
                old,
                r["advantages"],
                r["action_mask"],
                r.get("loss_options", {}),
            )
            (microbatch_loss(model, mb).loss / (gas * len(ranks))).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize(
    "advantages",
    [
        [0.5, -0.5, 0, 0, 0, 0, 1.0, -1.0],  # rank 0 keeps one row of two, rank 1 one: no pad
        [0, 0, 0, 0, 0.5, -0.5, 1.0, -1.0],  # rank 0 keeps nothing: a row moves to it
        [0, 0, 0, 0, 0, 0, 0.5, 0],  # one shrunk row in all: rank 0 runs a pad
        [0.0] * 8,  # nothing to train: one pad per rank
        [0.5, -0.5, 1.0, -1.0, 0.5, 0.5, -1.0, 1.0],  # nothing skipped: the rows as they were
    ],
)
def test_the_kept_rows_give_the_whole_batchs_gradient_on_balanced_ranks(advantages, fresh_seed):
    print("seed", fresh_seed)
    gen = torch.Generator().manual_seed(fresh_seed)
    cfg = tiny_config("qwen2", hidden_size=64, intermediate_size=96, num_layers=2, vocab_size=256)
    model = build_model(cfg, lora=LoraSpec(4, 8), seed=fresh_seed).train()
    seqs = _seqs(gen, advantages)
    ranks = shard_rows(seqs, _cfg())
    kept, pads = skip_rows(ranks, seqs)
    gas = BATCH // (WORLD * MICRO)
    want, got = _gradient(model, ranks, gas), _gradient(model, kept, gas)
    rel = float((got - want).norm() / want.norm().clamp(min=1e-30))
    print("rows per rank", [len(r) for r in kept], "pads", pads, "relative error (norm)", rel)
    if any(advantages):  # a shrunk row sums its tokens in another order: float32 rounding, no more
        assert rel <= 1e-6
    else:
        assert torch.all(got == 0) and torch.all(want == 0)
    assert len({len(rows) for rows in kept}) == 1  # every rank runs as many rows
    trained = sorted(i for rows in kept for r in rows if not r.get("pad") for i in r["seq_index"])
    assert trained == [i for i, a in enumerate(advantages) if a != 0]  # each kept response once, none skipped twice
    assert all(seqs[i][2] == 0 for rows in kept for r in rows if r.get("pad") for i in r["seq_index"])
    n_rows = sum(len(rows) for rows in kept) - pads
    assert len(kept[0]) == max(1, -(-n_rows // WORLD))
    if all(a != 0 for a in advantages):
        assert kept == ranks  # the very rows, on the very ranks


def test_shares_count_responses_and_their_tokens():
    seqs = [
        (torch.arange(10), 4, 0.0),
        (torch.arange(6), 4, 1.0),
        (torch.arange(8), 2, 0.0),
        (torch.arange(5), 1, -1.0),
    ]
    shares = zero_advantage_shares(seqs)
    assert shares["zero_adv_share"] == 0.5 and shares["zero_adv_token_share"] == pytest.approx(
        (6 + 6) / (6 + 2 + 6 + 4)
    )


def test_the_job_with_the_skip_trains_the_weights_it_trains_without(skip_runs):
    """Three steps of two updates each with the skip on (ZeRO-3, HiLoRe at 1.02 x gc) against
    ``skip_runs``' reference (gc under ZeRO-2, every response trained): shrunk rows, a rank left
    nothing and updates that train nothing give the same metrics within the reductions' rounding
    and the same final LoRA weights within 1e-5 (six AdamW updates: Adam's step, normalised per
    element, turns float32 rounding in a near-zero gradient component into a step of the learning
    rate's size; the gradient norms agree within 1e-7)."""
    from safetensors.torch import load_file

    on, ref = (metrics(skip_runs[s]) for s in ("on", "ref"))
    assert [m["zero_adv_share"] for m in on] == [0.5, 0.5, 0.75] == [m["zero_adv_share"] for m in ref]
    assert [m["zero_adv_skip"] for m in on] == [1, 1, 1] and [m["zero_adv_skip"] for m in ref] == [0, 0, 0]
    assert [m["pad_microbatches"] for m in on] == [1, 2, 3] and all(m["pad_microbatches"] == 0 for m in ref)
    for a, b in zip(on, ref):
        assert a["reward_mean"] == b["reward_mean"] and a["response_length"] == b["response_length"]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6)
        # the update's loss, skip or not: a group's advantages sum to 0, so the loss nearly cancels (1e-4 here)
        # and float32 rounding of its per-token terms (each about 0.1; eps 1.2e-7) bounds it absolutely
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-8)
    w_on, w_ref = (load_file(str(skip_runs[s] / "final" / "adapter_model.safetensors")) for s in ("on", "ref"))
    assert set(w_on) == set(w_ref)
    num = sum(float((w_on[k].double() - w_ref[k].double()).pow(2).sum()) for k in w_on)
    den = sum(float(w_ref[k].double().pow(2).sum()) for k in w_ref)
    print("final LoRA weights, relative difference", (num / den) ** 0.5)
    assert (num / den) ** 0.5 <= 1e-5


def test_with_the_kl_loss_auto_trains_every_response(uninterrupted):
    rows = metrics(uninterrupted[0])
    assert all(m["zero_adv_skip"] == 0 and m["pad_microbatches"] == 0 for m in rows)
    assert all(0 <= m["zero_adv_share"] <= 1 for m in rows)
