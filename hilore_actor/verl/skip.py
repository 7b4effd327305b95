"""verl's mini-batch without the responses that carry no update signal (``grpo/skip.py``).

verl's ``ppo_loss`` divides by the whole mini-batch's counts: ``batch_num_tokens`` (the loss
mask summed over the data-parallel group, token-mean), the trainer's ``global_batch_size``
(the seq-mean modes) and ``dp_size``; FSDP averages the ranks' gradients. So leaving a response
with advantage 0 out of a rank's mini-batch keeps the gradient when the loss keeps the count
taken before the skip (``skip_batch`` returns it for the loss; verl recounts from the data it is given).

Every rank must still run the same number of micro-batches (FSDP gathers per forward and
reduces after the last backward), so each rank tops its kept responses up with pads, its
shortest skipped ones with their loss mask zeroed (advantage 0: loss and gradient exactly 0),
to a count for which verl's own micro-batching gives every rank the same number:
fixed micro-batches: ``k x micro`` with ``k = max over ranks of ceil(kept / micro)``;
dynamic batch size: ``m`` = the largest over the ranks of the micro-batch count verl's
``rearrange_micro_batches`` settles on for the rank's kept responses alone (its lower bound
``min(kept, ceil(kept tokens / max_token_len))``, raised until its balanced partition fits
``max_token_len``), every rank holding at least ``m`` responses: verl's own search over the group
then stops at ``m`` or before, within the smallest rank's count (``micro_batch_count``). With nothing kept
anywhere each rank runs one micro-batch of pads, so every gradient is materialized as zeros
and the optimizer steps as it would have.

Under Ulysses every rank of a sequence-parallel group holds the same responses and keeps the
same ones. Advantages exactly 0 come from groups of equal 0/1 rewards; verl's ``grpo``
estimator leaves rounding residue (about 1e-8) on groups of other equal rewards, which are then
trained as before.
"""

from __future__ import annotations

from functools import partial
from typing import Dict, List, Tuple

from ..grpo.skip import skip_active

EXACT_POLICY_LOSSES = ("vanilla", "gspo")


def _get(cfg, key: str, default=None):
    """A key of verl's actor config, as a composed OmegaConf node or the worker's dataclass."""
    value = getattr(cfg, key, default) if not hasattr(cfg, "get") else cfg.get(key, default)
    return default if value is None else value


def blockers(actor, distillation: bool = False) -> List[str]:
    """The terms of verl's ``ppo_loss`` under ``actor`` (``actor_rollout_ref.actor``) that give
    a response with advantage 0 a gradient, or make its denominator depend on the micro-batch."""
    out = []
    key = "actor_rollout_ref.actor."
    if _get(actor, "use_kl_loss", False) and float(_get(actor, "kl_loss_coef", 0.0)) != 0:
        out.append(f"{key}use_kl_loss=true adds a KL term ({key}kl_loss_coef={_get(actor, 'kl_loss_coef')})")
    if float(_get(actor, "entropy_coeff", 0.0)) != 0:
        out.append(f"{key}entropy_coeff={_get(actor, 'entropy_coeff')} adds an entropy term")
    mode = str(_get(_get(actor, "policy_loss", {}), "loss_mode", "vanilla"))
    if mode not in EXACT_POLICY_LOSSES:
        out.append(f"{key}policy_loss.loss_mode={mode} is not one of {', '.join(EXACT_POLICY_LOSSES)}")
    if (
        _get(actor, "loss_agg_mode", "token-mean") == "seq-mean-token-sum-norm"
        and _get(actor, "loss_scale_factor") is None
    ):
        out.append(
            f"{key}loss_agg_mode=seq-mean-token-sum-norm without {key}loss_scale_factor divides by each "
            "micro-batch's padded width"
        )
    if distillation:
        out.append("distillation.enabled=true adds the teacher's loss")
    return out


