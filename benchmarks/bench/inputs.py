"""The benchmark's model and microbatches: measured updates, development and calibration batches.

Random-weight workloads replay synthetic GRPO microbatches (``hilore_actor.workloads``); the
real-model workload builds them from real text (``benchmarks.real_batches``). Either way LoRA B starts
away from zero (``Workload.lora_b_std``), so ``lora_A`` has gradients and their error counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List

import torch

from .workloads import Workload

LOSS = dict(clip_eps_low=0.2)


@dataclass
class BenchInputs:
    model: torch.nn.Module
    updates: List[List]  # each: one update's microbatches
    dev: List  # development microbatches (planning, peers' budget tuning)
    calib: List  # calibration microbatches (empty when nothing calibrates)
    provenance: Dict = field(default_factory=dict)

    @property
    def tokens_per_update(self) -> int:
        return sum(mb.num_tokens for mb in self.updates[0])


def build_model(wl: Workload, args, device):
    from hilore_actor.models import LoraSpec, build_model as build, init_lora_b, load_model, tiny_config

    lora = LoraSpec(wl.lora_rank, wl.lora_alpha)
    tokenizer = None
    if wl.source == "smollm2":
        from hilore_actor.models import apply_lora, load_smollm2

        base, tokenizer = load_smollm2(dtype=wl.torch_dtype)
        model = apply_lora(base, lora)
    elif args.model_config:
        model = load_model(args.model_config, dtype=wl.torch_dtype, lora=lora, seed=args.seed)
    else:
        model = build(tiny_config(args.arch or wl.arch, **wl.model), dtype=wl.torch_dtype, lora=lora, seed=args.seed)
    init_lora_b(model, wl.lora_b_std, args.seed)
    return model.to(device).train(), tokenizer


def build_inputs(wl: Workload, args, device, n_calib: int, log=print) -> BenchInputs:
    """``args.updates`` measured updates, 2 development microbatches, ``n_calib`` calibration ones."""
    from hilore_actor.workloads import replayed_microbatches

    model, tokenizer = build_model(wl, args, device)
    loss_opts = dict(LOSS, kl_coef=wl.kl_coef, kl_estimator=wl.kl_estimator)
    n_upd = wl.microbatches * args.updates
    calib_tokens = args.calib_tokens or wl.calib_tokens
    prov = {"lora_b_init": f"N(0, {wl.lora_b_std}) seeded {args.seed}"}
    if wl.source == "smollm2":
        from ..real_batches import real_microbatches

        sizes = [wl.tokens] * (n_upd + 2) + [calib_tokens] * n_calib
        mbs, real = real_microbatches(
            model, tokenizer, sizes, wl.group_size, args.seed, loss_opts, n_described=n_upd + 2, log=log
        )
        prov.update(real)
        calib = mbs[n_upd + 2 :]
    else:
        mbs = replayed_microbatches(
            model,
            n_upd + 2,
            wl.tokens,
            group_size=wl.group_size,
            prompt_frac=wl.prompt_frac,
            seed=args.seed,
            loss_options=loss_opts,
        )
        calib = (
            replayed_microbatches(model, n_calib, calib_tokens, seed=args.seed + 1, loss_options=loss_opts)
            if n_calib
            else []
        )
        prov["inputs"] = "replayed: random token ids, perturbed old/ref log-probs (hilore_actor.workloads)"
    updates = [mbs[i * wl.microbatches : (i + 1) * wl.microbatches] for i in range(args.updates)]
    # real rows: the update rows come first, then dev; the first row took the real optimizer step,
    # which is fine: its old log-probs still come from before that step
    return BenchInputs(model, updates, mbs[n_upd : n_upd + 2], calib, prov)
