"""Two gloo ranks through OpenRLHF 0.11.2's real trainer with the zero-advantage skip off and on,
for ``test_openrlhf_zero3.py``.

Per rank and per (batching, setting): this package's ``HiLoRePolicyModelActor`` (its plain class,
in this process) runs the real ``init_model_from_pretrained`` under the ZeRO stage given (no KL
loss, float32: ``cpu_stand_ins``) and three real ``fit`` calls (``ppo_train`` over the replay
buffer: four samples per rank, two per micro-batch, one optimizer step per ``fit``) on the same
weights and experiences, with advantages set to 0 for

1. half of each rank's samples,
2. all of rank 0's (rank 0 then runs only pad micro-batches),
3. every sample (one pad per rank; AdamW moves on its momentum).

Under dynamic batching (``--train.dynamic_batch_enable``; ZeRO-3, where DeepSpeed accumulates the
micro-batches of a step: under ZeRO-1/2 the skip stays off) OpenRLHF's CLI turns sample packing
on, which needs flash-attn's unpadding (GPU-only): here the batches stay padded (sdpa), the one
departure from the recipe OpenRLHF validated.

It records the whole gradient as each optimizer step begins (``safe_get_full_grad``), the weights
before the first and after each ``fit`` (``safe_get_full_fp32_param``; both collectives), the
micro-batches each ``fit`` ran (backward calls), the ``fit``'s status and its kept samples'
response tokens; rank 0 writes the relative differences of the settings' gradients and weights
against the first setting's, per rank. ``openrlhf_ranks.py`` runs it as the case
``skip:STAGE:SETTINGS:BATCHINGS`` (SETTINGS e.g. ``off,on``; BATCHINGS ``fixed`` and/or ``dynamic``,
comma-separated).
"""

import json
import os

import torch

from openrlhf_zero3_ranks import SAMPLES, VOCAB, A, P, _with_info, cpu_stand_ins, recipe

ZEROS = [  # per fit, per rank: the samples whose advantage is 0
    {0: [0, 3], 1: [1, 2]},
    {0: [0, 1, 2, 3], 1: []},
    {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]},
]
MAX_TOKENS = 64  # --train.max_tokens_per_gpu under dynamic batching: samples hold 16 to 32 tokens
STATUS = (
    "hilore_zero_adv_share",
    "hilore_zero_adv_token_share",
    "hilore_pad_microbatches",
    "hilore_zero_adv_skip",
    "response_length",
)


def experiences(rank: int):
    from hilore_actor.openrlhf.verify import experience

    out = []
    for i, zeros in enumerate(ZEROS):
        exp = experience(100 * rank + i, SAMPLES, P, A, VOCAB)  # each rank its own data
        exp.advantages[zeros[rank]] = 0.0
        exp.total_length = exp.attention_mask.sum(-1)  # what dynamic batching sizes by
        out.append(_with_info(exp))
    return out


def skip_runs(rank, model_dir, stage: int, settings: str, batchings: str):
    """Each (batching, setting) on this rank, compared with the first setting (module docstring)."""
    import openrlhf.cli.train_ppo_ray as cli
    from openrlhf.utils import get_strategy
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    from hilore_actor.learner.coordinator import BudgetCoordinator
    from hilore_actor.openrlhf import policy_actor as pa
    from hilore_actor.openrlhf.train_ppo_ray import run_cli_main

    cpu_stand_ins(pa, fp32=True)
    coordinator = BudgetCoordinator()
    pa._HiLoRePolicyModelActor._coordinator = staticmethod(lambda: coordinator)
    seen = {}
    for batching in batchings.split(","):
        flags = recipe(model_dir, stage=stage, kl=False)
        if batching == "dynamic":
            flags += ["--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", str(MAX_TOKENS)]
            flags += ["--vllm.num_engines", "1"]  # packing's requirement (no engine starts: no Ray here)
        parsed = {}
        run_cli_main(cli, flags, train=lambda a, parsed=parsed: parsed.setdefault("args", a))
        args = parsed["args"]
        if batching == "dynamic":  # OpenRLHF turned packing on (flash-attn's GPU-only unpadding): padded batches here
            args.ds.packing_samples, args.ds.attn_implementation = False, "sdpa"
        for setting in settings.split(","):
            hilore = {
                "mode": "hilore-hr",
                "budget": "1.25",
                "profile_repeats": 1,
                "loo": False,
                "skip_zero_advantage": setting,
            }
            os.environ[pa.CONFIG_ENV] = json.dumps(hilore)
            args.actor.gradient_checkpointing_enable = True  # the drop-in turns it off itself
            # no ZeRO-3 config of an earlier case still alive: transformers would partition this load
            assert not is_deepspeed_zero3_enabled()
            actor = pa._HiLoRePolicyModelActor.__new__(pa._HiLoRePolicyModelActor)
            torch.manual_seed(0)
            actor.init_model_from_pretrained(get_strategy(args), model_dir, max_steps=8)
            seen[f"{batching}-{setting}"] = fits(actor, experiences(rank))
            del actor
    first = {b: f"{b}-{settings.split(',')[0]}" for b in batchings.split(",")}
    for name, run in seen.items():
        ref = seen[first[name.split("-")[0]]]
        run["grad_rel_err"] = [rel(g, r) for g, r in zip(run["grads"], ref["grads"])]
        run["weight_rel_err"] = [rel(w, r) for w, r in zip(run["weights"], ref["weights"])]
        run["grad_norm"] = [float(g.norm()) for g in run["grads"]]
        run["moved"] = [float((b - a).norm()) for a, b in zip(run["weights"], run["weights"][1:])]
    for run in seen.values():
        del run["grads"], run["weights"]
    return seen


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm()) if b.norm() > 0 else float((a - b).norm())


def fits(actor, exps):
    """One ``fit`` per experience: the gradient as each optimizer step begins, the weights
    before the first and after every ``fit``, micro-batches per ``fit``, the statuses."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    from hilore_actor.openrlhf.patching import shadowed

    strategy, grads, weights, micro, status, reset, trained = actor.strategy, [], [], [], [], [], []
    engine = actor.actor.model
    params = [p for p in engine.module.parameters() if p.requires_grad]
    real_step, real_backward = strategy.optimizer_step, strategy.backward
    ran = []

    def optimizer_step(*a, **k):
        if engine.is_gradient_accumulation_boundary():
            grads.append(torch.cat([safe_get_full_grad(p).float().flatten() for p in params]))
        return real_step(*a, **k)

    def backward(*a, **k):
        ran.append(1)
        return real_backward(*a, **k)

    def weights_now():
        return torch.cat([safe_get_full_fp32_param(p).float().flatten() for p in params])

    weights.append(weights_now())
    for i, exp in enumerate(exps):
        actor.trainer.replay_buffer.clear()
        actor.trainer.replay_buffer.append(exp)
        torch.manual_seed(1 + i)  # ppo_train's shuffle
        ran.clear()
        with shadowed(strategy, optimizer_step=optimizer_step, backward=backward):
            s = actor.fit(0.01)
        micro.append(len(ran))
        kept = exp.action_mask[(exp.advantages != 0).any(-1)].sum(-1).float()
        trained.append([float(kept.sum()), len(kept)])  # response tokens and count of the kept samples
        status.append({k: s[k] for k in STATUS if k in s})
        reset.append(engine._is_gradient_accumulation_boundary is None)
        weights.append(weights_now())
    skip = actor.hilore.skip is not None
    return {
        "grads": grads,
        "weights": weights,
        "n_steps": len(grads),
        "micro": micro,
        "status": status,
        "reset": reset,
        "skip": skip,
        "trained": trained,
    }
