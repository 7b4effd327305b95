"""Peer methods the benchmark runs beside ours, on the same microbatches and the same head.

- ``sac``: torch's selective activation checkpointing on every decoder layer with the op
  policy that saves matmul and attention outputs and recomputes the rest (through HF's
  checkpointing hook, so it wraps the same layers gc does). Unbudgeted: a reference row.
- ``sac-budget``: that policy on every k-th decoder layer and plain checkpointing on the
  others (torchtitan's selective *layer* checkpointing), k the smallest whose measured peak on
  every development microbatch fits the budget (more SAC layers only remove recompute).
- ``compile-budget``: ``torch.compile`` with ``torch._functorch.config.activation_memory_budget``
  searched in [0, 1] (a grid from the top, then bisection) for the largest value whose peak
  fits (measured after a warm-up call, never on the compiling call).
- ``compile-fp8``: ``torch.compile`` with inductor's activation-quantization pass (fp8 e5m2).

Compiled peers honour the runner's loss function, so the head: with the chunked head only the
decoder is compiled and the chunked head runs eagerly on its output, as it does for HiLoRe.
Anything that cannot run here raises ``PeerUnavailable`` with the reason.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch


class PeerUnavailable(RuntimeError):
    pass


def _sac_policy():
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    save = {aten.mm.default, aten.addmm.default, aten.bmm.default}
    for name in (
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    ):
        if hasattr(aten, name):
            save.add(getattr(aten, name).default)

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def decoder_layers(model) -> List[torch.nn.Module]:
    return list(model.get_decoder().layers)


def enable_sac(model, layers: Optional[Sequence[int]] = None) -> None:
    """SAC on ``layers`` (all when None), plain (non-reentrant) checkpointing on the rest."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    from hilore_actor.recovery import apply_baseline

    apply_baseline(model, "gc")
    sac = partial(
        checkpoint, use_reentrant=False, context_fn=partial(create_selective_checkpoint_contexts, _sac_policy())
    )
    chosen = set(range(len(decoder_layers(model)))) if layers is None else set(layers)
    for i, layer in enumerate(decoder_layers(model)):
        if i in chosen:
            layer._gradient_checkpointing_func = sac


def every_kth(n_layers: int, k: int) -> List[int]:
    return list(range(0, n_layers, k))


