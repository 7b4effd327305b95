"""What a budget counts, and the peaks of one update in both scopes.

Two definitions of "memory" are legitimate, and every number must say which it uses
(``docs/DESIGN.md`` section 6):

- ``device`` (default, the paper's B_GC): everything alive on the rank during the update:
  the model's weights and buffers, the trainable parameters' gradients, the optimizer state,
  the activations and the head, and the optimizer step itself. Measured as the bytes of the
  model and its AdamW state that are resident when the update starts (``resident_bytes``),
  plus, per microbatch, the gradients accumulated so far and the peak allocated inside the
  microbatch, and, after the last microbatch, the peak of a real ``AdamW.step``.
- ``activations``: the peak of bytes allocated inside one microbatch (forward, loss,
  backward, its gradients), above what was alive when it began. Stricter: at the same ratio
  it leaves far less headroom, because the weights are not part of the base.

A budget in either scope becomes the same thing for every method: a cap on the in-microbatch
peak, ``B - offset`` with ``offset = resident_bytes`` (device) or 0 (activations), so HiLoRe
and the budget-tuned peers are fitted to exactly the same room.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List

import torch

from hilore_actor.learner.scope import optimizer_tensors, unique_storage_bytes  # the product's counters (DTensor-aware)


def resident_bytes(model, optimizer=None) -> int:
    """Bytes of the model's parameters and buffers and of the optimizer state (unique storages)."""
    tensors = list(model.parameters()) + list(model.buffers())
    if optimizer is not None:
        tensors += optimizer_tensors(optimizer)
    return unique_storage_bytes(tensors)


def grad_bytes(params) -> int:
    return unique_storage_bytes(p.grad for p in params if p.grad is not None)


def make_optimizer(params, lr: float = 1e-5):
    """AdamW over ``params`` with its state allocated (one zero-gradient step), so the state is
    resident before any measured update, as in every update after a run's first."""
    params = list(params)
    opt = torch.optim.AdamW(params, lr=lr)
    saved = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    with torch.no_grad():
        for p, s in zip(params, saved):
            p.copy_(s)
            p.grad = None
    return opt


@dataclass
class UpdatePeaks:
    """Peaks of one update: per microbatch in both scopes, and the optimizer step's device peak."""

    activations: List[int]  # in-microbatch peak of each microbatch
    device: List[int]  # resident + accumulated gradients + in-microbatch peak
    step_device: int  # resident + gradients + the AdamW step's own peak

    @property
    def device_peak(self) -> int:
        return max(self.device + [self.step_device])

    def to_dict(self) -> Dict:
        return {"activations": self.activations, "device": self.device, "step_device": self.step_device}


def update_peaks(run, params, optimizer, model, mbs) -> UpdatePeaks:
    """Run one update (``run(mb, measure_peak=True, accumulate=..., seed=i)`` per microbatch,
    then ``optimizer.step()``) and measure it in both scopes. The step is real, so it changes
    the weights: they are restored afterwards, so every method sees the same model."""
    from hilore_actor.runtime import MemoryMeter

    params = list(params)
    saved = [p.detach().clone() for p in params]
    state = {
        k: {n: (v.clone() if isinstance(v, torch.Tensor) else v) for n, v in st.items()}
        for k, st in optimizer.state.items()
    }
    for p in params:
        p.grad = None
    base = resident_bytes(model, optimizer)
    acts, dev = [], []
    for i, mb in enumerate(mbs):
        before = grad_bytes(params)
        r = run(mb, measure_peak=True, accumulate=i > 0, seed=i)
        acts.append(int(r.peak_bytes))
        dev.append(base + before + int(r.peak_bytes))
    device = params[0].device
    with MemoryMeter(device) as meter:
        optimizer.step()
    step = base + grad_bytes(params) + meter.peak_bytes
    with torch.no_grad():
        for p, s in zip(params, saved):
            p.copy_(s)
            p.grad = None
        for k, st in state.items():
            optimizer.state[k].update(st)
    return UpdatePeaks(acts, dev, int(step))
