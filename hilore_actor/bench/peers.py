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


def compiled_loss(model, budget: float = 1.0, fp8: bool = False):
    """A loss function calling ``torch.compile(model)`` under the given partitioner settings.
    The settings are read at compile time, so each configuration gets its own compiled model."""
    import torch._dynamo
    import torch._functorch.config as fconf
    import torch._inductor.config as iconf

    torch._dynamo.reset()
    fconf.activation_memory_budget = budget
    if fp8:
        iconf.post_grad_fusion_options["activation_quantization_aten_pass"] = {
            "allowed_dtypes": "torch.float32;torch.bfloat16", "size_in_mb": 1, "quant_type": "torch.float8_e5m2",
        }
    else:
        iconf.post_grad_fusion_options.pop("activation_quantization_aten_pass", None)
    compiled = torch.compile(model, dynamic=False)
    return lambda _model, mb: microbatch_loss(compiled, mb)