def tune_sac_layers(measure: Callable[[List[int]], int], n_layers: int, room: int, log) -> Tuple[List[int], Dict]:
    """The SAC layer set (every k-th layer, smallest k) whose measured in-microbatch peak
    ``measure(layers)`` fits ``room``; plain gc (no SAC layer) when none does. The peak grows
    about linearly with the SAC layer count, so k is predicted from the all-SAC and no-SAC
    peaks and then verified, moving to the next k while it does not fit."""
    tried: Dict[str, int] = {}
    p0, pn = measure([]), measure(every_kth(n_layers, 1))
    tried["0"], tried[f"k=1 ({n_layers} layers)"] = p0, pn
    if pn <= room:
        return every_kth(n_layers, 1), tried
    if p0 > room:
        raise PeerUnavailable(f"even plain checkpointing peaks at {p0} B, over the room of {room} B")
    per_layer = max((pn - p0) / n_layers, 1.0)
    count = int((room - p0) // per_layer)
    if count < 1:
        return [], tried

    def fits(k: int) -> bool:
        layers = every_kth(n_layers, k)
        tried[f"k={k} ({len(layers)} layers)"] = peak = measure(layers)
        log(f"[bench] sac-budget every {k}-th layer ({len(layers)}): peak {peak} B, room {room} B")
        return peak <= room

    k = max(2, -(-n_layers // count))
    while k <= n_layers and not fits(k):
        k += 1
    if k > n_layers:
        return [], tried
    while k > 2 and len(every_kth(n_layers, k - 1)) > len(every_kth(n_layers, k)) and fits(k - 1):
        k -= 1  # the prediction was conservative: more SAC layers still fit
    return every_kth(n_layers, k), tried


class _DecoderOnly:
    """What the chunked head needs of a model (``models/chunked_head.py``), with a compiled decoder.
    ``chunked_token_log_probs`` first asks ``head_is_linear`` of it, which it cannot check (no
    config, not callable): the answer comes from the eager model's check, kept per head module,
    which this shares (``compiled_runner`` checks first)."""

    def __init__(self, model, decoder):
        self._model, self._decoder = model, decoder

    def get_decoder(self):
        return self._decoder

    def get_output_embeddings(self):
        return self._model.get_output_embeddings()


def compiled_runner(runner, budget: float = 1.0, fp8: bool = False, head: str = "full"):
    """A ``Runner`` over a private copy of the model, compiled under its own partitioner
    settings, calling ``runner``'s loss function (so its head). Dynamo's cache keys on neither
    these settings nor the module copy, so building one resets it: only one compiled peer may
    be live at a time (the benchmark measures each in an isolated phase, interleaved with gc)."""
    import contextlib

    import torch._dynamo
    import torch._functorch.config as fconf
    import torch._inductor.config as iconf

    from hilore_actor.allocation.runner import Runner
    from hilore_actor.models.chunked_head import head_is_linear

    fusion = dict(iconf.post_grad_fusion_options)
    if fp8:
        fusion["activation_quantization_aten_pass"] = {
            "allowed_dtypes": "torch.float32;torch.bfloat16",
            "size_in_mb": 1,
            "quant_type": "torch.float8_e5m2",
        }
    torch._dynamo.reset()  # compiled graphs do not key on these settings: start clean
    # the peer compiles the model alone: no hooks of HiLoRe's engine traced into its graph
    model = runner.engine.unhooked_copy()
    if head == "chunked" and head_is_linear(model):  # the answer is kept per head module, which _DecoderOnly shares
        target = _DecoderOnly(model, torch.compile(model.get_decoder(), dynamic=False))
    else:
        target = torch.compile(model, dynamic=False)
    inner = runner.loss_fn

    def loss(_model, mb):
        with contextlib.ExitStack() as stack:
            stack.enter_context(fconf.patch(activation_memory_budget=budget))
            stack.enter_context(iconf.patch(post_grad_fusion_options=fusion))
            return inner(target, mb)

    r = Runner(model, loss_fn=loss)
    r.engine.detach()  # runs "as-is" only: the engine Runner attaches would be traced into the graph
    return r


def compiled_peak(runner, budget: float, head: str, dev) -> Tuple[object, int]:
    """(compiled runner, its in-microbatch peak over ``dev``), measured after a warm-up call."""
    r = compiled_runner(runner, budget, head=head)
    r.run(dev[0], "as-is")  # compiles; never measured
    return r, max(r.run(mb, "as-is", measure_peak=True).peak_bytes for mb in dev)


def tune_compile_budget(
    runner,
    head: str,
    room: int,
    dev,
    steps: int,
    log,
    cache: Optional[Dict[float, int]] = None,
    grid: Sequence[float] = (1.0, 0.75, 0.5, 0.25, 0.0),
) -> Tuple[float, Dict[float, int]]:
    """The largest ``activation_memory_budget`` in [0, 1] whose in-microbatch peak on every
    development microbatch fits ``room``; every value tried. The peak is not monotone in the
    value (on CPU inductor, 0 peaked above 1 on cpu-small and cpu-ref: the backward graph
    recomputes every layer up front), so the grid is scanned from the top down to the first
    value that fits, then the interval above it is bisected ``steps`` times. ``cache``
    (value -> peak) lets a budget sweep compile each value once."""
    tried: Dict[float, int] = {}
    cache = {} if cache is None else cache

    def fits(b: float) -> bool:
        if b not in cache:
            _, cache[b] = compiled_peak(runner, b, head, dev)
        tried[b] = cache[b]
        log(f"[bench] compile-budget {b:.4f}: peak {tried[b]} B, room {room} B")
        return tried[b] <= room

    hi = None
    for b in grid:
        if fits(b):
            break
        hi = b
    else:
        raise PeerUnavailable(
            f"no activation_memory_budget in {list(grid)} fits the room of {room} B "
            f"(peaks {[tried[b] for b in grid]} B)"
        )
    lo = b
    if hi is None:
        return lo, tried
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, tried
