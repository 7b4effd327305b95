"""Every causal-LM architecture of the installed transformers, under the recovery engine.

For each ``model_type`` of the causal-LM auto registry: a tiny random config, the model built on
the CPU, one microbatch, and the gradients of gc, all-H, all-R and all-L against no-gc. A row says
how the layers were cut (unit kinds per layer), whether H, R and gc are bitwise exact, and L's
relative error; or why the architecture was skipped (it cannot be built or run on a CPU without
weights, kernels or inputs it needs). A failure of the engine on a model that runs is an
``error`` row, never a skip.

``python tests/helpers/arch_sweep.py --write docs/architectures.md`` regenerates the documentation table;
``tests/models/test_architectures.py`` runs the sweep and compares.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import traceback
import warnings
from pathlib import Path

import torch

SIZES = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 128,
    "max_position_embeddings": 256,
    "num_experts": 4,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "n_embd": 64,
    "n_layer": 4,
    "n_head": 4,
    "n_inner": 96,
    "n_positions": 256,
    "rotary_dim": 8,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "first_k_dense_replace": 1,
    "sliding_window": 16,
    "num_layers": 4,
    "d_model": 64,
    "ffn_dim": 96,
    "n_group": 1,
    "topk_group": 1,
    "mamba_d_ssm": 128,  # state-space mixers at the same width: heads x head dim = expand x hidden
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_d_state": 16,
    "mamba_chunk_size": 16,
}
TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
SEQ = 32
MAX_PARAMS = 20_000_000


def tiny_config(model_type: str):
    """The architecture's default config at the sweep's sizes: built through the config class (so
    its own checks and derived fields see them), per-layer lists resized to the new layer count,
    multi-head latent attention with as many key/value heads as query heads (as real MLA configs
    have); where the class refuses the sizes as arguments, they are set one by one instead."""
    import transformers

    base = transformers.AutoConfig.for_model(model_type)
    kw = {k: v for k, v in {**SIZES, **TOKEN_IDS}.items() if hasattr(base, k)}
    if "num_experts_per_tok" in kw and getattr(base, "num_experts_per_tok", 0) == 1:
        kw["num_experts_per_tok"] = 1  # top-1 routers (and their checks) stay top-1
    if getattr(base, "kv_lora_rank", None):
        kw["num_key_value_heads"] = SIZES["num_attention_heads"]
        kw["head_dim"] = SIZES["qk_rope_head_dim"]
    n0 = next((getattr(base, k) for k in ("num_hidden_layers", "num_layers", "n_layer") if hasattr(base, k)), None)
    n = kw.get("num_hidden_layers") or kw.get("num_layers") or kw.get("n_layer")
    for k, v in vars(base).items():  # per-layer lists (layer_types, mlp_layer_types, ...) to n entries
        if isinstance(v, list) and v and n and k not in kw and (len(v) == n0 or k.endswith(("_types", "_type"))):
            kw[k] = (v * n)[:n]
    try:
        return transformers.AutoConfig.for_model(model_type, **kw)
    except Exception:  # noqa: BLE001  a class that derives and checks fields its own way: set one by one
        pass
    cfg = transformers.AutoConfig.for_model(model_type)
    for k, v in kw.items():
        try:
            setattr(cfg, k, v)
        except (AttributeError, TypeError, ValueError):
            pass
    return cfg


def _finite(v):
    """A config value with infinities as the largest float32 (config.json cannot hold inf, and a
    clamp at that bound is the same clamp)."""
    if isinstance(v, float) and v in (float("inf"), float("-inf")):
        return torch.finfo(torch.float32).max * (1 if v > 0 else -1)
    return type(v)(_finite(x) for x in v) if isinstance(v, (list, tuple)) else v


def _loss(model, ids):
    out = model(input_ids=ids, use_cache=False)
    logp = torch.log_softmax(out.logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    w = torch.linspace(-1, 1, logp.numel()).view_as(logp)  # signed token coefficients, like GRPO's
    return (w * logp).mean()


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel(g, ref):
    num = sum(float((g[n] - ref[n]).double().pow(2).sum()) for n in ref)
    den = sum(float(ref[n].double().pow(2).sum()) for n in ref)
    return (num / max(den, 1e-300)) ** 0.5


def _run(model, ids, engine=None, plan=None):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    if engine is None:
        _loss(model, ids).backward()
    else:
        with engine.step(plan):
            _loss(model, ids).backward()
    return _grads(model)


def build(model_type):
    """(model, input ids) or a skip reason (str): building and running the plain model on a CPU."""
    from hilore_actor.models import build_model

    import transformers

    try:
        cfg = tiny_config(model_type)
        with torch.device("meta"), contextlib.redirect_stderr(io.StringIO()):
            n = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(cfg).parameters())
        if n > MAX_PARAMS:
            return f"{n / 1e6:.0f}M parameters at the sweep's sizes (a width this config does not take from them)"
        with contextlib.redirect_stderr(io.StringIO()):
            model = build_model(cfg, seed=0).train()
        ids = torch.randint(3, 128, (2, SEQ), generator=torch.Generator().manual_seed(0))
        _run(model, ids)
    except Exception as e:  # noqa: BLE001  the plain model, not the engine: a reason to skip
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120]}" if str(e) else type(e).__name__
    return model, ids


def check(model_type: str) -> dict:
    built = build(model_type)
    if isinstance(built, str):
        return {"arch": model_type, "status": "skipped", "why": built}
    model, ids = built
    from hilore_actor.recovery import RecoveryEngine

    try:
        ref = _run(model, ids)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            try:
                engine = RecoveryEngine(model)
            except ValueError as e:  # the engine's own one-line refusal (no layers to cut, repeated layers)
                if str(e).startswith("hilore:"):
                    return {"arch": model_type, "status": "refused", "why": str(e)}
                raise
        fallback = any("whole-layer" in str(x.message) for x in w)
        errs = {plan: _rel(_run(model, ids, engine, plan), ref) for plan in ("all-h", "all-r", "all-l")}
        engine.detach()
        errs["gc"] = _gc_error(model, ids, ref)
    except Exception:  # noqa: BLE001  the engine failed on a model that runs: a finding, not a skip
        return {"arch": model_type, "status": "error", "why": traceback.format_exc(limit=-2)[-400:]}
    kinds = " + ".join(u.kind for u in engine.layer_specs[0].units)
    exact = all(errs[p] in (0, None) for p in ("all-h", "all-r", "gc"))
    return {
        "arch": model_type,
        "status": ("fallback" if fallback else "exact") if exact else "inexact",
        "units": kinds,
        "attention": model.config._attn_implementation,
        "all_l": errs["all-l"],
        "errors": errs,
        "layer": type(engine.layer_specs[0].module).__name__,
    }


def _gc_error(model, ids, ref):
    """gc's error: HF's layer checkpointing, or torch's per layer where HF has none."""
    from hilore_actor.recovery import apply_baseline

    apply_baseline(model, "gc")
    try:
        return _rel(_run(model, ids), ref)
    finally:
        apply_baseline(model, "no-gc")


