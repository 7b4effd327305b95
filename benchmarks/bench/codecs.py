"""The codec benchmark: what each L codec costs in bytes, time and gradient error.

``python -m benchmarks.bench.codecs --model smollm2|cpu-ref|cpu-small|PATH --json OUT [--markdown OUT]``

Per codec it reports, on the model's own activations:

1. per kind of saved tensor (``saved_kinds``: rotated queries / keys, values, softmax
   statistics, the projections' inputs, LoRA intermediates, the rest): the stored-bytes
   compression ratio and the relative reconstruction error ``sqrt(sum ||x^ - x||^2 / sum ||x||^2)``
   over every layer (the tensors one forward of the first microbatch saves for backward);
2. encode + decode seconds per MiB of input;
3. the relative error of one update's summed gradient (2 microbatches) against no-gc when
   every unit is L, only attention units are L, or only MLP units are L (the rest R, which is
   exact), over ``--sets`` disjoint sets of microbatches: real rows from
   ``benchmarks.real_batches`` for ``smollm2`` (real weights, real text), replayed random rows otherwise;
4. for ``--kind-codecs``: the gradient error when only one kind is compressed (first set),
   which is what the engine's rules about kinds L must keep exact rest on.

LoRA B starts away from zero (``Workload.lora_b_std``), so ``lora_A`` has gradients.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple

import torch

SCOPES = ("all", "attn", "mlp")


class _Kinds:
    """Accumulates, per codec and tensor kind, squared errors, norms, bytes and codec time."""

    def __init__(self, codecs: Dict):
        self.codecs = codecs
        self.acc: Dict = {c: {} for c in codecs}

    def add(self, kind: str, x: torch.Tensor) -> None:
        x = x.detach()
        xf = x.float()
        for name, codec in self.codecs.items():
            t0 = time.perf_counter()
            p = codec.encode(x)
            y = codec.decode(p)
            dt = time.perf_counter() - t0
            if not p.finite():  # additive -inf masks: the engine keeps them exact
                continue
            a = self.acc[name].setdefault(kind, [0.0, 0.0, 0, 0, 0.0])
            a[0] += float((y.float() - xf).pow(2).sum())
            a[1] += float(xf.pow(2).sum())
            a[2] += x.numel() * x.element_size()
            a[3] += p.nbytes
            a[4] += dt

    def summary(self) -> Dict:
        out = {}
        for name, kinds in self.acc.items():
            tot_in = sum(a[2] for a in kinds.values())
            out[name] = {
                "compression": tot_in / sum(a[3] for a in kinds.values()),
                "seconds_per_mib": sum(a[4] for a in kinds.values()) / (tot_in / 2**20),
                "kinds": {
                    k: {"rel_err": (a[0] / a[1]) ** 0.5 if a[1] else 0.0, "compression": a[2] / a[3]}
                    for k, a in kinds.items()
                },
            }
        return out


def capture_kinds(model, mb, codecs: Dict) -> Tuple[Dict, Dict[str, int]]:
    """Per-kind reconstruction errors of every codec over the tensors one forward of ``mb``
    saves for backward (kinds: ``saved_kinds``; the tensors L would compress), and the saved
    bytes of each kind (parameters excluded)."""
    from hilore_actor.grpo.microbatch import microbatch_loss
    from hilore_actor.recovery.rules import exact_reason
    from .saved_kinds import SavedKinds

    kinds = _Kinds(codecs)

    def record(kind, t):
        if exact_reason(t) is None:
            kinds.add(kind, t)
        return t

    with SavedKinds(model, record) as sk:
        microbatch_loss(model, mb, chunked_head=True)  # the graph is dropped unused
    return kinds.summary(), sk.bytes


def scope_plan(engine, scope: str) -> Dict[str, str]:
    """Unit -> plan: L ("compressed") on the units of ``scope``, R on the others."""
    kinds = {u.name: u.kind for layer in engine.layer_specs for u in layer.units}
    return {n: "compressed" if scope == "all" or k == scope else "checkpoint" for n, k in kinds.items()}


def update_grad(runner, mbs, plan) -> torch.Tensor:
    g = None
    for i, mb in enumerate(mbs):
        g = runner.run(mb, plan, grads=True, accumulate=i > 0).grad
    return g


def grad_errors(runner, sets: List[List], codecs: Dict, scopes, log) -> Dict:
    """codec -> scope -> relative gradient error per set (against no-gc, same microbatches)."""
    out = {c: {s: [] for s in scopes} for c in codecs}
    for i, mbs in enumerate(sets):
        ref = update_grad(runner, mbs, "no-gc")
        for name, codec in codecs.items():
            runner.engine.codec = codec
            for s in scopes:
                g = update_grad(runner, mbs, scope_plan(runner.engine, s))
                out[name][s].append(float((g - ref).norm() / ref.norm()))
            log(f"[codecs] set {i + 1}/{len(sets)} {name}: " + ", ".join(f"{s} {out[name][s][-1]:.4f}" for s in scopes))
    return out


def _args(argv):
    from hilore_actor.recovery import CODECS

    p = argparse.ArgumentParser(prog="python -m benchmarks.bench.codecs", description=__doc__.splitlines()[0])
    p.add_argument(
        "--model",
        default="smollm2",
        help="smollm2 (real weights and text), cpu-ref or cpu-small "
        "(random weights of the benchmark's shapes), or a path to an HF model dir / config.json",
    )
    p.add_argument("--codecs", default=",".join(sorted(CODECS)), help="comma list (default: every registered codec)")
    p.add_argument("--scopes", default=",".join(SCOPES), help="which units are L in the gradient runs: all, attn, mlp")
    p.add_argument(
        "--kind-codecs",
        default="int8,int8-g64,bf16",
        help="codecs whose gradient error is also measured per saved-tensor kind (first set; '' = none)",
    )
    p.add_argument("--tokens", type=int, default=1024, help="tokens per packed microbatch")
    p.add_argument("--sets", type=int, default=3, help="disjoint sets of 2 microbatches for the gradient error")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", required=True)
    p.add_argument("--markdown", default=None)
    args = p.parse_args(argv)
    args.codec_names = [c for c in args.codecs.split(",") if c]
    args.scope_names = [s for s in args.scopes.split(",") if s]
    args.kind_codec_names = [c for c in args.kind_codecs.split(",") if c]
    bad = [c for c in args.codec_names + args.kind_codec_names if c not in CODECS] + [
        s for s in args.scope_names if s not in SCOPES
    ]
    args.codec_names += [c for c in args.kind_codec_names if c not in args.codec_names]
    if bad or not args.codec_names or args.tokens < 64 or args.sets < 1:
        p.error(
            f"unknown codecs/scopes {bad}; choose from {sorted(CODECS)} and {SCOPES}"
            if bad
            else "need at least one codec, --tokens >= 64 and --sets >= 1"
        )
    return args


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv=None) -> int:
    from functools import partial

    from hilore_actor.grpo.microbatch import microbatch_loss
    from hilore_actor.recovery import RecoveryEngine, get_codec
    from .cli import git_state
    from .inputs import build_inputs
    from .methods import head_runners
    from .saved_kinds import kind_grad_errors
    from .workloads import WORKLOADS

    args = _args(argv)
    git = git_state()
    named = args.model in WORKLOADS or args.model == "smollm2"
    wl = WORKLOADS["cpu-real" if args.model == "smollm2" else args.model if named else "cpu-ref"]
    wl = dataclasses.replace(wl, tokens=args.tokens)
    ns = argparse.Namespace(
        updates=args.sets, calib_tokens=None, seed=args.seed, arch=None, model_config=None if named else args.model
    )
    if not named and not Path(args.model).exists():
        print(
            f"error: --model {args.model!r}: not smollm2, {', '.join(WORKLOADS)}, nor an existing path", file=sys.stderr
        )
        return 2
    inputs = build_inputs(wl, ns, torch.device("cpu"), 0, log=log)
    codecs = {c: get_codec(c) for c in args.codec_names}
    log(f"[codecs] {args.model}: per-kind reconstruction over one forward of {args.tokens} tokens")
    result, saved = capture_kinds(inputs.model, inputs.updates[0][0], codecs)
    if args.kind_codec_names:
        log(f"[codecs] gradient error per saved-tensor kind ({', '.join(args.kind_codec_names)}), first set")
    for c in args.kind_codec_names:
        result[c]["kind_grad_rel_err"] = kind_grad_errors(
            inputs.model,
            partial(microbatch_loss, chunked_head=True),
            inputs.updates[0],
            codecs[c],
            [k for k, b in saved.items() if b],
        )
    runner = head_runners(inputs.model, RecoveryEngine(inputs.model))["chunked"]
    errs = grad_errors(runner, inputs.updates, codecs, args.scope_names, log)
    for c in codecs:
        result[c]["grad_rel_err"] = {s: {"mean": sum(v) / len(v), "max": max(v), "all": v} for s, v in errs[c].items()}
    head = {
        "model": args.model,
        "workload": wl.describe(),
        "tokens": args.tokens,
        "sets": args.sets,
        "microbatches_per_set": wl.microbatches,
        "inputs": inputs.provenance,
        "saved_bytes_by_kind": saved,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "git_commit": git[0],
        "git_dirty": git[1],
        "command": "python -m benchmarks.bench.codecs " + shlex.join(argv if argv is not None else sys.argv[1:]),
    }
    Path(args.json).write_text(json.dumps({**head, "codecs": result}, indent=1))
    md = markdown(head, result, args.scope_names)
    if args.markdown:
        Path(args.markdown).write_text(md)
    print(md)
    return 0


def markdown(head: Dict, result: Dict, scopes) -> str:
    kinds = sorted({k for r in result.values() for k in r["kinds"]})
    lines = [
        f"# L codecs on {head['model']}",
        "",
        f"`{head['command']}`",
        "",
        f"Gradient error: relative error of one update's summed gradient ({head['microbatches_per_set']} x "
        f"{head['tokens']} tokens) against no-gc, mean [max] over {head['sets']} disjoint sets; "
        "`attn` / `mlp`: only those units L, the rest R.",
        "",
        "| codec | bytes ratio | s / MiB | " + " | ".join(f"grad err, {s} L" for s in scopes) + " |",
        "|---|---|---|" + "---|" * len(scopes),
    ]
    for c, r in result.items():
        g = r["grad_rel_err"]
        lines.append(
            f"| {c} | {r['compression']:.2f} | {r['seconds_per_mib']:.4f} | "
            + " | ".join(f"{g[s]['mean']:.4f} [{g[s]['max']:.4f}]" for s in scopes)
            + " |"
        )
    saved = head["saved_bytes_by_kind"]
    total = sum(saved.values()) or 1
    lines += [
        "",
        "Saved bytes by kind (one forward, parameters excluded): "
        + ", ".join(f"{k} {v / total:.1%}" for k, v in sorted(saved.items(), key=lambda kv: -kv[1]) if v),
        "",
    ]
    studied = {c: r["kind_grad_rel_err"] for c, r in result.items() if "kind_grad_rel_err" in r}
    if studied:
        ks = list(next(iter(studied.values())))
        lines += [
            "Gradient error when only one kind is compressed (every layer, first set):",
            "",
            "| codec | " + " | ".join(ks) + " |",
            "|---|" + "---|" * len(ks),
        ]
        lines += [f"| {c} | " + " | ".join(f"{e[k]:.4f}" for k in ks) + " |" for c, e in studied.items()]
    lines += [
        "",
        "Reconstruction error by tensor kind (all layers):",
        "",
        "| codec | " + " | ".join(kinds) + " |",
        "|---|" + "---|" * len(kinds),
    ]
    for c, r in result.items():
        lines.append(
            f"| {c} | "
            + " | ".join(f"{r['kinds'][k]['rel_err']:.4f}" if k in r["kinds"] else "-" for k in kinds)
            + " |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
