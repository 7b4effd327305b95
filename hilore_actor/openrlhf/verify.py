"""OpenRLHF's real ``ActorPPOTrainer.training_step`` in one process, gc vs HiLoRe.

``single_process_trainer`` builds an ``ActorPPOTrainer`` without its Ray/vLLM setup around an
OpenRLHF ``Actor``, with a stand-in strategy (backward = ``loss.backward()``, an AdamW step).
The CPU tests use it to compare gradients; ``python -m hilore_actor.openrlhf.verify`` uses it
on one GPU: a small model, 2 GRPO steps under OpenRLHF's gradient checkpointing and under
HiLoRe, one summary table (loss, peak, update seconds). It needs OpenRLHF importable (on a
GPU machine: ``pip install 'hilore-actor[gpu,openrlhf]'``).
"""
from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch


class SingleProcessStrategy:
    """What ``training_step`` calls on a DeepspeedStrategy, in one process."""

    ring_attn_group = None

    def __init__(self, args, optimizer=None):
        self.args, self.optimizer = args, optimizer

    def backward(self, loss, model, optimizer, **kwargs):
        loss.backward()

    def optimizer_step(self, *args, **kwargs):
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    def get_grad_norm(self, model):
        grads = [p.grad.flatten() for p in model.parameters() if p.grad is not None]
        return float(torch.cat(grads).norm()) if grads else 0.0


def single_process_trainer(actor, kl_coef: float = 0.01, optimizer=None):
    from openrlhf.models import PolicyLoss
    from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer

    t = ActorPPOTrainer.__new__(ActorPPOTrainer)  # no vLLM, replay buffer or Ray setup
    t.args = SimpleNamespace(actor=SimpleNamespace(entropy_coef=None, aux_loss_coef=0.0),
                             algo=SimpleNamespace(kl=SimpleNamespace(use_loss=True, init_coef=kl_coef, estimator="k3",
                                                                     unbiased_gradient=False)),
                             train=SimpleNamespace(dynamic_batch_enable=False))
    t.strategy, t.actor, t.actor_loss_fn = SingleProcessStrategy(t.args, optimizer), actor, PolicyLoss(0.2, 0.2)
    t.aux_loss, t.ema_model, t.replay_buffer, t.actor_optim = False, None, None, optimizer
    t.actor_scheduler = SimpleNamespace(get_last_lr=lambda: [optimizer.param_groups[0]["lr"] if optimizer else 0.0])
    return t


def experience(seed: int, B: int, P: int, A: int, vocab: int, device="cpu"):
    """Left-padded prompts and right-padded responses, as OpenRLHF's samples are; old and
    reference log-probs near a typical value, one advantage per response."""
    from openrlhf.trainer.ppo_utils.experience import Experience

    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(3, vocab, (B, P + A), generator=g)
    att = torch.ones(B, P + A, dtype=torch.long)
    act = torch.ones(B, A, dtype=torch.bool)
    for b in range(B):
        lpad, rlen = int(torch.randint(0, P // 2, (1,), generator=g)), int(torch.randint(A // 2, A + 1, (1,), generator=g))
        att[b, :lpad] = 0
        att[b, P + rlen:] = 0
        act[b, rlen:] = False
    old = -2.0 + 0.3 * torch.randn(B, A, generator=g)
    ref = old + 0.05 * torch.randn(B, A, generator=g)
    adv = torch.randn(B, 1, generator=g).expand(B, A).clone()
    return Experience(sequences=seq.to(device), attention_mask=att.to(device), action_mask=act.to(device),
                      action_log_probs=(old * act).to(device), base_action_log_probs=(ref * act).to(device),
                      advantages=(adv * act).to(device), info={})


def loss_batch_info(exp):
    return dict(dp_size=1, batch_num_tokens=exp.action_mask.sum().float(),
                global_batch_size=torch.tensor(float(exp.action_mask.shape[0]), device=exp.action_mask.device))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hilore_actor.openrlhf.verify", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pretrain", default="smollm2", help="local model path or 'smollm2'")
    p.add_argument("--batch", type=int, default=8, help="sequences per microbatch")
    p.add_argument("--prompt_len", type=int, default=512)
    p.add_argument("--response_len", type=int, default=1536)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--budget", default="1.10")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("error: this verification runs on a GPU; the CPU tests are tests/test_openrlhf.py")
    from openrlhf.models import Actor

    from ..models.factory import LoraSpec
    from ..models.source import load_policy
    from ..recovery import RecoveryEngine
    from ..runtime import MemoryMeter
    from ..learner.plan import plan_before_wrapping
    from ..learner.settings import hilore_settings
    from ..grpo.microbatch import microbatch_loss
    from .training_step import HiLoReTrainingStep

    dev = torch.device("cuda", 0)
    rows = []
    for method in ("gc", "hilore"):
        model, _ = load_policy(args.pretrain, dtype=torch.bfloat16, lora=LoraSpec(16, 32), seed=0)
        model.config.use_cache = False
        model.to(dev)
        actor = Actor(model)
        actor.packing_samples = False
        opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-5)
        trainer = single_process_trainer(actor, optimizer=opt)
        if method == "gc":
            actor.gradient_checkpointing_enable()
        else:
            hcfg = hilore_settings(budget=args.budget, mode="hilore-hr")
            plan = plan_before_wrapping(model, hcfg, backend="hilore", tokens=args.batch * (args.prompt_len + args.response_len),
                                        seqs_per_microbatch=args.batch, group_size=8, loss_options={},
                                        loss_fn=microbatch_loss, std_loss_fn=microbatch_loss, device=dev, seed=0)
            HiLoReTrainingStep(plan, RecoveryEngine(actor.model)).install(trainer)
        for step in range(args.steps):
            exp = experience(step, args.batch, args.prompt_len, args.response_len, model.config.vocab_size, dev)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with MemoryMeter(dev) as meter:
                out = trainer.training_step(exp, 0.01, step, loss_batch_info(exp))
            torch.cuda.synchronize()
            rows.append((method, step + 1, float(out["metrics"]["policy_loss"]), meter.report.peak_bytes / 2**30,
                         time.perf_counter() - t0))
        del model, actor, trainer, opt
        torch.cuda.empty_cache()
    print(f"{'method':<8} {'step':>4} {'policy_loss':>12} {'peak GiB':>9} {'update s':>9}")
    for r in rows:
        print(f"{r[0]:<8} {r[1]:>4} {r[2]:>12.6f} {r[3]:>9.2f} {r[4]:>9.2f}")
    gc_t = sum(r[4] for r in rows if r[0] == "gc" and r[1] > 1)
    hl_t = sum(r[4] for r in rows if r[0] == "hilore" and r[1] > 1)
    if gc_t and hl_t:
        print(f"update time after step 1: gc {gc_t:.2f}s, hilore {hl_t:.2f}s (x{gc_t / hl_t:.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
