"""Rollouts packed into learner microbatches: masks, advantages and log-probs line up."""

import pytest
import torch

from hilore_actor.models import LoraSpec, build_model, tiny_config
from hilore_actor.models.logprobs import sequence_log_probs
from hilore_actor.rollout import Rollout, pack_rollout


def test_pack_rollout_layout():
    model = build_model(tiny_config("qwen2", hidden_size=32, vocab_size=64), lora=LoraSpec(4, 8))
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    prompt_lens, resp_lens = [3, 3, 5], [4, 2, 6]
    L = max(p + r for p, r in zip(prompt_lens, resp_lens)) + 2
    seqs = torch.randint(3, 64, (3, L), generator=gen)
    roll = Rollout(seqs, prompt_lens, resp_lens, ["a", "b", "c"], group_size=3)
    adv = torch.tensor([0.5, -1.0, 2.0])
    mbs = pack_rollout(model, roll, adv, max_tokens=64)
    assert len(mbs) == 1
    mb = mbs[0]
    n = [p + r for p, r in zip(prompt_lens, resp_lens)]
    assert mb.input_ids.shape == (1, sum(n))
    assert mb.position_ids[0].tolist() == [i for k in n for i in range(k)]
    # position t predicts token t+1: response tokens of sequence k are predicted from p-1 .. p+r-2
    expected, a = [], []
    for p, r, adv_k in zip(prompt_lens, resp_lens, adv.tolist()):
        expected += [0.0] * (p - 1) + [1.0] * r + [0.0]
        a += [adv_k] * (p + r)
    assert mb.action_mask[0].tolist() == expected[:-1]
    assert mb.advantages[0].tolist() == a[:-1]
    assert mb.action_mask.sum().item() == sum(resp_lens)
    torch.testing.assert_close(mb.old_log_probs, sequence_log_probs(model, mb.input_ids, position_ids=mb.position_ids))
    with model.disable_adapter():
        torch.testing.assert_close(
            mb.ref_log_probs, sequence_log_probs(model, mb.input_ids, position_ids=mb.position_ids)
        )
    assert len(pack_rollout(model, roll, adv, max_tokens=12)) == 2
    with pytest.raises(ValueError, match="more than a microbatch"):
        pack_rollout(model, roll, adv, max_tokens=8)
