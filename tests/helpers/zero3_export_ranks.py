"""Worker for test_weights.py: the learner's weight export under DeepSpeed ZeRO-3 on 2 CPU ranks
(gloo), per-module gathers, against the unwrapped model's export. Launched with torchrun; rank 0
prints JSON."""

import json
import os
import sys

import torch


def main():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    from hilore_actor.models import LoraSpec, build_model, tiny_config
    from hilore_actor.models import weights
    from hilore_actor.runtime.distributed import init_deepspeed_distributed

    init_deepspeed_distributed("cpu")
    rank = torch.distributed.get_rank()
    model = build_model(tiny_config("qwen2", hidden_size=64, num_layers=2, vocab_size=128), lora=LoraSpec(4, 8), seed=0)
    g = torch.Generator().manual_seed(5)
    for p in model.parameters():
        if p.requires_grad:
            p.data = 0.05 * torch.randn(p.shape, generator=g)
    ref = {kind: weights.export_weights(model, kind) for kind in ("merged", "full", "adapter")}
    largest = max(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 3}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    partitioned = all(p.numel() == 0 or p.data.numel() < p.ds_numel for p in engine.module.parameters())
    gathered = []

    def gather(params):
        gathered.append(sum(p.ds_numel for p in params))
        return weights.zero3_gather(params)

    out = {"partitioned": partitioned, "largest": largest}
    for kind in ref:
        gathered.clear()
        got = weights.export_weights(engine.module, kind, gather=gather, keep=rank == 0)
        out[kind] = {
            "gathers": len(gathered),
            "max_gathered": max(gathered),
            "total": sum(p.ds_numel for p in engine.module.parameters()),
        }
        if rank == 0:
            out[kind]["equal"] = list(got) == list(ref[kind]) and all(torch.equal(got[k], ref[kind][k]) for k in got)
        else:
            out[kind]["none"] = got is None
    outs = [None, None]
    torch.distributed.all_gather_object(outs, out)
    if rank == 0:
        print("RESULT " + json.dumps(outs), flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    # as ds_worker.py: skip the interpreter's teardown, where a thread DeepSpeed or gloo leaves
    # joinable can abort ("terminate called without an active exception") after the result is out
    os._exit(0)
