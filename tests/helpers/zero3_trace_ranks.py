"""Two gloo ranks of DeepSpeed ZeRO-3 on the CPU with a plan that changes per microbatch, for
``test_zero3_trace.py``.

Per rank, twice on the same weights and microbatches (one optimizer step each): plain autograd
(no-gc), then under the recovery engine with the H/R/P map ``PLANS`` names for that microbatch.
Each run counts the coordinator's trace invalidations (``_invalidate_trace``, wrapped on the
instance after ``deepspeed.initialize``, which invalidates once itself) and, after each step,
reads its count of available parameter elements and the true count, as it does at every fetch.
``GpuStandIn`` counts, inside backward, the collectives each of the engine's ZeRO-3 gathers issues
(per replayed module, per unpacked parameter) and the accelerator synchronizes the engine's frames
reach, with DeepSpeed told, for those frames, that the device does not order data itself (as on CUDA:
on the CPU accelerator DeepSpeed's blocking gather skips its ``synchronize``).
``python zero3_trace_ranks.py OUT.json kept,tight [PLAN,PLAN,...]`` (the ``ZERO`` configurations to run).
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # conftest's helpers
from gloo_ranks import spawn_two, start_deepspeed_rank, write_ranks  # noqa: E402

# one letter per unit, repeated over the units; "R": every unit (whole-layer replays)
PLANS = ["H", "H", "H", "HR", "H", "RH", "R", "PR", "H"]
# nothing persistent (else the tiny model stays gathered). "kept": DeepSpeed's reuse distance keeps
# forward's weights for backward, so a replay meets them gathered. "tight": weights released after
# each use and a short prefetch: backward gathers again, and a replay meets weights in flight.
ZERO = {
    "kept": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "tight": {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "stage3_max_reuse_distance": 0,
        "stage3_prefetch_bucket_size": 3000,
        "stage3_max_live_parameters": 6000,
    },
}


class GpuStandIn:
    """Count what the recovery engine's own frames make DeepSpeed do inside backward.

    ``collectives``: per gather call of ``hilore_actor/recovery/zero3.py`` (a replayed module's
    pre-forward ``gather``, or ``gathered_alias`` for one unpacked parameter), how many collectives
    reached DeepSpeed's communication backend. ``syncs``: ``synchronize`` calls with an engine frame on
    the stack. Outside backward, and for DeepSpeed's own frames, nothing changes.
    """

    GATHERS = ("gather", "gathered_alias")

    def __init__(self):
        import deepspeed.comm.comm as ds_comm
        from deepspeed.accelerator import get_accelerator

        self.acc, self.cdb = get_accelerator(), ds_comm.cdb
        self.calls, self.syncs, self.active = [], 0, False
        real_sync, real_resolves = self.acc.synchronize, self.acc.resolves_data_dependency

        def synchronize(*a, **k):
            if self.active and self.engine_frames():
                self.syncs += 1
            return real_sync(*a, **k)

        def resolves_data_dependency():
            return real_resolves() and not (self.active and self.engine_frames())

        self.acc.synchronize, self.acc.resolves_data_dependency = synchronize, resolves_data_dependency
        for name in ("all_gather", "all_gather_into_tensor", "all_gather_coalesced", "all_reduce", "broadcast"):
            setattr(self.cdb, name, self.counted(getattr(self.cdb, name)))

    def counted(self, fn):
        def call(*a, **k):
            if self.active:
                frame = next((f for f in self.engine_frames() if f.f_code.co_name in self.GATHERS), None)
                if frame is not None:
                    self.calls.append(frame)  # held: ids stay unique while counted
            return fn(*a, **k)

        return call

    @staticmethod
    def engine_frames():
        f, out = sys._getframe(1), []
        while f is not None:
            if f"hilore_actor{os.sep}" in f.f_code.co_filename:
                out.append(f)
            f = f.f_back
        return out

    def backward(self, eng, loss):
        self.active = True
        try:
            eng.backward(loss)
        finally:
            self.active = False

    def per_gather(self):
        """Collectives per gather call, in the order of the calls."""
        counts = {}
        for f in self.calls:
            counts[id(f)] = counts.get(id(f), 0) + 1
        return list(counts.values())


def actions(plan: str, units):
    return {n: plan[i % len(plan)] for i, n in enumerate(units)}


def run(rank: int, hilore: bool, zero: str, plans) -> dict:
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    from conftest import grpo_loss, packed_microbatch
    from hilore_actor.models import LoraSpec, build_model, tiny_config
    from hilore_actor.recovery import RecoveryEngine

    model = build_model(
        tiny_config("qwen2", hidden_size=64, num_layers=3, vocab_size=128), lora=LoraSpec(4, 8, 0.1), seed=0
    )
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": ZERO[zero]}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    eng, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    eng.train()
    coord = eng.optimizer.parameter_offload.get_param_coordinator()
    seen, invalidated = {"steps": [], "grads": []}, []
    real = coord._invalidate_trace

    def invalidate():
        invalidated.append(len(seen["steps"]))
        real()

    coord._invalidate_trace = invalidate
    fetch, drift = coord.fetch_sub_module, set()

    def fetch_sub_module(module, forward):  # the count it prefetches by, against the truth, at each fetch
        live = sum(p.ds_numel for p in eng.module.parameters() if p.ds_status.name != "NOT_AVAILABLE")
        drift.add(coord._PartitionedParameterCoordinator__n_available_params - live)
        return fetch(module, forward)

    coord.fetch_sub_module = fetch_sub_module
    rec = RecoveryEngine(eng) if hilore else None
    gpu = GpuStandIn()
    for i, plan in enumerate(plans):
        ids, pos = packed_microbatch(64, 128, n_seqs=2, seed=10 * i + rank)  # each rank its own data
        if rec is None:
            loss = grpo_loss(eng, ids, pos)
            mode = coord.is_complete_trace()
            eng.backward(loss)
        else:
            with rec.step(actions(plan, rec.unit_names)):
                loss = grpo_loss(eng, ids, pos)
                mode = coord.is_complete_trace()
                gpu.backward(eng, loss)
        seen["grads"].append({n: safe_get_full_grad(p) for n, p in eng.module.named_parameters() if p.requires_grad})
        eng.step()
        resident = sum(p.ds_numel for p in eng.module.parameters() if p.ds_status.name == "AVAILABLE")
        counted = coord._PartitionedParameterCoordinator__n_available_params
        seen["steps"].append(
            {"plan": plan, "complete": mode, "counted": counted, "resident": resident, "drift": sorted(drift)}
        )
        drift.clear()
    seen["invalidated_at"] = invalidated
    seen["collectives_per_gather"], seen["syncs_in_backward"] = gpu.per_gather(), gpu.syncs
    gpu.calls.clear()
    if rec is not None:
        rec.detach()
    return seen


def rank_main(rank: int, world: int, port: int, out: str, zero: str, plans) -> None:
    start_deepspeed_rank(rank, world, port, hang_seconds=240)
    seen = {}
    for config in zero.split(","):  # every ZERO configuration on the same two ranks, one start-up
        ref, got = run(rank, False, config, plans), run(rank, True, config, plans)
        bitwise = [
            set(g) == set(r) and all(g[n] is not None and torch.equal(g[n], r[n]) for n in r)
            for g, r in zip(got.pop("grads"), ref.pop("grads"))
        ]
        seen[config] = {"no-gc": ref, "hilore": got, "bitwise": bitwise}
    write_ranks(seen, out, world)


if __name__ == "__main__":
    spawn_two(rank_main, sys.argv[1], sys.argv[2], sys.argv[3].split(",") if len(sys.argv) > 3 else PLANS)
