"""``python -m benchmarks.diagnostics``: GRPO coefficient structure and risk-predictor quality
(Spearman, top-10% recall and AUROC of three predictors of a unit's L error against its
measured single-unit gradient error, on microbatches held out from calibration), as a printed
table and a JSON report.

``--model tiny`` (default): a tiny random model on replayed microbatches (a mechanism check,
not a claim). ``--model smollm2``: the bundled SmolLM2-135M-Instruct with its real weights on
real rollout microbatches (``benchmarks.real_batches``: reasoning-gym prompts, responses sampled
from the model, verifier rewards, old log-probs one real AdamW step earlier); LoRA B starts
away from zero, so ``lora_A``'s gradients count."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from hilore_actor.recovery.codecs import DEFAULT_CODECS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.diagnostics", description=__doc__)
    p.add_argument(
        "--model",
        choices=("tiny", "smollm2"),
        default="tiny",
        help="tiny: a random model built in code (--arch); smollm2: real weights on real rollouts",
    )
    p.add_argument("--arch", default="qwen2", help="tiny model family built in code: qwen2 | llama | phi3")
    p.add_argument("--model-config", default=None, help="an HF config.json / model directory instead of --arch")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=512, help="tokens per packed microbatch")
    p.add_argument("--group-size", type=int, default=8, help="responses per prompt (smollm2's real rollouts)")
    p.add_argument("--lora-b-std", type=float, default=1e-3, help="LoRA B's N(0, std) start (0: peft's zeros)")
    p.add_argument("--calib", type=int, default=4, help="calibration microbatches (C)")
    p.add_argument("--heldout", type=int, default=4, help="held-out microbatches")
    p.add_argument("--codec", default=DEFAULT_CODECS.split(",")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the report here")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from hilore_actor.allocation import Runner
    from .analysis import coefficient_structure, predictor_quality
    from hilore_actor.recovery import RecoveryEngine

    torch.manual_seed(args.seed)
    try:
        model, mbs, provenance = _inputs(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    runner = Runner(model, RecoveryEngine(model, codec=args.codec))
    report = {
        "model": args.model if args.model == "smollm2" else f"tiny {args.model_config or args.arch}",
        "codec": args.codec,
        "calibration_microbatches": args.calib,
        "heldout_microbatches": args.heldout,
        "tokens": args.tokens,
        "seed": args.seed,
        "inputs": provenance,
        "coefficients": coefficient_structure(mbs),
    }
    t0 = time.perf_counter()

    def progress(done, total):  # a real model takes minutes: one line per microbatch
        if done % (len(runner.engine.unit_names) + 1) == 0:
            print(f"[diagnostics] {done}/{total} passes of this set ({time.perf_counter() - t0:.0f}s)", flush=True)

    report.update(predictor_quality(runner, mbs[: args.calib], mbs[args.calib :], progress=progress))
    c = report["coefficients"]
    print(
        f"zero policy-gradient coefficients: {c['zero_pg_coefficient_fraction']:.1%} of response tokens; "
        f"top 10% of tokens carry {c['top10_omega_mass']:.1%} of |omega|"
    )
    print(
        f"{'predictor':<20}{'spearman':>10}{'top10 recall':>14}{'AUROC':>8}   "
        f"({report['n_samples']} unit x microbatch samples)"
    )
    for name, q in report["predictors"].items():
        print(f"{name:<20}{q['spearman']:>10.3f}{q['top10_recall']:>14.3f}{q['auroc_top10']:>8.3f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"report written to {args.json}")
    return 0


def _inputs(args):
    """(model with LoRA, microbatches, their provenance) for ``--model``."""
    from hilore_actor.models import (
        LoraSpec,
        apply_lora,
        build_model,
        init_lora_b,
        load_model,
        load_smollm2,
        tiny_config,
    )
    from hilore_actor.workloads import replayed_microbatches

    lora = LoraSpec(16, 32)
    n = args.calib + args.heldout
    if args.model == "smollm2":
        from ..real_batches import real_microbatches

        base, tok = load_smollm2()
        model = apply_lora(base, lora)
        init_lora_b(model, args.lora_b_std, args.seed)
        model.train()
        mbs, prov = real_microbatches(model, tok, [args.tokens] * n, args.group_size, args.seed, dict(clip_eps_low=0.2))
        return model, mbs, dict(prov, lora_b_init=f"N(0, {args.lora_b_std}) seeded {args.seed}")
    model = (
        load_model(args.model_config, lora=lora)
        if args.model_config
        else build_model(
            tiny_config(args.arch, hidden_size=args.hidden, num_layers=args.layers, vocab_size=args.vocab), lora=lora
        )
    )
    model.train()
    return model, replayed_microbatches(model, n, args.tokens, seed=args.seed), {"inputs": "replayed random token ids"}


if __name__ == "__main__":
    raise SystemExit(main())
