"""One real GRPO learner step on the bundled SmolLM2-135M-Instruct (CPU default).

Until the Ray training job lands this is the package's main command: sample G responses per
arithmetic prompt with HF generate, score them with the task's verifier, compute group
advantages, run the learner forward, the GRPO loss (Eq. 1) and its exact token coefficients
(Eq. 4), then backward with the peak memory measured. Everything printed is measured.
"""
from __future__ import annotations

import argparse
import time

import torch


# Single-digit sums and differences: a 135M model gets some right, so groups have reward variance.
EASY_ARITHMETIC = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=("+", "-"))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hilore_actor.demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="rg:basic_arithmetic", help="rg:<reasoning-gym name> or a .jsonl path")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--group_size", type=int, default=4, help="responses sampled per prompt (G)")
    p.add_argument("--max_new_tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lora_rank", type=int, default=16)
    p.add_argument("--kl_coef", type=float, default=0.001)
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from hilore_actor.data import load_task
    from hilore_actor.grpo import group_advantages, policy_loss, token_coefficients
    from hilore_actor.models import LoraSpec, apply_lora, load_smollm2
    from hilore_actor.models.logprobs import sequence_log_probs
    from hilore_actor.rollout import generate_groups
    from hilore_actor.runtime import MemoryMeter

    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    model, tok = load_smollm2()
    model = apply_lora(model, LoraSpec(rank=args.lora_rank, alpha=2 * args.lora_rank))
    print(f"[demo] SmolLM2-135M-Instruct + LoRA r{args.lora_rank} loaded in {time.perf_counter() - t0:.1f}s")
    options = EASY_ARITHMETIC if args.task == "rg:basic_arithmetic" else None
    task = load_task(args.task, size=64, seed=args.seed, options=options, instruction=" Answer with the number only.")
    examples = task.examples[: args.prompts]

    t0 = time.perf_counter()
    roll = generate_groups(model, tok, [e.prompt for e in examples], args.group_size, args.max_new_tokens, args.temperature, args.seed)
    rollout_s = time.perf_counter() - t0
    rewards = torch.tensor([task.score(text, examples[i // args.group_size]) for i, text in enumerate(roll.texts)])
    adv = group_advantages(rewards, args.group_size)
    mask = roll.action_mask()

    with torch.no_grad():
        old = sequence_log_probs(model, roll.sequences)
        with model.disable_adapter():
            ref = sequence_log_probs(model, roll.sequences)
    model.train()
    opts = dict(kl_coef=args.kl_coef, kl_estimator="k3")
    t0 = time.perf_counter()
    with MemoryMeter("cpu") as meter:
        logp = sequence_log_probs(model, roll.sequences)
        loss, stats = policy_loss(logp, old, adv, mask, ref, **opts)
        omega = token_coefficients(logp, old, adv, mask, ref, **opts)
        loss.backward()
    update_s = time.perf_counter() - t0  # includes the profiler's overhead

    resp = mask.bool()
    mag = omega[resp].abs().sort(descending=True).values
    top = mag[: max(1, len(mag) // 10)].sum() / mag.sum().clamp(min=1e-30)
    print(f"[demo] rollout: {len(roll.texts)} responses in {rollout_s:.1f}s, mean length {sum(roll.response_lens) / len(roll.response_lens):.1f} tokens")
    for i, ex in enumerate(examples):
        print(f"  prompt {i}: answer {ex.answer!r}; rewards {rewards[i * args.group_size:(i + 1) * args.group_size].tolist()}")
        print(f"    sample: {roll.texts[i * args.group_size].strip()[:80]!r}")
    print(f"[demo] reward mean {rewards.mean():.3f}; advantages {['%.2f' % a for a in adv.tolist()]}")
    print(f"[demo] loss {loss.item():.5f} (policy {stats['policy_loss']:.5f}, kl {stats['kl_loss']:.6f}), clip fraction {stats['clip_fraction']:.3f}")
    print(f"[demo] omega: {(omega[resp] == 0).float().mean():.1%} of response tokens have omega = 0 (policy part is 0 for zero-advantage groups; KL keeps a small term);"
          f" top 10% of tokens carry {top:.1%} of |omega|")
    print(f"[demo] learner fwd+bwd {mask.shape[0]}x{mask.shape[1]} tokens: {update_s:.1f}s, measured peak {meter.report.peak_bytes / 2**20:.1f} MiB (no checkpointing)")
    print("[demo] this is the foundation's demo; the Ray GRPO job (train_grpo) and the HiLoRe engine are listed in the README status table")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