def registry():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def markdown(rows) -> str:
    import transformers

    done = [r for r in rows if r["status"] not in ("skipped", "refused")]
    out = [
        f"# Architectures under the recovery engine (transformers {transformers.__version__}, torch "
        f"{torch.__version__.split('+')[0]})",
        "",
        "Generated by `python tests/helpers/arch_sweep.py --write docs/architectures.md` "
        "(the default suite runs the same sweep in `tests/models/test_architectures.py`). "
        "Each row: a tiny random config of the architecture, one "
        f"microbatch of 2 x {SEQ} tokens, gradients of gc, all-H, all-R and all-L against no-gc. Units per layer: "
        "the kinds of the first decoder layer's units (`attn`, `mlp`, `moe`: an expert block, no token L; `block`: "
        "attention and MLP on one residual add; `layer`: the whole layer, when it cannot be cut). exact: H, R and "
        "gc bitwise equal to no-gc. Random tiny weights: the all-L error shows that L acts, not what it costs on "
        "a real model.",
        "",
        f"{len(done)} architectures run, {sum(r['status'] == 'refused' for r in rows)} refused by the engine with one "
        f"message, {sum(r['status'] == 'skipped' for r in rows)} skipped. gc: where transformers has no gradient "
        "checkpointing for the architecture: gc is then `torch.utils.checkpoint` around each decoder layer.",
        "",
        "| architecture | decoder layer | units per layer | attention | H / R / gc | all-L error |",
        "|---|---|---|---|---|---|",
    ]
    for r in done:
        if "all_l" not in r:
            out.append(f"| `{r['arch']}` | - | - | - | {r['status']} | - |")
            continue
        out.append(
            f"| `{r['arch']}` | {r['layer']} | {r['units']} | {r['attention']} | {r['status']} | {r['all_l']:.2e} |"
        )
    out += ["", "## Refused by the engine, with its message", "", "| architecture | message |", "|---|---|"]
    out += [f"| `{r['arch']}` | {r['why'].replace('|', '/')} |" for r in rows if r["status"] == "refused"]
    out += ["", "## Skipped: the plain model does not build or run here", "", "| architecture | why |", "|---|---|"]
    out += [f"| `{r['arch']}` | {r['why'].replace('|', '/')} |" for r in rows if r["status"] == "skipped"]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", help="write the markdown table here")
    ap.add_argument("--configs", help="only write each architecture's tiny config to DIR/<arch>/config.json")
    ap.add_argument("archs", nargs="*", help="model types (default: every causal LM of the registry)")
    args = ap.parse_args(argv)
    if args.configs:
        for a in args.archs or registry():
            try:
                cfg = tiny_config(a)
                for k in ("max_position_embeddings", "n_positions"):  # the benchmark's microbatches are longer
                    if hasattr(cfg, k):
                        setattr(cfg, k, 4096)
                for k, v in list(vars(cfg).items()):
                    if _finite(v) != v:
                        setattr(cfg, k, _finite(v))
                cfg.save_pretrained(str(Path(args.configs) / a))
            except Exception as e:  # noqa: BLE001  reported; the caller's run of this architecture then fails
                print(f"{a}: no config written ({type(e).__name__}: {str(e)[:120]})", file=sys.stderr)
        return 0
    rows = []
    for a in args.archs or registry():
        rows.append(check(a))
        print(
            a, rows[-1]["status"], rows[-1].get("units", ""), rows[-1].get("why", "")[:160], file=sys.stderr, flush=True
        )
    if args.write:
        Path(args.write).write_text(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
