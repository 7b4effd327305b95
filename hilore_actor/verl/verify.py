"""Check HiLoRe's verl engine against verl's own gradient-checkpointing path; can fail.

``check`` builds verl's ``FSDPEngineWithLMHead`` with its gradient checkpointing twice (the
second is the noise floor: bf16 flash-attn's backward is not deterministic) and HiLoRe's
engine once per mode, all on the same weights (LoRA B drawn not zero), runs one
``forward_backward_batch`` each on the same GRPO batch (verl's ``ppo_loss``), compares the
LoRA gradient with gc's, then times ``steps`` more batches per engine, interleaved. It fails
on a gradient further from gc's than the stated tolerance (hilore-hr: max(1e-3, 4 x the noise
floor); hilore: that plus 0.015) or a micro-batch peak over B.

``python -m hilore_actor.verl.verify --out RESULT.json [--model HF_DIR]`` (one GPU, under 10
minutes; ``benchmarks/verl_gpu_verify.sh``): the model given, or the bundled SmolLM2 written
as an HF directory; 8 sequences of 2048 tokens per batch, micro-batches of 4, remove-padding,
``flash_attention_2``, bf16 autocast over float32 master weights as verl trains. Exit status 1
on any failure. The CPU tests drive the same builders on a tiny model (``tests/verl/test_verl.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Callable, Dict, Sequence

import torch

KINDS = ("verl", "hilore-hr", "hilore")


def build_engine(
    kind: str,
    path: str,
    seed: int,
    *,
    remove_padding: bool = True,
    micro_batch: int = 2,
    attn: str = "sdpa",
    mixed: bool = False,
    settings: Dict = None,
    job: Dict = None,
    param_offload: bool = False,
):
    """``kind`` ``verl`` (verl's engine, its gradient checkpointing on) or a HiLoRe mode (HiLoRe's
    engine under that mode), on the HF model at ``path`` with LoRA r16 (B drawn not zero)."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    from .fsdp_engine import HiLoReFSDPEngine
    from .settings import CONFIG_ENV, to_env

    prec = {"param_dtype": "bf16" if mixed else "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    mc = HFModelConfig(
        path=path,
        load_tokenizer=False,
        override_config={"attn_implementation": attn},
        lora_rank=16,
        lora_alpha=32,
        enable_gradient_checkpointing=True,
        use_remove_padding=remove_padding,
    )
    ec = FSDPEngineConfig(
        strategy="fsdp2",
        model_dtype="fp32",
        mixed_precision=prec,
        use_torch_compile=False,
        micro_batch_size_per_gpu=micro_batch,
        seed=seed,
        param_offload=param_offload,
        optimizer_offload=param_offload,
    )
    cls = FSDPEngineWithLMHead
    if kind != "verl":
        cls = HiLoReFSDPEngine
        object.__setattr__(ec, "strategy", "hilore")  # as verl's actor config sets the registry key
        os.environ[CONFIG_ENV] = to_env({**(settings or {}), "mode": kind}, job or {})
    torch.manual_seed(seed)  # LoRA A's init
    engine = cls(mc, ec, FSDPOptimizerConfig(lr=1e-5), CheckpointConfig())
    engine.initialize()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in engine.module.named_parameters():
            if "lora_B" in name:
                local = p.to_local() if hasattr(p, "to_local") else p
                local.copy_((0.01 * torch.randn(local.shape, generator=gen)).to(local))
    return engine


