"""Check the OpenRLHF drop-in against OpenRLHF's own gradient-checkpointing path; can fail.

``check`` runs, for OpenRLHF's gc path (twice: the second run is the noise floor, bf16
flash-attn backward being non-deterministic) and for each HiLoRe mode, one
``ActorPPOTrainer.training_step`` on the same experience, takes the flattened LoRA gradient
just before the optimizer step (``deepspeed.utils.safe_get_full_grad``: ZeRO-1/2 keep reduced
gradients in their partitions), then times ``--steps`` more updates. It fails on a gradient
further from gc's than the stated tolerance (hilore-hr: max(1e-3, 4 x the noise floor);
hilore: its validation tolerance plus that) or a microbatch peak over B.

``python -m hilore_actor.openrlhf.verify`` (one GPU, under 10 minutes): OpenRLHF's CLI parses
a small recipe (``flash_attention_2`` with ``--ds.packing_samples``, ZeRO-2, LoRA, the model
given or the bundled SmolLM2 with LoRA B not zero); the real ``PolicyModelActor`` and this
package's ``HiLoRePolicyModelActor`` (their plain classes, in this process, with
``DeepspeedStrategy`` on one rank) build the trainers. Exit status 1 on any failure.
The CPU tests drive ``check`` with ``single_process_trainer`` (a stand-in strategy).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from types import SimpleNamespace
from typing import Callable, Dict, List, Sequence

import torch

from .patching import shadowed


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
    t.args = SimpleNamespace(
        actor=SimpleNamespace(entropy_coef=None, aux_loss_coef=0.0),
        algo=SimpleNamespace(
            kl=SimpleNamespace(use_loss=True, init_coef=kl_coef, estimator="k3", unbiased_gradient=False)
        ),
        train=SimpleNamespace(dynamic_batch_enable=False),
    )
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
        lpad, rlen = (
            int(torch.randint(0, P // 2, (1,), generator=g)),
            int(torch.randint(A // 2, A + 1, (1,), generator=g)),
        )
        att[b, :lpad] = 0
        att[b, P + rlen :] = 0
        act[b, rlen:] = False
    old = -2.0 + 0.3 * torch.randn(B, A, generator=g)
    ref = old + 0.05 * torch.randn(B, A, generator=g)
    adv = torch.randn(B, 1, generator=g).expand(B, A).clone()
    return Experience(
        sequences=seq.to(device),
        attention_mask=att.to(device),
        action_mask=act.to(device),
        action_log_probs=(old * act).to(device),
        base_action_log_probs=(ref * act).to(device),
        advantages=(adv * act).to(device),
        info={},
    )


def loss_batch_info(exp):
    return dict(
        dp_size=1,
        batch_num_tokens=exp.action_mask.sum().float(),
        global_batch_size=torch.tensor(float(exp.action_mask.shape[0]), device=exp.action_mask.device),
    )


def flat_gradient(actor) -> torch.Tensor:
    """The trainable parameters' gradient, flattened in float32 (ZeRO-1/2: from the partitions)."""
    from deepspeed.utils import safe_get_full_grad

    params = [p for p in actor.parameters() if p.requires_grad]
    return torch.cat(
        [(safe_get_full_grad(p) if p.grad is None else p.grad).detach().float().flatten().cpu() for p in params]
    )


def _one_step(trainer, exp, step: int, keep_grad: bool):
    """``training_step`` on ``exp``; with ``keep_grad`` the gradient as the optimizer step
    begins. Returns (gradient or None, seconds)."""
    strategy, held = trainer.strategy, {}
    real_step = strategy.optimizer_step

    def optimizer_step(*a, **k):
        if keep_grad and "grad" not in held:
            held["grad"] = flat_gradient(trainer.actor)
        return real_step(*a, **k)

    sync = torch.cuda.synchronize if exp.sequences.is_cuda else (lambda: None)
    with shadowed(strategy, optimizer_step=optimizer_step):
        sync()
        t0 = time.perf_counter()
        trainer.training_step(exp, 0.01, step, loss_batch_info(exp))
        sync()
    return held.get("grad"), time.perf_counter() - t0


def check(build: Callable[[str], tuple], experiences: Sequence, modes: Sequence[str], log=print) -> Dict:
    """``build(method)`` -> (trainer, HiLoReTrainingStep or None) for "gc" and each mode, fresh
    each time, on the same weights. Returns {"rows": [...], "failures": [...]}."""
    rows, failures, grads = [], [], {}
    for method in ["gc", "gc", *modes]:
        trainer, wrapper = build(method)
        g, _ = _one_step(trainer, experiences[0], 0, keep_grad=True)
        times = [_one_step(trainer, exp, i + 1, keep_grad=False)[1] for i, exp in enumerate(experiences[1:])]
        peak = wrapper.last.get("peak_over_budget") if wrapper is not None else None
        peaks = [peak] if peak is not None else []
        if method == "gc" and "gc" in grads:
            floor = float((g - grads["gc"]).norm() / grads["gc"].norm())
            rows.append(dict(method="gc (repeat)", grad_rel_err=floor, update_seconds=times))
            continue
        grads.setdefault(method, g)
        err = float((g - grads["gc"]).norm() / grads["gc"].norm()) if method != "gc" else 0.0
        rows.append(
            dict(
                method=method,
                grad_rel_err=err,
                update_seconds=times,
                peak_over_budget=peaks,
                plan=getattr(getattr(wrapper, "plan", None), "info", {}).get("plan"),
            )
        )
        del trainer, wrapper
    floor = next(r["grad_rel_err"] for r in rows if r["method"] == "gc (repeat)")
    for r in rows:
        if r["method"] in ("gc", "gc (repeat)"):
            continue
        tol = max(1e-3, 4 * floor) + (0.0 if r["method"] == "hilore-hr" else 0.015)
        r["tolerance"] = tol
        if r["grad_rel_err"] > tol:
            failures.append(
                f"{r['method']}: gradient relative error {r['grad_rel_err']:.2e} > {tol:.2e} "
                f"(gc's own noise floor {floor:.2e})"
            )
        if any(p > 1.0 for p in r["peak_over_budget"]):
            failures.append(f"{r['method']}: peak {max(r['peak_over_budget']):.3f} B, over B")
    for r in rows:
        t = r["update_seconds"]
        log(
            f"{r['method']:<12} grad rel err {r['grad_rel_err']:.2e}  update s {sum(t) / max(len(t), 1):.3f}"
            + (f"  peak/B {max(r['peak_over_budget']):.3f}" if r.get("peak_over_budget") else "")
        )
    return {"rows": rows, "failures": failures, "noise_floor": floor}


