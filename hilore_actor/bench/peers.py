"""Peer methods the benchmark runs beside ours, on the same microbatches.

- ``sac``: torch's selective activation checkpointing per decoder layer with the op-level
  policy that saves matmul and attention outputs and recomputes the rest (through HF's
  checkpointing hook, so it wraps the same layers gc does).
- ``compile-budget``: ``torch.compile`` with ``torch._functorch.config.activation_memory_budget``
  at the largest of a few values whose measured peak fits the budget.
- ``compile-fp8``: ``torch.compile`` with inductor's activation-quantization pass (fp8 e5m2).
Each returns a callable that runs one microbatch (loss + backward) and a teardown, or raises
``PeerUnavailable`` with the reason when it cannot run here.
"""
from __future__ import annotations

from functools import partial

import torch

from ..grpo.microbatch import microbatch_loss


class PeerUnavailable(RuntimeError):
    pass


def _sac_policy():
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    save = {aten.mm.default, aten.addmm.default, aten.bmm.default}
    for name in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"):
        if hasattr(aten, name):
            save.add(getattr(aten, name).default)

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def enable_sac(model) -> None:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    kwargs = {"use_reentrant": False, "context_fn": partial(create_selective_checkpoint_contexts, _sac_policy())}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def compiled_runner(runner, budget: float = 1.0, fp8: bool = False):
    """A ``Runner`` over a private copy of the model, compiled under its own partitioner
    settings. Dynamo's cache keys on neither these settings nor the module copy, so building one
    resets it: only one compiled peer may be live at a time (the benchmark measures each in an
    isolated phase, interleaved with gc). Every call runs inside the settings."""
    import contextlib
    import copy

    import torch._dynamo
    import torch._functorch.config as fconf
    import torch._inductor.config as iconf

    from ..allocation.runner import Runner

    fusion = dict(iconf.post_grad_fusion_options)
    if fp8:
        fusion["activation_quantization_aten_pass"] = {
            "allowed_dtypes": "torch.float32;torch.bfloat16", "size_in_mb": 1, "quant_type": "torch.float8_e5m2",
        }
    torch._dynamo.reset()  # compiled graphs do not key on these settings: start clean
    model = copy.deepcopy(runner.model)
    compiled = torch.compile(model, dynamic=False)

    def loss(_model, mb):
        with contextlib.ExitStack() as stack:
            stack.enter_context(fconf.patch(activation_memory_budget=budget))
            stack.enter_context(iconf.patch(post_grad_fusion_options=fusion))
            return microbatch_loss(compiled, mb)

    return Runner(model, loss_fn=loss)
