"""Packing real rollouts into fixed-size rows: masks cover exactly the response tokens that fit."""

import torch

from benchmarks.real_batches import pack_rows


def test_rows_have_exact_size_and_response_masks():
    seed = torch.seed() % 2**31
    print("seed", seed)
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for g in range(6):
        p = int(torch.randint(3, 9, (), generator=gen))
        seqs = [
            list(range(1000 * g + 100 * j, 1000 * g + 100 * j + p + int(torch.randint(1, 20, (), generator=gen))))
            for j in range(4)
        ]
        groups.append(
            {
                "prompt_len": p,
                "sequences": seqs,
                "rewards": [float(torch.rand((), generator=gen) < 0.5) for _ in range(4)],
            }
        )
    rows = pack_rows(groups, [40, 40, 24], 4)
    assert [r["input_ids"].shape[1] for r in rows] == [40, 40, 24]
    seqs = [(s, g["prompt_len"]) for g in groups for s in g["sequences"]]
    k = 0
    for r in rows:
        ids, pos, mask = r["input_ids"][0].tolist(), r["position_ids"][0].tolist(), r["action_mask"][0].tolist()
        assert len(mask) == len(ids) - 1
        starts = [i for i, q in enumerate(pos) if q == 0] + [len(ids)]
        for a, b in zip(starts, starts[1:]):
            s, p = seqs[k]
            k += 1
            assert ids[a:b] == s[: b - a]
            want = [1.0 if p - 1 <= t < (b - a) - 1 else 0.0 for t in range(b - a)]
            got = mask[a:b] + ([0.0] if b == len(ids) else [])
            assert got == want


def test_provenance_ignores_rows_built_after_the_described_ones(monkeypatch):
    """Two runs building different numbers of calibration rows describe the same measured rows."""
    from benchmarks import real_batches
    from hilore_actor.models import LoraSpec, build_model, tiny_config

    seed = torch.seed() % 2**31
    print("seed", seed)
    gen = torch.Generator().manual_seed(seed)
    groups = [
        {
            "prompt_len": 4,
            "sequences": [
                torch.randint(0, 64, (4 + int(torch.randint(2, 12, (), generator=gen)),), generator=gen).tolist()
                for _ in range(4)
            ],
            "rewards": [float(torch.rand((), generator=gen) < 0.5) for _ in range(4)],
        }
        for _ in range(12)
    ]
    monkeypatch.setattr(real_batches, "rollout_pool", lambda *a, **k: groups)
    opts = {"clip_eps_low": 0.2}
    provs = []
    for sizes in ([32, 32], [32, 32, 24, 24]):
        model = build_model(
            tiny_config("llama", hidden_size=32, num_layers=1, vocab_size=64),
            lora=LoraSpec(rank=2, alpha=4, dropout=0.0),
            seed=seed,
        ).train()
        mbs, prov = real_batches.real_microbatches(
            model, None, sizes, 4, seed, opts, n_described=2, log=lambda *_: None
        )
        assert len(mbs) == len(sizes)
        provs.append(prov)
    assert provs[0] == provs[1]
    shares = [float(m.action_mask.mean()) for m in mbs]
    assert abs(provs[1]["response_token_share"] - sum(shares[:2]) / 2) < 1e-6
