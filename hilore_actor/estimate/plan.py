"""A rank's memory and a plan at B for a model that is not here, before any GPU is rented.

Exact where the meta device makes it exact (``meta.py``): the resident bytes from the
parameters' shapes and the ZeRO stage, each unit's saved bytes, and the in-microbatch peaks of
gc (every unit R: decoder-layer checkpointing, ``recovery/engine.py`` rule 4), no-gc (every unit
H) and the plan. Predicted where only a device can measure (``roofline.py``): the seconds each
unit's recompute costs, hence the plan's gain over gc.

The plan is the planner's knapsack (Eq. 13, ``allocation/knapsack.py``) over the units' bytes
(``allocation/profiling.option_bytes``: an attention unit kept also keeps its MLP's input) and
their recompute seconds, in the room B leaves above gc's peak. L's risk is calibrated on real
rollouts, which an estimate has not got, so two plans bound HiLoRe's: ``exact`` (H and R
only: what ``--hilore.mode hilore-hr`` runs) and ``l_free`` (L as if it carried no risk: the
most any risk budget lets L do).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, List

import torch

from . import roofline
from .meta import linear_head, meta_microbatch, meta_model, step_peak, unit_bytes

MIB = 2**20


@dataclass
class Setting:
    """What the estimate is asked about; ``python -m hilore_actor.estimate`` makes its flags from these fields."""

    model: str = field(
        default="",
        metadata={
            "help": "a named config (qwen2.5-7b, ...), smollm2 (the bundled model), a config.json or an HF folder"
        },
    )
    tokens: int = field(default=16384, metadata={"help": "tokens per learner microbatch (one packed row)"})
    micro_batch: int = field(
        default=4, metadata={"help": "sequences per microbatch (attention's cost: tokens / sequences per sequence)"}
    )
    lora_rank: int = field(default=16, metadata={"help": "LoRA rank on all linear layers; 0: full fine-tuning"})
    zero_stage: int = field(default=2, metadata={"help": "DeepSpeed ZeRO stage 0-3 (FSDP full shard: 3)"})
    ranks: int = field(default=8, metadata={"help": "data-parallel ranks (GPUs) the learner runs on"})
    device: str = field(default="h100", metadata={"help": "h100, h200, a100, l40s or local (this machine, measured)"})
    budget: str = field(default="1.10", metadata={"help": "B per rank: a ratio of gc's peak (1.10) or a size (70GiB)"})
    dtype: str = field(default="bf16", metadata={"help": "weights and activations: bf16 or fp32"})
    codec: str = field(default="int8-g64,bf16", metadata={"help": "L's codecs, a comma list (--hilore.codec)"})
    chunked_head: bool = field(
        default=True, metadata={"help": "log-probs through the chunked head (false: full float32 logits)"}
    )
    efficiency: float = field(
        default=0.5, metadata={"help": "share of the device's dense bf16 peak every matmul reaches"}
    )


@dataclass
class PlanReport:
    actions: Dict[str, str]  # unit -> R | H | L level
    counts: Dict[str, int]
    layers: Dict[str, str]  # "attn H" -> layer ranges
    predicted_peak_bytes: int  # resident + gc's in-microbatch peak + the kept units' bytes
    meta_peak_bytes: int  # resident + the plan's in-microbatch peak, run on the meta device
    update_seconds: float
    gain_over_gc: float  # gc's update time / the plan's - 1
    recompute_removed: float  # share of gc's recompute seconds the plan removes
    offload_bytes: int  # the R units' bytes: what offloading them instead would move each way
    offload_seconds: float  # their transfer time one way at the host link's bandwidth


@dataclass
class Estimate:
    setting: Dict
    device: Dict
    assumptions: List[str]
    parameters: int
    trainable: int
    resident_bytes: int
    gc_peak_bytes: int  # resident + gc's in-microbatch peak
    nogc_peak_bytes: int  # resident + no-gc's
    gc_fits: bool
    budget_bytes: int
    room_over_gc_bytes: int  # B less gc's peak: what the plan may keep
    unit_bytes: Dict[str, Dict[str, float]]
    unit_seconds: Dict[str, float]  # unit -> its recompute (forward) seconds
    gc_update_seconds: float
    forward_seconds: float
    backward_seconds: float
    plans: Dict[str, PlanReport]
    seconds_to_estimate: float = 0.0

    def to_json(self) -> Dict:
        return asdict(self)


def resolve_config(spec: str):
    """A named config, a ``config.json`` or a local HF folder's config (``ValueError``: one line)."""
    import json
    from pathlib import Path

    import transformers

    from ..models.named import NAMED, named_config

    if spec.lower() in NAMED:
        return named_config(spec)
    if spec == "smollm2":  # the bundled model, as --pretrain names it
        from ..models.smollm2 import convert_smollm2

        return transformers.AutoConfig.from_pretrained(str(convert_smollm2()), local_files_only=True)
    p = Path(spec).expanduser()
    cfg_file = p / "config.json" if p.is_dir() else p
    if not cfg_file.is_file():
        raise ValueError(
            f"--model {spec}: not a named config ({', '.join(NAMED)}), a config.json or a folder holding one"
        )
    try:
        raw = json.loads(cfg_file.read_text())
        return transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)
    except (ValueError, KeyError) as e:
        raise ValueError(f"--model {spec}: {cfg_file} is not a causal LM's config ({type(e).__name__}: {e})") from None


