"""Worker for test_distributed.py: 2 CPU ranks over gloo, DeepSpeed ZeRO engines around a tiny
LoRA model, gradients of no-gc vs engine policies, for each configuration named on the command
line. Launched with torchrun; rank 0 prints one JSON object, keyed by configuration."""

import json
import os
import sys

import torch


def main():
    """Every configuration named on the command line (``STAGE:DTYPE[:METHOD,METHOD,...]``) in turn
    on the same two ranks: one process group and one start-up for all of them."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    sys.path.insert(0, os.path.dirname(__file__))
    sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # conftest's helpers
    from hilore_actor.runtime.distributed import init_deepspeed_distributed

    init_deepspeed_distributed("cpu")
    out = {}
    for config in sys.argv[1:]:
        stage, dtype_name, *methods = config.split(":")
        out[config] = run(int(stage), dtype_name, methods[0].split(",") if methods else None)
    if torch.distributed.get_rank() == 0:
        print("RESULT " + json.dumps(out), flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()  # orderly shutdown: an implicit one at exit can abort


def run(stage: int, dtype_name: str, methods=None) -> dict:
    """A DeepSpeed ZeRO ``stage`` engine around a fresh tiny LoRA model per method; the methods'
    gradients against no-gc's (rank 0's summary)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    from conftest import grpo_loss, packed_microbatch  # on the path main set
    from hilore_actor.models import LoraSpec, build_model, tiny_config
    from hilore_actor.recovery import RecoveryEngine, apply_baseline

    rank = torch.distributed.get_rank()
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    ids, pos = packed_microbatch(96, 128, n_seqs=3, seed=100 + rank)  # each rank its own data
    results = {}
    methods = methods or ["no-gc", "gc", "all-r", "all-h", "mixed"]
    for method in methods:
        model = build_model(
            tiny_config("qwen2", hidden_size=64, num_layers=2, vocab_size=128), lora=LoraSpec(4, 8, 0.1), seed=0
        )
        if method == "gc":
            apply_baseline(model, "gc")
        cfg = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": stage},
            "bf16": {"enabled": dtype == torch.bfloat16},
        }
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        engine_ds, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        engine_ds.train()
        torch.manual_seed(7 + rank)
        if method in ("no-gc", "gc"):
            engine_ds.backward(grpo_loss(engine_ds, ids, pos))
        else:
            rec = RecoveryEngine(engine_ds)
            plan = {"mixed": {n: "HR"[i % 2] for i, n in enumerate(rec.unit_names)}, "h-to-l": "all-h"}.get(
                method, method
            )
            weights = watch_weights(engine_ds.module) if method in ("all-l", "h-to-l") else None
            if weights is not None:
                spy_compress(weights, spied := {"weights": [], "activations": 0})
            with rec.step(plan) as step:
                loss = grpo_loss(engine_ds, ids, pos)
                if method == "h-to-l":
                    step.set_actions("all-l")  # the online chooser's path: exact in forward, L after it
                engine_ds.backward(loss)
            rec.detach()
            if weights is not None:
                unspy_compress()
                results[method + ":spied"] = spied
            results["units"] = rec.unit_names
        grads = {n: safe_get_full_grad(p) for n, p in engine_ds.module.named_parameters() if p.requires_grad}
        results[method] = {n: g.float() for n, g in grads.items() if g is not None}
    out = {"units": results.get("units")}
    ref = results["no-gc"]
    out["n_grads"] = len(ref)
    for m in methods[1:]:
        out[m] = all(torch.equal(results[m][n], ref[n]) for n in ref) and set(results[m]) == set(ref)
        if m + ":spied" in results:  # L: the relative error and what was compressed
            num = torch.cat([(results[m][n] - ref[n]).flatten() for n in ref]).norm()
            out[m + ":rel"] = float(num / torch.cat([r.flatten() for r in ref.values()]).norm())
            out[m + ":spied"] = results[m + ":spied"]
    out["grad_norm"] = float(torch.cat([g.flatten() for g in ref.values()]).norm())
    return out


def watch_weights(module) -> dict:
    """The storages of every parameter's data as each module runs: under ZeRO-3, the gathered
    full weights DeepSpeed's pre-forward hooks (registered first, so run first) put there."""
    seen = {}

    def pre(m, args):  # holding the storage keeps its address from being reused by an activation
        seen.update((p.data.untyped_storage()._cdata, p.data.untyped_storage()) for p in m.parameters(recurse=False))

    for m in module.modules():
        m.register_forward_pre_hook(pre)
    return seen


_COMPRESS = []


def spy_compress(weights: dict, log: dict) -> None:
    """Wrap ``Step.compress``: count what it encodes, and record (not encode) any weight or any
    tensor whose storage is already freed (a released ZeRO-3 gather)."""
    from hilore_actor.recovery.step import Step

    orig = Step.compress
    _COMPRESS.append(orig)

    def compress(self, t, unit, keep_sign=False):
        if (
            isinstance(t, torch.nn.Parameter)
            or t.untyped_storage()._cdata in weights
            or t.untyped_storage().nbytes() == 0
        ):
            log["weights"].append(f"{unit.name} {tuple(t.shape)}")
            return t
        log["activations"] += 1
        return orig(self, t, unit, keep_sign)

    Step.compress = compress


def unspy_compress() -> None:
    from hilore_actor.recovery.step import Step

    Step.compress = _COMPRESS.pop()


if __name__ == "__main__":
    main()  # an error exits non-zero from here, as usual
    sys.stdout.flush()
    sys.stderr.flush()
    # The result is out and the group destroyed. Skip the interpreter's teardown: a thread that
    # DeepSpeed or gloo leaves joinable can abort it ("terminate called without an active
    # exception", SIGABRT), failing a run whose result was already printed.
    os._exit(0)