def _recipe(args) -> List[str]:
    return [
        "--actor.model_name_or_path",
        args.pretrain,
        "--data.prompt_dataset",
        "unused",
        "--ds.zero_stage",
        "2",
        "--ds.packing_samples",
        "--ds.attn_implementation",
        "flash_attention_2",
        "--ds.lora.rank",
        "16",
        "--ds.lora.alpha",
        "32",
        "--vllm.num_engines",
        "1",
        "--rollout.n_samples_per_prompt",
        "8",
        "--rollout.batch_size",
        str(args.batch),
        "--train.batch_size",
        str(args.batch),
        "--train.micro_batch_size",
        str(args.batch),
        "--rollout.micro_batch_size",
        str(args.batch),
        "--algo.advantage.estimator",
        "group_norm",
        "--algo.kl.use_loss",
        "--algo.kl.estimator",
        "k3",
        "--actor.num_gpus_per_node",
        "1",
        "--actor.gradient_checkpointing_enable",
        "--data.max_len",
        str(args.prompt_len + args.response_len),
    ]


def _gpu_builder(args, pretrain: str):
    """Trainers from the real actor classes (their plain classes, in this process)."""
    import openrlhf.cli.train_ppo_ray as cli
    import ray
    from openrlhf.trainer.ray.ppo_actor import PolicyModelActor
    from openrlhf.utils import get_strategy

    from .policy_actor import CONFIG_ENV, HiLoRePolicyModelActor
    from .train_ppo_ray import run_cli_main

    parsed = {}
    run_cli_main(cli, _recipe(args), train=lambda a: parsed.setdefault("args", a))
    ns = parsed["args"]
    ns.vllm.sync_backend = "gloo"  # no vLLM engine here: skip OpenRLHF's NCCL/vLLM version probe
    ray.init(ignore_reinit_error=True, num_gpus=1, log_to_driver=False)
    port = 29500 + os.getpid() % 1000

    def build(method: str):
        hilore = method != "gc"
        os.environ[CONFIG_ENV] = json.dumps({"mode": method, "budget": args.budget} if hilore else {})
        ns.actor.gradient_checkpointing_enable = True  # OpenRLHF's gc; the drop-in turns it off itself
        cls = (HiLoRePolicyModelActor if hilore else PolicyModelActor).__ray_actor_class__
        actor = cls(1, 0, "127.0.0.1", port)
        actor.init_model_from_pretrained(get_strategy(ns), pretrain, max_steps=64)
        _lora_b_not_zero(actor.actor)  # before planning (the drop-in plans at the first fit): every method's weights
        if hilore:
            actor.plan_and_attach()
        torch.cuda.empty_cache()
        return actor.trainer, getattr(actor, "hilore", None)

    return build


def _local_model(pretrain: str) -> str:
    """``smollm2``: the bundled weights as an HF folder (fp32 weights and tokenizer)."""
    if pretrain != "smollm2":
        return pretrain
    from ..models.smollm2 import convert_smollm2

    return str(convert_smollm2())


def _lora_b_not_zero(actor, seed: int = 0) -> None:
    """OpenRLHF's LoRA starts with B = 0, where the LoRA A gradients vanish and a wrong
    activation would hide; draw B the same way for every method, before the first step."""
    gen = torch.Generator(device=next(actor.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for n, q in actor.named_parameters():
            if "lora_B" in n:
                q.normal_(0.0, 0.02, generator=gen)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m hilore_actor.openrlhf.verify",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--pretrain", default="smollm2", help="local model path or 'smollm2'")
    p.add_argument("--batch", type=int, default=8, help="sequences per microbatch")
    p.add_argument("--prompt_len", type=int, default=512)
    p.add_argument("--response_len", type=int, default=1536)
    p.add_argument("--steps", type=int, default=2, help="timed updates after the gradient check")
    p.add_argument("--budget", default="1.10")
    p.add_argument("--modes", default="hilore-hr,hilore")
    p.add_argument("--out", default=None, help="write the rows and failures as JSON here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("error: this verification runs on a GPU; the CPU tests are tests/openrlhf/test_openrlhf.py")
    pretrain = _local_model(args.pretrain)
    with open(os.path.join(pretrain, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    exps = [
        experience(i, args.batch, args.prompt_len, args.response_len, vocab, torch.device("cuda"))
        for i in range(1 + args.steps)
    ]
    result = check(_gpu_builder(args, pretrain), exps, [m.strip() for m in args.modes.split(",")])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(result, argv=list(argv or []), torch=torch.__version__), f, indent=1)
    for msg in result["failures"]:
        print("FAIL", msg)
    print("verify:", "FAILED" if result["failures"] else "passed")
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