def grpo_batch(
    seed: int,
    *,
    vocab: int,
    remove_padding: bool = True,
    B: int = 4,
    P: int = 8,
    R: int = 24,
    full: bool = False,
    entropy: bool = False,
    micro_batch: int = 2,
):
    """A left/right-padded GRPO batch as verl's trainer hands it to the actor, made no-padding
    by verl's ``left_right_2_no_padding``, with the non-tensor keys its worker adds;
    ``full``: every prompt P and every response R tokens."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    g = torch.Generator().manual_seed(seed)
    plen = torch.full((B,), P) if full else torch.randint(2, P + 1, (B,), generator=g)
    rlen = torch.full((B,), R) if full else torch.randint(2, R + 1, (B,), generator=g)
    ids = torch.randint(1, vocab, (B, P + R), generator=g)
    am = torch.zeros(B, P + R, dtype=torch.long)
    for i in range(B):
        am[i, P - plen[i] : P] = 1
        am[i, P : P + rlen[i]] = 1
    td = TensorDict(
        {
            "input_ids": ids,
            "attention_mask": am,
            "position_ids": (am.cumsum(-1) - 1).clamp(min=0),
            "response_mask": am[:, P:].clone(),
            "prompts": ids[:, :P],
            "responses": ids[:, P:],
            "old_log_probs": -3 * torch.rand(B, R, generator=g),
            "ref_log_prob": -3 * torch.rand(B, R, generator=g),
            "advantages": torch.randn(B, R, generator=g),
        },
        batch_size=B,
    )
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(
        td,
        temperature=1.0,
        use_remove_padding=remove_padding,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=micro_batch,
        global_batch_size=B,
        calculate_entropy=entropy,
        use_fused_kernels=False,
        max_token_len_per_gpu=B * (P + R),
    )
    return td


def ppo_loss_fn(batch_size: int = 4, micro_batch: int = 2, **actor):
    from functools import partial

    from verl.workers.config import FSDPActorConfig
    from verl.workers.utils.losses import ppo_loss

    cfg = FSDPActorConfig(
        strategy="fsdp2",
        ppo_mini_batch_size=batch_size,
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=micro_batch,
        use_dynamic_bsz=False,
        **actor,
    )
    return partial(ppo_loss, config=cfg)


def batch_gradient(engine, td, loss_fn) -> torch.Tensor:
    """One ``forward_backward_batch``; the trainable parameters' gradient, on the CPU (read
    inside train mode: leaving it zeroes the gradients)."""
    engine.optimizer_zero_grad()
    with engine.train_mode():
        engine.forward_backward_batch(td, loss_fn)
        return torch.cat(
            [
                (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).flatten().float().cpu()
                for p in engine.module.parameters()
                if p.requires_grad and p.grad is not None
            ]
        )


def check(
    build: Callable[[str], object],
    batch,
    loss_fn,
    modes: Sequence[str] = ("hilore-hr", "hilore"),
    steps: int = 2,
    log=print,
) -> Dict:
    """See the module docstring. ``build(kind)``: a fresh engine of that kind."""
    grads, times, peaks = {}, {}, {}
    engines = {}
    for kind in ("verl", "verl-repeat") + tuple(modes):
        engines[kind] = build("verl" if kind.startswith("verl") else kind)
        grads[kind] = batch_gradient(engines[kind], batch.clone(), loss_fn)
        mb = getattr(engines[kind], "hilore", None)
        peaks[kind] = None if mb is None else max(mb.batch_peaks)
        log(
            f"[verify] {kind}: gradient norm {float(grads[kind].norm()):.4g}"
            + (f", peak/B {peaks[kind]:.3f}, actions {mb.last.get('counts')}" if mb is not None else "")
        )
    ref = grads["verl"]
    floor = float((grads["verl-repeat"] - ref).norm() / ref.norm())
    for _ in range(steps):
        for kind, eng in engines.items():
            t0 = time.perf_counter()
            batch_gradient(eng, batch.clone(), loss_fn)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times.setdefault(kind, []).append(time.perf_counter() - t0)
    tol_hr = max(1e-3, 4 * floor)
    result = {
        "noise_floor": floor,
        "tolerance": {"hilore-hr": tol_hr, "hilore": tol_hr + 0.015},
        "relative_error": {},
        "peak_over_budget": peaks,
        "seconds": times,
        "failures": [],
    }
    for mode in modes:
        rel = float((grads[mode] - ref).norm() / ref.norm())
        result["relative_error"][mode] = rel
        tol = result["tolerance"]["hilore-hr" if mode == "hilore-hr" else "hilore"]
        if rel > tol:
            result["failures"].append(f"{mode}: gradient relative error {rel:.4g} > {tol:.4g}")
        if peaks[mode] is not None and peaks[mode] > 1.0:
            result["failures"].append(f"{mode}: micro-batch peak {peaks[mode]:.3f} x B is over B")
    return result


def _smollm2_dir(path: str) -> str:
    from ..models import load_smollm2

    load_smollm2().save_pretrained(path)
    return path


def one_gpu_process_group(prog: str, port: str) -> bool:
    """The one-rank NCCL group and verl engine registration a one-GPU check runs in; False,
    with a message, without a CUDA device."""
    if not torch.cuda.is_available():
        print(f"error: python -m {prog} needs a CUDA device (verl's engine)", flush=True)
        return False
    import torch.distributed as dist

    from .fsdp_engine import register

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", port)
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    register()
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hilore_actor.verl.verify", description=__doc__.splitlines()[0])
    p.add_argument(
        "--model", default=None, help="HF model directory (default: the bundled SmolLM2, written to --workdir)"
    )
    p.add_argument("--workdir", default="/tmp/hilore-verl-verify")
    p.add_argument("--budget", default="1.10")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if not one_gpu_process_group("hilore_actor.verl.verify", "29511"):
        return 2
    path = args.model or _smollm2_dir(os.path.join(args.workdir, "smollm2"))
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    batch = grpo_batch(args.seed, vocab=vocab, B=8, P=256, R=1792, full=True, micro_batch=4)
    loss_fn = ppo_loss_fn(batch_size=8, micro_batch=4)
    settings = {"budget": args.budget, "calibration_batches": 4}
    job = {"plan_tokens": 4 * 2048, "seqs_per_microbatch": 4, "group_size": 8, "fsdp": "fsdp2"}
    result = check(
        lambda kind: build_engine(
            kind, path, args.seed, micro_batch=4, attn="flash_attention_2", mixed=True, settings=settings, job=job
        ),
        batch,
        loss_fn,
        steps=args.steps,
    )
    result.update(model=path, budget=args.budget, torch=torch.__version__, device=torch.cuda.get_device_name(0))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: result[k] for k in ("noise_floor", "relative_error", "peak_over_budget", "failures")}))
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
