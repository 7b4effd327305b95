"""``python -m hilore_actor.diagnostics``: GRPO coefficient structure and risk-predictor quality
on replayed microbatches of a model, as a printed table and a JSON report."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .recovery.codecs import DEFAULT_CODECS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hilore_actor.diagnostics", description=__doc__)
    p.add_argument("--arch", default="qwen2", help="tiny model family built in code: qwen2 | llama | phi3")
    p.add_argument("--model-config", default=None, help="an HF config.json / model directory instead of --arch")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=512, help="tokens per packed microbatch")
    p.add_argument("--calib", type=int, default=4, help="calibration microbatches (C)")
    p.add_argument("--heldout", type=int, default=4, help="held-out microbatches")
    p.add_argument("--codec", default=DEFAULT_CODECS.split(",")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the report here")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from .allocation import Runner
    from .allocation.diagnostics import coefficient_structure, predictor_quality
    from .models import LoraSpec, build_model, load_model, tiny_config
    from .recovery import RecoveryEngine
    from .workloads import replayed_microbatches

    torch.manual_seed(args.seed)
    lora = LoraSpec(16, 32)
    try:
        model = (load_model(args.model_config, lora=lora) if args.model_config else
                 build_model(tiny_config(args.arch, hidden_size=args.hidden, num_layers=args.layers, vocab_size=args.vocab), lora=lora))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    model.train()
    mbs = replayed_microbatches(model, args.calib + args.heldout, args.tokens, seed=args.seed)
    runner = Runner(model, RecoveryEngine(model, codec=args.codec))
    report = {"coefficients": coefficient_structure(mbs)}
    report.update(predictor_quality(runner, mbs[: args.calib], mbs[args.calib:]))
    c = report["coefficients"]
    print(f"zero policy-gradient coefficients: {c['zero_pg_coefficient_fraction']:.1%} of response tokens; "
          f"top 10% of tokens carry {c['top10_omega_mass']:.1%} of |omega|")
    print(f"{'predictor':<20}{'spearman':>10}{'top10 recall':>14}{'AUROC':>8}   ({report['n_samples']} unit x microbatch samples)")
    for name, q in report["predictors"].items():
        print(f"{name:<20}{q['spearman']:>10.3f}{q['top10_recall']:>14.3f}{q['auroc_top10']:>8.3f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"report written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
