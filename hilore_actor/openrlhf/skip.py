"""OpenRLHF 0.11.2's ``ppo_train`` without the responses that carry no update signal (``grpo/skip.py``).

Why it is exact. With no KL loss, entropy term or MoE auxiliary loss (``blockers``, which also
name what counts micro-batches), ``training_step`` backpropagates ``PolicyLoss`` alone. Its
per-token loss is proportional to the advantage: ``-min(r A, clip(r) A)`` (``ppo``; dual-clip
``-max(min(...), c A)`` for A < 0; ``gspo`` with one ratio per sequence; an IS correction
multiplies it by a detached coefficient), and ``aggregate_loss`` divides by totals of the whole
optimizer step: its action tokens (token-mean) or its non-empty sequences (seq-mean-token-mean,
and gspo), over every rank, ``/ gas`` against DeepSpeed's ``1 / gas`` and ``x dp_size`` against
the ranks' average. So a sample whose advantages
are 0 on every action token has loss and gradient exactly 0, and leaving it out keeps the step's
gradient as long as the step keeps the totals counted before the skip.

Fixed micro-batches. ``ppo_train`` pairs the DataLoader's collated micro-batches with those totals
through ``iter_grad_accum_global_norm``, a global of ``ppo_actor`` it reads at call time; while
``ppo_train`` runs, ``windows`` stands in for it. Per window of gas micro-batches (one optimizer
step) it takes OpenRLHF's own totals first (``_optimizer_step_loss_norm``), then splits the window
into samples (``split_experience_batch``, ``remove_padding_in_sequences``, as the replay buffer
stores them), keeps those with a non-zero advantage and collates them in order
(``make_experience_batch``) into ``k`` micro-batches, ``k`` the largest ``ceil(kept / micro)`` of
the data-parallel group and at least 1: every rank runs the same number of micro-batches (ZeRO-3
gathers in every forward, ZeRO-2 reduces per micro-step). A rank short of ``k`` runs pad
micro-batches, its shortest skipped sample alone (advantage 0: loss and gradient exactly 0). The
engine's accumulation boundary is set before each micro-batch (``set_gradient_accumulation_boundary``,
the last of the ``k``), so DeepSpeed steps once per window as it would have, and its ``1 / gas``
still meets OpenRLHF's ``/ gas``. A window with nothing kept anywhere runs one pad per rank, so the
zero gradient is materialized and the optimizer moves (AdamW on its momentum) as without the skip.
Where the buffer is not a multiple of gas, OpenRLHF's windows and DeepSpeed's steps part ways
(DeepSpeed counts micro-batches); a window is then cut where DeepSpeed's count puts a boundary and
each part skipped on its own, the window's totals on both.

Dynamic batches (``--train.dynamic_batch_enable``, DeepSpeed's gas 1, the step after each window's
last micro-batch): ``setup_dynamic_batch`` runs as OpenRLHF's, then each window is rebuilt from its
kept samples: ``k`` the largest minimal micro-batch count of the group
(``get_minimum_num_micro_batch_size``) and at least 1, partitions from
``get_seqlen_balanced_partitions``, pads as above, and the window's own token and sample totals
on every micro-batch. Under ZeRO-1 and ZeRO-2 with gas 1, DeepSpeed 0.19.8 replaces the reduced
gradient at every micro-batch (each one is a boundary), so a step trains on its last micro-batch
only; the skip would change what that holds, so there it stays off (``blockers``). ZeRO-3 (and no
ZeRO) accumulate them.

Metrics. A pad micro-batch reports 0 action tokens and 0 samples (``training_step.py``), so
``ppo_train``'s weighted means cover the trained responses (not where no rank kept anything, which
would divide by 0); each ``fit`` adds ``hilore_zero_adv_share`` and ``hilore_zero_adv_token_share``
(the share of its samples and action tokens with advantage 0), ``hilore_pad_microbatches`` (pad
micro-batches, all ranks and epochs) and ``hilore_zero_adv_skip`` (1).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import astuple, dataclass

import torch
import torch.distributed as dist

from ..grpo.skip import FLAG, skip_active
from .patching import shadowed


def _arg(args, dotted: str, default=None):
    """``args.a.b.c`` (OpenRLHF's nested namespace), ``default`` where a part is missing or None."""
    for part in dotted.split("."):
        args = getattr(args, part, None)
        if args is None:
            return default
    return args


def _loss_terms(args) -> list[str]:
    """Terms of OpenRLHF 0.11.2's ``training_step`` loss that reach a zero-advantage sample's log-probs."""
    out = []
    coef = float(_arg(args, "algo.kl.init_coef", 0.0))
    if _arg(args, "algo.kl.use_loss", False) and coef > 0:
        out.append(f"--algo.kl.use_loss adds a KL term (--algo.kl.init_coef {coef})")
    entropy = _arg(args, "actor.entropy_coef")
    if entropy is not None and float(entropy) != 0:
        out.append(f"--actor.entropy_coef {entropy} adds an entropy term")
    aux = float(_arg(args, "actor.aux_loss_coef", 0.0))
    if aux > 1e-8:
        out.append(f"--actor.aux_loss_coef {aux} adds the MoE balancing loss")
    return out


def _counts_micro_batches(args) -> list[str]:
    """What makes the update depend on how many micro-batches run, or which samples share one."""
    out, dynamic = [], _arg(args, "train.dynamic_batch_enable", False)
    if _arg(args, "train.enable_ema", False) and not dynamic:  # (dynamic batches: EMA at each optimizer step)
        out.append(
            "--train.enable_ema moves the EMA model every gas micro-batches as they run, and the skip runs fewer"
        )
    stage = int(_arg(args, "ds.zero_stage", 2))
    if dynamic and stage in (1, 2):
        out.append(
            f"--train.dynamic_batch_enable under --ds.zero_stage {stage}: DeepSpeed (gas 1) keeps only the gradient "
            "of each step's last micro-batch, and the skip changes what that micro-batch holds"
        )
    return out


def blockers(args) -> list[str]:
    """What in OpenRLHF 0.11.2's training under the recipe ``args`` makes leaving out a sample with
    advantage 0 change the update, each naming its flag."""
    return _loss_terms(args) + _counts_micro_batches(args)


def resolve(setting: str, args) -> bool:
    """``--hilore.skip_zero_advantage`` for the recipe ``args``: ``off`` never, ``auto`` exactly
    when nothing blocks, ``on`` likewise or ``ValueError`` with one line."""
    terms, other = _loss_terms(args), _counts_micro_batches(args)
    if setting == "on" and other and not terms:
        raise ValueError(
            f"{FLAG} on: {other[0]}, so skipping would change the update; use auto (skips exactly when that is "
            "exact) or off"
        )
    return skip_active(setting, terms + other)


def zero_advantage(sample) -> bool:
    """Whether a single-sample ``Experience`` has advantage exactly 0 on every action token."""
    adv, mask = sample.advantages, sample.action_mask
    if adv is None:
        return False
    off = ~mask.bool() if mask is not None else torch.zeros_like(adv, dtype=torch.bool)
    return bool(((adv == 0) | off).all())


def _tokens(sample) -> int:
    return int(sample.action_mask.sum()) if sample.action_mask is not None else 0


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _device():
    return torch.cuda.current_device() if torch.cuda.is_available() else "cpu"


def group_max(values: Sequence[int], group) -> list[int]:
    """The element-wise maximum of ``values`` over the data-parallel group."""
    if not _dist() or not values:
        return list(values)
    t = torch.tensor(list(values), dtype=torch.int64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [int(v) for v in t.tolist()]


def _shortest(skipped: Sequence, key):
    """The pad: the shortest skipped sample. A rank short of micro-batches always has one, unless
    the ranks' windows differ in size (as OpenRLHF itself assumes they do not)."""
    if not skipped:
        raise RuntimeError(
            "zero-advantage skip: this rank has fewer samples in an optimizer step than another rank's kept "
            "ones need micro-batches; the ranks' replay buffers differ in size"
        )
    return min(skipped, key=key)


def _groups(data_iter, gas: int) -> Iterator[list]:
    """``data_iter`` in windows of ``gas`` items, the last one shorter (``iter_grad_accum_global_norm``'s)."""
    window = []
    for item in data_iter:
        window.append(item)
        if len(window) == gas:
            yield window
            window = []
    if window:
        yield window


def split(window: Sequence) -> list:
    """The single samples of collated micro-batches, as the replay buffer holds them."""
    from openrlhf.trainer.ppo_utils.experience import remove_padding_in_sequences, split_experience_batch

    out = []
    for item in window:
        index = item.index  # split_experience_batch clears it
        out += remove_padding_in_sequences(split_experience_batch(item))
        item.index = index
    return out


@dataclass
class Counts:
    samples: int = 0
    zero_samples: int = 0
    tokens: int = 0
    zero_tokens: int = 0
    pads: int = 0

    def add(self, samples: Sequence, zero: Sequence[bool]) -> None:
        self.samples += len(samples)
        self.zero_samples += sum(zero)
        tokens = [_tokens(s) for s in samples]
        self.tokens += sum(tokens)
        self.zero_tokens += sum(t for t, z in zip(tokens, zero) if z)


class ZeroAdvantageSkip:
    """The skip on one ``ActorPPOTrainer`` (module docstring); ``install`` shadows its ``ppo_train``."""

    def __init__(self, trainer):
        self.trainer = trainer
        engine = getattr(trainer.actor, "model", None)
        self.engine = engine if hasattr(engine, "set_gradient_accumulation_boundary") else None
        # micro-batches OpenRLHF would have run so far: where DeepSpeed's own count puts a boundary
        self.micro_steps = int(getattr(engine, "micro_steps", 0) or 0)
        self.flags: dict[int, tuple[bool, bool]] = {}  # ppo_train's step -> (pad, anything kept in its window)
        self.counts = Counts()

    def install(self) -> ZeroAdvantageSkip:
        from openrlhf.trainer.ray import ppo_actor

        trainer = self.trainer
        inner = trainer.ppo_train

        def ppo_train(kl_ctl):
            self.counts = Counts()
            with (
                shadowed(ppo_actor, iter_grad_accum_global_norm=self.windows),
                shadowed(trainer.replay_buffer, setup_dynamic_batch=self.setup_dynamic_batch),
            ):
                status = inner(kl_ctl)
            return dict(status or {}, **self.metrics(trainer.strategy))

        trainer.ppo_train = ppo_train
        return self

    def step_flags(self, step: int) -> tuple[bool, bool]:
        """(pad, anything kept anywhere in its window) of ``ppo_train``'s micro-batch ``step``."""
        return self.flags.get(step, (False, True))

    # fixed micro-batches
    def windows(self, data_iter, strategy, accumulated_gradient, mask_fn) -> Iterator:
        """``iter_grad_accum_global_norm`` with the skip: ``(micro-batch, loss_batch_info)``."""
        from openrlhf.utils.loss_utils import _get_dp_group

        group = _get_dp_group(strategy)
        dp_size = dist.get_world_size(group=group) if _dist() else 1
        gas = max(int(accumulated_gradient), 1)
        self.flags, step = {}, 0
        try:
            for window in _groups(data_iter, gas):
                for out, info, boundary, pad, kept in self.window(window, gas, group, dp_size, mask_fn):
                    if self.engine is not None:
                        self.engine.set_gradient_accumulation_boundary(boundary)
                    self.flags[step], step = (pad, kept), step + 1
                    yield out, info
        finally:
            if self.engine is not None:
                self.engine.set_gradient_accumulation_boundary(None)

    def window(self, window: list, gas: int, group, dp_size: int, mask_fn) -> Iterator:
        """One window's micro-batches: ``(micro-batch, loss_batch_info, boundary, pad, anything kept
        anywhere)`` each. A window is one optimizer step unless the buffer is not a multiple of gas:
        then it is cut where DeepSpeed's own count of micro-batches puts a boundary, and each part
        is skipped on its own (every part has the window's totals, as OpenRLHF gives them)."""
        from openrlhf.utils.loss_utils import _optimizer_step_loss_norm

        info = _optimizer_step_loss_norm([mask_fn(it) for it in window], group, dp_size, gas)  # before the skip
        first, self.micro_steps = self.micro_steps, self.micro_steps + len(window)
        part = []
        for i, item in enumerate(window):
            part.append(item)
            ends_step = (first + i + 1) % gas == 0
            if ends_step or i == len(window) - 1:
                for out, boundary, pad, kept in self.part(part, ends_step, group):
                    yield out, info, boundary, pad, kept
                part = []

    def part(self, items: list, ends_step: bool, group) -> Iterator:
        """``items`` without their zero-advantage samples, in as many micro-batches as the group's
        largest need (at least 1): ``(micro-batch, boundary, pad, anything kept anywhere)`` each."""
        from openrlhf.trainer.ppo_utils.experience import make_experience_batch

        samples = split(items)
        zero = [zero_advantage(s) for s in samples]
        self.counts.add(samples, zero)
        kept = [s for s, z in zip(samples, zero) if not z]
        micro = max(1, int(self.trainer.replay_buffer.sample_batch_size))
        real = -(-len(kept) // micro)
        most = group_max([real], group)[0]
        k = max(1, most)
        if not any(zero) and k == len(items):
            batches, real = list(items), len(items)  # nothing left out here: OpenRLHF's own micro-batches
        else:
            packing = getattr(self.trainer.replay_buffer, "packing_samples", False)
            batches = [make_experience_batch(kept[i : i + micro], packing) for i in range(0, len(kept), micro)]
            if real < k:  # the shortest skipped sample, alone
                pad = _shortest([s for s, z in zip(samples, zero) if z], lambda s: s.sequences.numel())
                batches += [make_experience_batch([pad], packing) for _ in range(k - real)]
            if getattr(self.trainer, "dataloader_pin_memory", False) and torch.cuda.is_available():
                batches = [b.pin_memory() for b in batches]  # as the DataLoader's
        self.counts.pads += k - real
        for j, b in enumerate(batches):
            yield b, ends_step and j == k - 1, j >= real, most > 0

    # dynamic batches
    def setup_dynamic_batch(self, strategy) -> None:
        """OpenRLHF's ``NaiveReplayBuffer.setup_dynamic_batch``, then each optimizer step's
        micro-batches rebuilt from its kept samples (module docstring)."""
        from openrlhf.utils.loss_utils import _get_dp_group
        from openrlhf.utils.seqlen_balancing import get_minimum_num_micro_batch_size, get_seqlen_balanced_partitions

        buf, args = self.trainer.replay_buffer, strategy.args
        type(buf).setup_dynamic_batch(buf, strategy)
        windows, start = [], 0
        for i, last in enumerate(buf.dynamic_optimizer_step):
            if last:
                windows.append(range(start, i + 1))
                start = i + 1
        sized, needs, counts = [], [], Counts()
        for w in windows:
            idx = [j for m in w for j in buf.dynamic_indices[m]]
            zero = [zero_advantage(buf.items[j]) for j in idx]
            counts.add([buf.items[j] for j in idx], zero)
            kept = [j for j, z in zip(idx, zero) if not z]
            lengths = [int(buf.items[j].total_length.item()) for j in kept]
            limits = (args.train.max_tokens_per_gpu, args.ds.ring_attn_size, args.ds.tensor_parallel_size)
            needs.append(get_minimum_num_micro_batch_size(lengths, *limits) if kept else 0)
            sized.append((w, kept, [j for j, z in zip(idx, zero) if z], lengths))
        lists = {"indices": [], "scale": [], "tokens": [], "samples": [], "step": []}
        self.flags = {}
        for (w, kept, skipped, lengths), most in zip(sized, group_max(needs, _get_dp_group(strategy))):
            k = max(1, most)
            real = min(k, len(kept))
            parts = get_seqlen_balanced_partitions(lengths, real, equal_size=False) if real else []
            parts = [[kept[i] for i in p] for p in parts]
            if real < k:
                pad = _shortest(skipped, lambda j: int(buf.items[j].total_length.item()))
                parts += [[pad] for _ in range(k - real)]
            n = sum(len(p) for p in parts)
            for j, p in enumerate(parts):
                self.flags[len(lists["indices"])] = (j >= real, most > 0)
                lists["indices"].append(p)
                lists["scale"].append(len(p) / n)
            lists["tokens"] += [buf.dynamic_batch_num_tokens[w[0]]] * k  # the window's totals, before the skip
            lists["samples"] += [buf.dynamic_global_batch_size[w[0]]] * k
            lists["step"] += [0] * (k - 1) + [1]
            counts.pads += k - real
        buf.dynamic_indices = lists["indices"]
        buf.dynamic_sample_loss_scale = lists["scale"]
        buf.dynamic_batch_num_tokens = lists["tokens"]
        buf.dynamic_global_batch_size = lists["samples"]
        buf.dynamic_optimizer_step = lists["step"]
        epochs = max(1, int(getattr(self.trainer, "max_epochs", 1) or 1))
        self.counts = Counts(*(v * epochs for v in astuple(counts)))

    def metrics(self, strategy) -> dict[str, float]:
        """This ``ppo_train``'s shares with advantage 0 and its pad micro-batches, over the group."""
        from openrlhf.utils.loss_utils import _get_dp_group

        t = torch.tensor(astuple(self.counts), dtype=torch.float64, device=_device())
        if _dist():
            dist.all_reduce(t, group=_get_dp_group(strategy))
        samples, zero_samples, tokens, zero_tokens, pads = t.tolist()
        return {
            "hilore_zero_adv_share": zero_samples / max(1.0, samples),
            "hilore_zero_adv_token_share": zero_tokens / max(1.0, tokens),
            "hilore_pad_microbatches": pads,
            "hilore_zero_adv_skip": 1.0,
        }