def _ranges(layers: List[int]) -> str:
    out, run = [], []
    for i in sorted(layers):
        if run and i == run[-1] + 1:
            run.append(i)
        else:
            if run:
                out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = [i]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def estimate(s: Setting) -> Estimate:
    """See the module docstring."""
    import time

    from ..allocation.budget import parse_budget
    from ..allocation.knapsack import Option, solve
    from ..allocation.profiling import option_bytes
    from ..grpo.microbatch import microbatch_loss
    from ..learner.scope import resident_floor
    from ..models.chunked_head import head_chunk_rows, record_linear_head
    from ..models.factory import LoraSpec
    from ..recovery import RecoveryEngine
    from ..recovery.labels import codec_levels, plan_for_label
    from ..workloads import DEFAULT_LOSS

    t0 = time.perf_counter()
    config = resolve_config(s.model)
    dev = roofline.device(s.device)
    dtype = torch.bfloat16 if s.dtype == "bf16" else torch.float32
    lora = LoraSpec(s.lora_rank, 2.0 * s.lora_rank, 0.0, "all-linear") if s.lora_rank > 0 else None
    model = meta_model(config, dtype=dtype, lora=lora)
    engine = RecoveryEngine(model, codec=codec_levels(s.codec)[0])
    hidden, vocab = config.hidden_size, config.vocab_size
    chunked = s.chunked_head and linear_head(config)
    gpu = s.device.lower() != "local"
    rows = head_chunk_rows("cuda" if gpu else "cpu", vocab, hidden, dtype)
    if chunked:
        record_linear_head(model, True)

    def loss_fn(m, mb):
        return microbatch_loss(m, mb, chunked_head=chunked, entropy=True, head_chunk=rows)

    mb = meta_microbatch(s.tokens, 1, DEFAULT_LOSS)
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    mixed = dtype != torch.float32
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    resident = resident_floor(model, world=s.ranks, zero_stage=s.zero_stage, mixed_precision=mixed) + buffers
    assumptions = [
        f"matmuls at {s.efficiency:.0%} of the {dev.name}'s dense bf16 peak ({dev.bf16_flops / 1e12:.0f} TFLOP/s); "
        "elementwise work, the optimizer step and communication not timed",
        "gc = every unit R (decoder-layer checkpointing); peaks are live tensor bytes on the meta device "
        "(no allocator cache or fragmentation), gradients held as an update's later microbatches hold them",
        "attention: fused flash kernel shapes, one causal sequence per packed row (no [T, T] mask)",
        f"resident: weights, gradients and AdamW state under ZeRO-{s.zero_stage} on {s.ranks} rank(s)"
        + (" (bf16 weights: a float32 master copy)" if mixed else "")
        + "; DeepSpeed's buckets and padding not counted",
    ]
    if s.zero_stage >= 3:
        layer_weights = max(
            sum(p.numel() * p.element_size() for p in layer.module.parameters()) for layer in engine.layer_specs
        )
        resident += 2 * layer_weights
        assumptions.append("ZeRO-3: two layers' full weights gathered at a time (the one computing, the prefetched)")
    if s.chunked_head and not chunked:
        assumptions.append("the chunked head does not apply to this model (its logits are not a linear head)")
    elif chunked:
        assumptions.append(f"the chunked head, {rows} rows per chunk ({'CUDA' if gpu else 'CPU'} rule)")

    kind, value = parse_budget(s.budget)
    if kind == "ratio" and value < 1.0:
        raise ValueError(f"--budget {s.budget}: a ratio below 1 is below gc's own peak; give at least 1.0")
    if kind == "bytes" and value < resident:
        raise ValueError(
            f"--budget {s.budget}: below the {resident / 2**30:.2f} GiB a rank holds between microbatches "
            f"(weights, gradients, AdamW state under ZeRO-{s.zero_stage} on {s.ranks} rank(s))"
        )
    levels = codec_levels(s.codec)[1]
    ub = unit_bytes(engine, loss_fn, mb, levels=levels)
    gc_in = step_peak(engine, loss_fn, mb, "all-r")
    nogc_in = step_peak(engine, loss_fn, mb, "all-h")
    gc_peak, nogc_peak = resident + gc_in, resident + nogc_in
    budget = int(value * gc_peak) if kind == "ratio" else int(value)
    headroom = budget - gc_peak
    if headroom < 0:
        raise ValueError(
            f"--budget {s.budget}: {budget / 2**30:.2f} GiB is below gc's peak of {gc_peak / 2**30:.2f} GiB per rank "
            f"(resident {resident / 2**30:.2f} GiB + gc's microbatch {gc_in / 2**30:.2f} GiB): no plan fits it"
        )

    flops = {n: roofline.unit_flops(u, s.tokens, s.micro_batch, config) for n, u in engine.unit_specs.items()}
    fwd = {n: roofline.seconds(f.forward, dev, s.efficiency) for n, f in flops.items()}
    bwd = {n: roofline.seconds(f.backward, dev, s.efficiency) for n, f in flops.items()}
    head = roofline.head_flops(s.tokens, hidden, vocab, trained=lora is None, chunked=chunked)
    head_s = roofline.seconds(head.forward + head.backward, dev, s.efficiency)
    recompute = sum(fwd.values())
    gc_time = sum(fwd.values()) + sum(bwd.values()) + recompute + head_s
    dm = {n: option_bytes(ub, n, levels) for n in engine.unit_names}
    codec_s = {n: {a: roofline.codec_seconds(ub["H"][n], ub[a][n], dev) for a in levels} for n in engine.unit_names}

    plans = {}
    for label, allowed in (("exact", ("H",)), ("l_free", ("H", *levels))):
        items = [
            [Option("R", 0.0, 0.0)]
            + [
                Option(a, fwd[n] - (codec_s[n][a] if a != "H" else 0.0), float(dm[n][a]))
                for a in allowed
                if a == "H" or fwd[n] > codec_s[n][a]
            ]
            for n in engine.unit_names
        ]
        picks = solve(items, max(0.0, float(headroom)), 0.0) if headroom > 0 else [0] * len(items)
        actions = {n: items[i][j].action for i, (n, j) in enumerate(zip(engine.unit_names, picks))}
        saved = sum(items[i][j].value for i, j in enumerate(picks))
        kept = sum(items[i][j].memory for i, j in enumerate(picks))
        plan = {n: plan_for_label(a) if a != "R" else "checkpoint" for n, a in actions.items()}
        meta_peak = resident + step_peak(engine, loss_fn, mb, plan, actions)
        counts: Dict[str, int] = {}
        where: Dict[str, List[int]] = {}
        for n, a in actions.items():
            counts[a] = counts.get(a, 0) + 1
            u = engine.unit_specs[n]
            where.setdefault(f"{u.kind} {a}", []).append(u.layer)
        off = sum(ub["H"][n] for n, a in actions.items() if a == "R")
        plans[label] = PlanReport(
            actions=actions,
            counts=counts,
            layers={k: _ranges(v) for k, v in sorted(where.items())},
            predicted_peak_bytes=int(gc_peak + kept),
            meta_peak_bytes=int(meta_peak),
            update_seconds=gc_time - saved,
            gain_over_gc=gc_time / (gc_time - saved) - 1.0,
            recompute_removed=saved / recompute if recompute else 0.0,
            offload_bytes=int(off),
            offload_seconds=off / dev.host_bandwidth,
        )
    return Estimate(
        setting=asdict(s),
        device=asdict(dev),
        assumptions=assumptions,
        parameters=sum(p.numel() for p in params),
        trainable=sum(p.numel() for p in trainable),
        resident_bytes=int(resident),
        gc_peak_bytes=int(gc_peak),
        nogc_peak_bytes=int(nogc_peak),
        gc_fits=gc_peak <= dev.memory_bytes,
        budget_bytes=budget,
        room_over_gc_bytes=int(headroom),
        unit_bytes={n: {a: float(v) for a, v in dm[n].items()} for n in engine.unit_names},
        unit_seconds=fwd,
        gc_update_seconds=gc_time,
        forward_seconds=sum(fwd.values()) + roofline.seconds(head.forward, dev, s.efficiency),
        backward_seconds=sum(bwd.values()) + roofline.seconds(head.backward, dev, s.efficiency),
        plans=plans,
        seconds_to_estimate=time.perf_counter() - t0,
    )
