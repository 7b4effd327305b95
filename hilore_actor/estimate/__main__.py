"""``python -m hilore_actor.estimate --model qwen2.5-7b --tokens 16384 --device h100 --budget 1.10``:
a rank's memory and HiLoRe's plan at B before the run, computed on this machine's CPU in seconds
(``plan.py``). ``--json`` prints the whole estimate as JSON for tools."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import MISSING, fields

from .meta import MetaUnsupported
from .plan import Setting, estimate

GiB = 2**30


def _bool(v: str) -> bool:
    from ..learner.settings import boolean

    return boolean(v)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hilore_actor.estimate",
        description="A learner rank's resident bytes, gc's and no-gc's peaks, B, and HiLoRe's plan at B with its "
        "predicted gain over gc, for a model that is not here: bytes exact (the meta device), time from a roofline.",
    )
    for f in fields(Setting):
        typ = _bool if f.type in (bool, "bool") else {"int": int, "float": float, "str": str}.get(str(f.type), f.type)
        default = None if f.default is MISSING else f.default
        p.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            type=typ,
            default=default,
            required=f.name == "model",
            help=f"{f.metadata['help']} (default: {default})" if f.name != "model" else f.metadata["help"],
        )
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")
    return p


def _g(b: float) -> str:
    return f"{b / GiB:.2f} GiB"


def render(e) -> str:
    s, d = e.setting, e.device
    ft = "full fine-tuning" if s["lora_rank"] == 0 else f"LoRA {s['lora_rank']}"
    lines = [
        f"{s['model']}: {e.parameters / 1e9:.2f}B parameters ({ft}: {e.trainable / 1e6:.1f}M trained), "
        f"{s['tokens']} tokens per microbatch ({s['micro_batch']} sequences), ZeRO-{s['zero_stage']} on "
        f"{s['ranks']} rank(s), {s['dtype']}, {d['name']} ({_g(d['memory_bytes'])})",
        "per rank (exact, meta device):",
        f"  resident            {_g(e.resident_bytes)}",
        f"  gc peak             {_g(e.gc_peak_bytes)}  ({'fits' if e.gc_fits else 'does NOT fit'} the device)",
        f"  no-gc peak          {_g(e.nogc_peak_bytes)}  "
        f"({'fits' if e.nogc_peak_bytes <= d['memory_bytes'] else 'does not fit'} the device)",
        f"  B ({s['budget']})        {_g(e.budget_bytes)}; room above gc {_g(e.room_over_gc_bytes)}"
        + ("  (B is above the device's capacity)" if e.budget_bytes > d["memory_bytes"] else ""),
        f"update time under gc (predicted): {e.gc_update_seconds:.3f} s per microbatch "
        f"(forward {e.forward_seconds:.3f} s, backward {e.backward_seconds:.3f} s, recompute "
        f"{sum(e.unit_seconds.values()):.3f} s)",
    ]
    for name, p in e.plans.items():
        title = "exact plan (H/R)" if name == "exact" else "plan if L carried no risk (upper bound)"
        counts = ", ".join(f"{v} {k}" for k, v in sorted(p.counts.items()))
        lines += [
            f"{title}: {counts}",
            "  " + "; ".join(f"{k}: layers {v}" for k, v in p.layers.items()),
            f"  peak {_g(p.meta_peak_bytes)} on the meta device (knapsack's prediction {_g(p.predicted_peak_bytes)})",
            f"  predicted: {p.update_seconds:.3f} s per microbatch, {p.gain_over_gc:+.1%} over gc, "
            f"{p.recompute_removed:.1%} of gc's recompute removed",
            f"  if offloaded instead: the {p.counts.get('R', 0)} R units' {_g(p.offload_bytes)} would cross to the "
            f"host each way, {p.offload_seconds:.2f} s at {d['host_bandwidth'] / 1e9:.0f} GB/s, against "
            f"{e.forward_seconds:.3f} s of forward and {e.backward_seconds:.3f} s of backward to hide behind",
        ]
    lines.append("assumptions: " + "; ".join(e.assumptions))
    lines.append(f"(estimated in {e.seconds_to_estimate:.1f} s)")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = vars(build_parser().parse_args(argv))
    as_json = args.pop("json")
    try:
        e = estimate(Setting(**args))
    except (ValueError, KeyError) as err:
        msg = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
        print(f"error: {msg}", file=sys.stderr)
        return 2
    except MetaUnsupported as err:
        print(f"error: {args['model']}'s forward does not run on the meta device: {err}", file=sys.stderr)
        return 2
    print(json.dumps(e.to_json(), indent=1) if as_json else render(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