def resolve(setting: str, loss_function) -> bool:
    """The setting for the worker's loss: skip only under verl's own ``ppo_loss``, whose config
    the worker binds (``partial(ppo_loss, config=...)``); ``ValueError`` for ``on`` where the
    skip is not exact."""
    from verl.workers.utils.losses import ppo_loss

    if isinstance(loss_function, partial) and loss_function.func is ppo_loss:
        found = blockers(loss_function.keywords["config"])
    else:
        found = [f"the actor's loss is {getattr(loss_function, '__name__', loss_function)!r}, not verl's ppo_loss"]
    return skip_active(setting, found)


def _zero_from(t, start: int) -> None:
    """Zero samples ``start:`` of a (nested or padded) per-sample tensor, in place."""
    if t.is_nested:
        t.values()[int(t.offsets()[start]) :].zero_()
    else:
        t[start:].zero_()


def micro_batch_count(lengths: List[int], limit: int) -> int:
    """The micro-batch count verl 0.9.1's ``rearrange_micro_batches`` takes for sequences of
    ``lengths`` on one rank: ``min(n, ceil(tokens / limit))``, raised until the balanced
    partition (by verl's workloads) puts at most ``limit`` tokens in each; at most n (one each)."""
    if not lengths:
        return 0
    import torch
    from verl.utils.seqlen_balancing import calculate_workload, get_seqlen_balanced_partitions

    work = calculate_workload(torch.tensor(lengths)).tolist()
    count = min(len(lengths), -(-sum(lengths) // limit))
    while count < len(lengths):
        parts = get_seqlen_balanced_partitions(work, count, equal_size=False)
        if all(sum(lengths[j] for j in part) <= limit for part in parts):
            break
        count += 1
    return count


def skip_batch(data, group, device, sp_size: int = 1) -> Tuple[object, Dict, Dict]:
    """(``data`` with its kept responses then its pads, the loss's counts of the whole
    mini-batch, metrics); collectives over ``group`` (verl's data-parallel group)."""
    import torch
    from verl.utils import tensordict_utils as tu

    adv, mask = data["advantages"], data["loss_mask"]  # on the CPU: verl moves each micro-batch
    if adv.is_nested or mask.is_nested:
        pairs = list(zip(adv.unbind(), mask.unbind()))
        signal = [bool(((a != 0) & (m != 0)).any()) for a, m in pairs]
        tokens = [int(m.sum()) for _, m in pairs]
    else:
        signal = ((adv != 0) & (mask != 0)).any(-1).tolist()
        tokens = mask.sum(-1).tolist()
    seq_lens = data["input_ids"].offsets().diff().tolist()
    kept = [i for i, s in enumerate(signal) if s]
    kept_set = set(kept)
    skipped = sorted((i for i in range(len(signal)) if i not in kept_set), key=lambda i: (seq_lens[i], i))
    dynamic = bool(tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True))
    if dynamic:
        need = micro_batch_count([seq_lens[i] for i in kept], int(data["max_token_len_per_gpu"]) * sp_size)
    else:
        micro = int(data["micro_batch_size_per_gpu"])
        need = -(-len(kept) // micro)
    need_t = torch.tensor([need], dtype=torch.int64, device=device)
    distributed = torch.distributed.is_initialized()
    if distributed:
        torch.distributed.all_reduce(need_t, op=torch.distributed.ReduceOp.MAX, group=group)
    need = max(1, int(need_t))
    target = max(len(kept), need) if dynamic else need * micro
    pads = skipped[: target - len(kept)]
    counts = torch.tensor(
        [sum(tokens), sum(tokens[i] for i in kept), len(signal), len(kept), len(pads)], dtype=torch.int64, device=device
    )
    if distributed:
        torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.SUM, group=group)
    total, kept_tokens, samples, kept_samples, pad_samples = counts.tolist()
    # a rank that skips nothing needs no pads either (every rank holds as many responses)
    out = data if len(kept) == len(signal) else tu.index_select_tensor_dict(data, kept + pads)
    if pads:
        for key in {"loss_mask", "response_mask"} & set(out.keys()):
            _zero_from(out[key], len(kept))
    metrics = {
        "zero_adv_share": 1 - kept_samples / max(1, samples),
        "zero_adv_token_share": 1 - kept_tokens / max(1, total),
        "pad_samples": pad_samples,
    }
    return out, {"batch_num_tokens": total}, metrics
