"""Shared helpers: fresh random packed microbatches and a GRPO loss over them."""

import contextlib

import pytest
import torch

from hilore_actor.grpo import policy_loss
from hilore_actor.models.logprobs import token_log_probs


def packed_microbatch(total: int, vocab: int, n_seqs: int = 3, seed=None):
    """One packed row of ``n_seqs`` sequences of random lengths: (input_ids, position_ids)."""
    gen = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    cuts = sorted(torch.randperm(total - 2, generator=gen)[: n_seqs - 1].add(1).tolist())
    lens = [b - a for a, b in zip([0] + cuts, cuts + [total])]
    ids = torch.randint(3, vocab, (1, total), generator=gen)
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    return ids, pos


def grpo_loss(model, ids, pos, seed=0):
    """Forward + the GRPO loss with random advantages, old/ref log-probs and a prompt mask."""
    gen = torch.Generator().manual_seed(seed)
    out = model(input_ids=ids, position_ids=pos, use_cache=False)
    logp = token_log_probs(out.logits[:, :-1], ids[:, 1:])
    old = logp.detach() + 0.1 * torch.randn(logp.shape, generator=gen)
    ref = logp.detach() + 0.1 * torch.randn(logp.shape, generator=gen)
    mask = (torch.rand(logp.shape, generator=gen) > 0.2).float()
    adv = torch.randn(logp.shape, generator=gen)
    loss, _ = policy_loss(logp, old, adv, mask, ref, kl_coef=0.01)
    return loss


def downgrade_peaks(model, loss_of, device: str):
    """H then R after an exact forward, twice (the first pair warms up): per action the peak of
    set_actions + backward (``MemoryMeter`` after the ``downgrade`` mark), and the exact bundle
    bytes held before it. ``loss_of(model)`` runs the forward. Asserts R holds nothing exact."""
    from hilore_actor.recovery import RecoveryEngine
    from hilore_actor.runtime import MemoryMeter

    engine = RecoveryEngine(model)
    peaks = {}
    for action in ["H", "R", "H", "R"]:
        model.zero_grad(set_to_none=True)
        with MemoryMeter(device) as meter:
            with engine.step(None) as step:
                loss = loss_of(model)
                held = step.bytes_by_unit()
                step.set_actions({n: action for n in engine.unit_names})
                meter.mark("downgrade")
                after = step.bytes_by_unit()
                loss.backward()
        peaks[action] = meter.report.peak_since["downgrade"]
        if action == "R":
            assert sum(b["exact"] for b in after.values()) == 0
    engine.detach()
    return peaks, sum(b["exact"] for b in held.values())


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def rel_err(g, ref):
    num = torch.cat([(g[n] - ref[n]).flatten() for n in ref]).norm()
    return float(num / torch.cat([ref[n].flatten() for n in ref]).norm())


@pytest.fixture
def fresh_seed():
    return torch.seed() % 2**31


def bench_setup(arch: str, num_layers: int, n_mbs: int):
    """A tiny LoRA model with LoRA B away from zero, ``n_mbs`` replayed 256-token microbatches,
    and one benchmark runner per head (fresh seed, printed)."""
    from hilore_actor.models import init_lora_b
    from hilore_actor.bench.methods import head_runners
    from hilore_actor.models import LoraSpec, build_model, tiny_config
    from hilore_actor.recovery import RecoveryEngine
    from hilore_actor.workloads import replayed_microbatches

    seed = torch.seed() % 2**31
    print("seed", seed)
    model = build_model(
        tiny_config(arch, hidden_size=64, num_layers=num_layers, vocab_size=4096), lora=LoraSpec(8, 16), seed=seed
    )
    init_lora_b(model, 1e-2, seed)
    model.train()
    return head_runners(model, RecoveryEngine(model)), replayed_microbatches(model, n_mbs, 256, seed=seed)


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory):
    """Three uninterrupted steps of the training job's tiny preset (``train_job.py``): the
    reference the fault, resume and multi-node tests reproduce."""
    from train_job import job

    out = tmp_path_factory.mktemp("full")
    r = job(out, "--max_steps", "3")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out, r


class _Chooser:
    """Stands in for ``RankPlan.hl``: counts the side passes it was asked to keep state across."""

    def __init__(self):
        self.entered = 0

    @contextlib.contextmanager
    def side_pass(self):
        self.entered += 1
        yield


class FixedPlan:
    """The parts of a ``RankPlan`` the learner room's sequences use: a fixed plan, its default
    actions, and a record of the tighten and observe calls."""

    def __init__(self, plan, budget=10**12):
        from types import SimpleNamespace

        self.sp, self.budget, self.track_tokens = SimpleNamespace(plan=plan), budget, False
        self.tightened, self.observed, self.hl = [], [], _Chooser()

    def for_tokens(self, tokens):
        return self.sp

    def predicted_peak(self, sp):
        return 0

    def actions(self, step, loss_output, sp=None):
        from hilore_actor.recovery.state import DEFAULT_ACTION

        return {n: DEFAULT_ACTION[q] for n, q in (sp or self.sp).plan.items()}

    def tighten(self, by_bytes, who="", tokens=None):
        self.tightened.append((by_bytes, tokens))

    def observe(self, predicted_bytes, peak_bytes):
        self.observed.append((predicted_bytes, peak_bytes))
